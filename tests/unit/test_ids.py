"""Record ids: a prefix, a millisecond clock and 80 random bits, unique across threads."""

from __future__ import annotations

import re
import threading
import time

from portico.domain.model import new_id

ID = re.compile(r"msg-[0-9a-f]{32}")


def test_ids_are_prefixed_128_bit_hex_and_do_not_repeat() -> None:
    ids = [new_id("msg") for _ in range(20_000)]  # crosses many pool refills
    assert all(ID.fullmatch(i) for i in ids)
    assert len(set(ids)) == len(ids)


def test_threads_draw_ids_of_their_own() -> None:
    made: list[list[str]] = [[] for _ in range(4)]

    def draw(out: list[str]) -> None:
        out.extend(new_id("msg") for _ in range(5_000))

    threads = [threading.Thread(target=draw, args=(out,)) for out in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [i for out in made for i in out]
    assert len(set(every)) == len(every) == 20_000


def test_ids_sort_by_creation_time() -> None:
    # Time-ordered ids keep the archive's id indexes growing at their end.
    earlier = [new_id("msg") for _ in range(100)]
    time.sleep(0.002)
    later = [new_id("msg") for _ in range(100)]
    assert max(earlier) < min(later)
    millis = int(later[0][4:16], 16)
    assert abs(millis - time.time() * 1000) < 60_000
