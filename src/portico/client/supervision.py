"""What both SDK clients share: the task that keeps a connection up, and `connect`
waiting for the first connection (or its failure)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


class Supervision:
    def __init__(self, kind: str) -> None:
        self._kind = kind
        self.task: asyncio.Task[None] | None = None
        self._first: asyncio.Future[None] | None = None

    async def start(
        self,
        supervise: Callable[[], Coroutine[Any, Any, None]],
        on_failure: Callable[[], Awaitable[None]],
    ) -> None:
        """Start supervising; return once the first connection is up, or run
        `on_failure` and raise what stopped it."""
        if self.task is not None:
            raise RuntimeError(f"{self._kind}.connect() was already called")
        self._first = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(supervise())
        try:
            await self._first
        except BaseException:
            await on_failure()
            raise

    def connected(self) -> None:
        """The first connection is up (later ones change nothing here)."""
        if self._first is not None and not self._first.done():
            self._first.set_result(None)

    def failed(self, error: BaseException) -> None:
        """The client stopped; `start` raises `error` if no connection was up yet."""
        if self._first is not None and not self._first.done():
            self._first.set_exception(error)
