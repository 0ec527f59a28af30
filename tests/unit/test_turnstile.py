"""calls/turnstile.py: one at a time, in arrival order; an entry nobody contends is a
flag; a waiter cancelled before or after its turn came never blocks the next."""

from __future__ import annotations

import asyncio

from portico.calls.turnstile import Turnstile


async def through(gate: Turnstile, name: str, log: list[str], release: asyncio.Event) -> None:
    if gate.busy:
        await gate.wait()
    gate.busy = True
    try:
        log.append(f"in {name}")
        await release.wait()
        log.append(f"out {name}")
    finally:
        gate.leave()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_uncontended_entry_waits_for_nothing_and_leaving_frees_it() -> None:
    gate = Turnstile()
    assert not gate.busy
    gate.busy = True
    gate.leave()
    assert not gate.busy


async def test_entrants_go_through_one_at_a_time_in_arrival_order() -> None:
    gate, log, release = Turnstile(), [], asyncio.Event()
    tasks = [asyncio.ensure_future(through(gate, name, log, release)) for name in "abc"]
    await settle()
    assert log == ["in a"]
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert log == ["in a", "out a", "in b", "out b", "in c", "out c"]
    assert not gate.busy


async def test_a_waiter_cancelled_while_waiting_is_skipped() -> None:
    gate, log, release = Turnstile(), [], asyncio.Event()
    a, b, c = (asyncio.ensure_future(through(gate, name, log, release)) for name in "abc")
    await settle()
    b.cancel()
    await settle()
    release.set()
    await asyncio.wait_for(asyncio.gather(a, c), 5)
    assert log == ["in a", "out a", "in c", "out c"]
    assert not gate.busy


async def test_a_waiter_cancelled_after_its_turn_came_passes_it_on() -> None:
    gate, log, release = Turnstile(), [], asyncio.Event()
    gate.busy = True  # someone is through
    b, c = (asyncio.ensure_future(through(gate, name, log, release)) for name in "bc")
    await settle()
    gate.leave()  # b's turn: granted, b not yet run...
    b.cancel()  # ...and cancelled before it runs
    release.set()
    await asyncio.wait_for(c, 5)
    assert log == ["in c", "out c"]
    assert not gate.busy
