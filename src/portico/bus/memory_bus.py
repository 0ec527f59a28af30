"""The in-process bus: one process, lists and futures, no copies of payloads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from portico.bus.port import Entry
from portico.health import IN_PROCESS, Health


class _Log:
    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.changed = asyncio.Event()

    def append(self, payload: bytes) -> str:
        position = str(len(self.entries) + 1)
        self.entries.append(Entry(position, payload))
        self.changed.set()
        self.changed = asyncio.Event()
        return position


class InProcessBus:
    def __init__(self, max_len: int = 10_000) -> None:
        self._topics: dict[str, _Log] = {}
        self._inboxes: dict[str, asyncio.Queue[bytes]] = {}
        self._max_len = max_len

    def _log(self, topic: str) -> _Log:
        return self._topics.setdefault(topic, _Log())

    async def publish(self, topic: str, payload: bytes) -> str:
        return self._log(topic).append(payload)

    async def publish_batch(self, entries: Sequence[tuple[str, bytes]]) -> list[str]:
        return [self._log(topic).append(payload) for topic, payload in entries]

    async def subscribe(self, topic: str, after: str = "") -> AsyncIterator[Entry]:
        log = self._log(topic)
        index = int(after) if after else len(log.entries)
        while True:
            while index < len(log.entries):
                yield log.entries[index]
                index += 1
            await log.changed.wait()

    async def last_position(self, topic: str) -> str:
        return str(len(self._log(topic).entries))

    async def recent(self, topic: str, count: int) -> list[Entry]:
        entries = self._log(topic).entries
        return entries[: -count - 1 : -1] if count > 0 else []

    def _queue(self, replica: str) -> asyncio.Queue[bytes]:
        return self._inboxes.setdefault(replica, asyncio.Queue())

    async def send(self, replica: str, payload: bytes) -> None:
        self._queue(replica).put_nowait(payload)

    async def inbox(self, replica: str) -> AsyncIterator[bytes]:
        queue = self._queue(replica)
        while True:
            yield await queue.get()

    async def health(self, within: float) -> Health:
        return IN_PROCESS

    async def close(self) -> None:
        self._topics.clear()
