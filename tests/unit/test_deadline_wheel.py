"""The sockets' shared deadline wheel (server/deadlines.py): never late, never leaks."""

from __future__ import annotations

import asyncio

from portico.server.deadlines import DeadlineWheel


class Owner:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.fired: list[float] = []
        self.woken = asyncio.Event()

    def slot_fired(self) -> None:
        self.fired.append(self.loop.time())
        self.woken.set()


async def test_a_slot_fires_at_or_before_every_deadline_in_it() -> None:
    loop = asyncio.get_running_loop()
    wheel = DeadlineWheel(resolution=0.05)
    owners = [Owner(loop) for _ in range(3)]
    deadlines = [loop.time() + 0.12 + 0.01 * i for i in range(3)]
    keys = [wheel.add(owner, deadline) for owner, deadline in zip(owners, deadlines, strict=True)]
    for key, deadline in zip(keys, deadlines, strict=True):
        assert wheel.starts(key) <= deadline < wheel.starts(key) + wheel.resolution
    async with asyncio.timeout(5):  # a deadline, not a threshold
        for owner in owners:
            await owner.woken.wait()
    for owner, key in zip(owners, keys, strict=True):
        assert owner.fired[0] >= wheel.starts(key)
    assert len(wheel) == 0  # fired slots are gone


async def test_owners_of_one_slot_share_its_timer_and_a_discarded_one_is_not_woken() -> None:
    loop = asyncio.get_running_loop()
    wheel = DeadlineWheel(resolution=0.05)
    kept, gone = Owner(loop), Owner(loop)
    deadline = loop.time() + 0.1
    key = wheel.add(kept, deadline)
    assert wheel.add(gone, deadline) == key
    assert len(wheel._slots) == 1
    assert len(wheel) == 2
    wheel.discard(gone, key)
    await asyncio.wait_for(kept.woken.wait(), 5)
    await asyncio.sleep(0.06)
    assert gone.fired == []


async def test_the_last_owner_leaving_cancels_the_slot() -> None:
    loop = asyncio.get_running_loop()
    wheel = DeadlineWheel(resolution=0.05)
    owner = Owner(loop)
    key = wheel.add(owner, loop.time() + 0.06)
    wheel.discard(owner, key)
    assert wheel._slots == {}  # no timer and no entry left behind for a closed socket
    wheel.discard(owner, key)  # twice is harmless
    await asyncio.sleep(0.15)
    assert owner.fired == []
