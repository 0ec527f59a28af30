"""Closing a networked backend's client without letting it hang the shutdown.

redis-py's `aclose` waits for every connection's socket to finish closing, and a
socket whose command bytes still wait for a server that stopped reading (paused,
unreachable, a dead host) does not finish: the close then takes the connection's own
timeout if it has one, for ever if not (redis-py issue #3941), and raises on the
way. A replica stopping (drain, SIGTERM) must not hang on it, nor fail on it: every
Redis-backed port (the bus, the session state, the call directory) closes through
`close_within`, one bound for all of it (`redis_close_timeout`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any, Protocol

from portico.health import failure_reason

log = logging.getLogger("portico.closing")
CLOSE_TIMEOUT = 5.0  # seconds: the `redis_close_timeout` default


class Closable(Protocol):
    def aclose(self) -> Any: ...


async def close_within(
    what: str, client: Closable, within: float, tasks: Iterable[asyncio.Task[Any]] = ()
) -> None:
    """Cancel `tasks` (the client's background users, such as renewals) and close
    `client`, waiting at most `within` seconds for all of it. Past the bound, or when
    the close fails, a warning names `what` and this returns: the process is
    stopping, and what is left open goes with it. Never raises."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    running = {task for task in tasks if not task.done()}
    for task in running:
        task.cancel()
    if running:
        # A cancelled task may not end at once (redis-py shields a pipeline's
        # round trip from cancellation): waited for, within the same bound.
        await asyncio.wait(running, timeout=within)
    # The close runs as a task of its own so that giving up on it never waits for
    # it (awaiting a cancelled close could hang just as the close did).
    closing = asyncio.ensure_future(client.aclose())
    await asyncio.wait({closing}, timeout=max(0.0, deadline - loop.time()))
    if not closing.done():
        closing.cancel()
        closing.add_done_callback(_retrieved)
        log.warning("%s: closing the Redis client took over %g s; left open", what, within)
        return
    failure = None if closing.cancelled() else closing.exception()
    if failure is not None:
        log.warning("%s: closing the Redis client failed: %s", what, failure_reason(failure))


def _retrieved(task: asyncio.Future[Any]) -> None:
    """The abandoned close's outcome, taken so asyncio does not report it as lost."""
    if not task.cancelled():
        task.exception()
