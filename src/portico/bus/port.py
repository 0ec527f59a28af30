"""The Bus port: ordered topics every replica can read, and a control inbox per replica.

A topic (a session's turn output, a user's RPC updates) is an append-only log: each
entry gets a position, a subscriber reads from a position on, in order, each entry
once. Control (tool results, stop, interrupt, credential refresh) is addressed to the
replica running the turn: `send` appends to that replica's inbox, which only it reads.
The in-process default keeps everything in memory; bus/redis.py uses Redis Streams so
a reader that falls behind or reconnects after a Redis restart resumes at its position.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import msgspec

from portico.health import Health


class Entry(msgspec.Struct, frozen=True):
    position: str  # opaque, increasing within a topic; resume after it
    payload: bytes


class Bus(Protocol):
    async def publish(self, topic: str, payload: bytes) -> str:
        """Append to `topic`; the entry's position."""
        ...

    async def publish_batch(self, entries: Sequence[tuple[str, bytes]]) -> list[str]:
        """`publish` each (topic, payload) in order, in one round trip where the backend
        allows; their positions."""
        ...

    def subscribe(self, topic: str, after: str = "") -> AsyncIterator[Entry]:
        """Entries of `topic` after `after` ("": only new ones), in order, until closed."""
        ...

    async def last_position(self, topic: str) -> str:
        """The position of `topic`'s newest entry (the start of an empty topic): a
        `subscribe` after it reads only what comes next."""
        ...

    async def recent(self, topic: str, count: int) -> list[Entry]:
        """`topic`'s newest `count` entries (fewer if it holds fewer), newest first."""
        ...

    async def send(self, replica: str, payload: bytes) -> None:
        """Control for `replica`; its `inbox` yields it once."""
        ...

    def inbox(self, replica: str) -> AsyncIterator[bytes]: ...

    async def close(self) -> None: ...

    async def health(self, within: float) -> Health:
        """Readiness: the bus answers within `within` seconds."""
        ...
