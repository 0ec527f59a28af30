"""What both SDK clients share: the task that keeps a connection up, `connect`
waiting for the first connection (or its failure), and one connection's life."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass(frozen=True, kw_only=True)
class ReconnectPolicy:
    """Exponential backoff with jitter between reconnection attempts (spec §8)."""

    initial: float = 0.25  # seconds before the first retry
    maximum: float = 8.0  # seconds, the longest wait between attempts
    factor: float = 2.0  # each failed attempt multiplies the wait by this
    jitter: float = 0.5  # up to this fraction of each wait is taken off at random
    give_up_after: float | None = 120.0  # seconds without a connection; None: never

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait before retry number `attempt` (0 for the first)."""
        base = min(self.maximum, self.initial * self.factor**attempt)
        # Jitter spreads the reconnects of many clients a server dropped at once.
        return base * (1.0 - self.jitter * rng.random())


class Retries:
    """When to try again: exponential backoff since the last connection that worked,
    and the clock that gives up (`give_up_after`) with the client's own error type."""

    def __init__(
        self,
        policy: ReconnectPolicy,
        rng: random.Random,
        lost: Callable[[str], Exception],
    ) -> None:
        self._policy = policy
        self._rng = rng
        self._lost = lost
        self._attempt = 0  # failed attempts since the last connection that worked
        self._lost_since: float | None = None

    def connected(self) -> None:
        self._attempt, self._lost_since = 0, None

    def next_delay(self) -> float:
        """Seconds to wait before the next attempt; raises `lost(...)` past the limit."""
        now = asyncio.get_running_loop().time()
        self._lost_since = now if self._lost_since is None else self._lost_since
        lost_for, limit = now - self._lost_since, self._policy.give_up_after
        if limit is not None and lost_for >= limit:
            raise self._lost(f"no connection for {lost_for:.0f} s; giving up")
        delay = self._policy.delay(self._attempt, self._rng)
        self._attempt += 1
        return delay


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


async def open_socket(
    http: aiohttp.ClientSession,
    url: str,
    deadline: float,
    *,
    max_frame_bytes: int,
    close_timeout: float,
    **options: Any,
) -> aiohttp.ClientWebSocketResponse:
    """The upgrade, done by `deadline` (loop time); raises as aiohttp does, or TimeoutError."""
    async with asyncio.timeout_at(deadline):
        ws: aiohttp.ClientWebSocketResponse = await http.ws_connect(
            url,
            max_msg_size=max_frame_bytes + 1,  # aiohttp's limit is exclusive
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=close_timeout),
            **options,
        )
    return ws


async def serve_socket(
    ws: aiohttp.ClientWebSocketResponse,
    running: asyncio.Task[None],
    handshake: Awaitable[bool],
    *,
    abort: Callable[[], None],
    before_cleanup: Callable[[], None],
) -> bool:
    """Wait for the handshake, then for the socket's end (`running` reads it); whatever
    happens, the reader is stopped and the socket closed. True when the handshake worked."""
    try:
        opened = await handshake
        await running
    finally:
        before_cleanup()
        if not running.done():
            abort()
            running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        if not ws.closed:
            await ws.close()
    return opened
