"""Far deadlines of many sockets on a few loop timers (docs/performance.md, idle connections).

Every idle connection has a deadline (its next keepalive ping, 30 s away by default).
A loop timer per connection costs about 700 bytes (the handle, libuv's timer, a
context); here deadlines more than one `resolution` away share one timer per slot of
`resolution` seconds, and a socket costs one entry in that slot's table (a dict used as
an ordered set: a compact dict costs about half a set's bytes per entry at 10,000).

A slot fires at its start, at or before every deadline in it, never after: its owners
then arm a precise loop timer for what is left (less than `resolution`), so no deadline
is late by more than the loop itself makes it.
"""

from __future__ import annotations

import asyncio
import math
from typing import Protocol

RESOLUTION = 1.0  # seconds; deadlines nearer than this get a loop timer of their own


class Owner(Protocol):
    def slot_fired(self) -> None:
        """The slot holding this owner's deadline began: arm for what is left."""


class DeadlineWheel:
    __slots__ = ("_loop", "_slots", "resolution")

    def __init__(self, resolution: float = RESOLUTION) -> None:
        self.resolution = resolution
        self._loop: asyncio.AbstractEventLoop | None = None  # the first user's
        self._slots: dict[int, tuple[asyncio.TimerHandle, dict[Owner, None], int]] = {}

    def add(self, owner: Owner, deadline: float) -> int:
        """Hold `owner` until the slot of `deadline` begins; returns the slot's key."""
        key = math.floor(deadline / self.resolution)
        entry = self._slots.get(key)
        if entry is not None:
            entry[1][owner] = None
            # The slot's own key object: the owner keeps it, and an int this large is a
            # new 32-byte object per call.
            return entry[2]
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        handle = self._loop.call_at(key * self.resolution, self._fire, key)
        self._slots[key] = (handle, {owner: None}, key)
        return key

    def starts(self, key: int) -> float:
        """The loop time slot `key` fires at."""
        return key * self.resolution

    def discard(self, owner: Owner, key: int) -> None:
        entry = self._slots.get(key)
        if entry is None:
            return
        handle, owners, _ = entry
        owners.pop(owner, None)
        if not owners:  # nobody left to wake: no timer, no entry
            handle.cancel()
            del self._slots[key]

    def _fire(self, key: int) -> None:
        _, owners, _ = self._slots.pop(key)
        for owner in owners:
            owner.slot_fired()

    def __len__(self) -> int:
        return sum(len(owners) for _, owners, _ in self._slots.values())
