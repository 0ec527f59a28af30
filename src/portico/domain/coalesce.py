"""Merging text that is ready together, so it crosses a hop as one message.

Chunk boundaries carry no meaning in the protocols Portico speaks (the concatenated
text is the reply), so consecutive text pieces that are already at hand may leave as
one. Only adjacent text merges: anything else (a tool call, media, parts, usage, the
terminal message) stays where it is and splits the text around it. Nothing here
waits: callers pass what is queued now (docs/runtime-grpc.md, "Chunk boundaries").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def merge_adjacent_text(
    items: Iterable[T], text_of: Callable[[T], str | None], make: Callable[[str], T]
) -> list[T]:
    """`items` in order with each run of text items (`text_of` not None) made one."""
    merged: list[T] = []
    run: list[tuple[T, str]] = []

    def flush() -> None:
        if len(run) == 1:  # a run of one stays the item it was
            merged.append(run[0][0])
        elif run:
            merged.append(make("".join(text for _, text in run)))
        run.clear()

    for item in items:
        text = text_of(item)
        if text is None:
            flush()
            merged.append(item)
        else:
            run.append((item, text))
    flush()
    return merged
