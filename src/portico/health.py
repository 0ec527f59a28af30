"""A backend's answer to a readiness check (`/readyz`), and the one way to take it.

Each port (archive, bus, session state, media) has `health(within)`. An in-process
backend is ready while the process runs; a networked one answers a cheap request
within `within` seconds. The reason is for operators: an exception's class and first
line, never a URL (a URL can carry a password) or a response body.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import msgspec

MAX_REASON = 200


class Health(msgspec.Struct, frozen=True):
    ready: bool
    reason: str


IN_PROCESS = Health(True, "in process")


async def probe(check: Awaitable[object], within: float) -> Health:
    """Await `check` for at most `within` seconds; any failure is the reason."""
    try:
        async with asyncio.timeout(within):
            await check
    except TimeoutError:
        return Health(False, f"no answer within {within:g}s")
    except Exception as exc:  # a port boundary: whatever the client library raised
        return Health(False, failure_reason(exc))
    return Health(True, "ok")


def failure_reason(exc: BaseException) -> str:
    detail = str(exc).strip().splitlines()
    reason = type(exc).__name__ + (f": {detail[0]}" if detail else "")
    return reason[:MAX_REASON]
