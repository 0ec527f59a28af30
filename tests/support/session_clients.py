"""Many SDK `/v1/session` clients at once, for the tests that cut their connections at
random: each resumes by itself, quickly, and gives up only after a minute."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from portico.client import ReconnectPolicy, SessionClient

# Short backoff (the cuts are the test's, not an outage), a bound on giving up.
CHAOS_POLICY = ReconnectPolicy(initial=0.02, maximum=0.2, give_up_after=60.0)


@asynccontextmanager
async def session_clients(url: str, count: int) -> AsyncIterator[list[SessionClient]]:
    """`count` clients of `url`, each with its session open before the caller goes on
    (a first connect that fails is reported, not retried: there is nothing to resume
    yet); all closed on the way out."""
    async with AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(SessionClient(url, reconnect=CHAOS_POLICY))
            for _ in range(count)
        ]
