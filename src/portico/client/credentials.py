"""What both SDK clients share for short-lived tokens: when to refresh, and the loop.

The server closes a connection `4401` "credential expired" shortly before its
token's `exp` (30 s, or half the token's remaining life when that is shorter; see
docs/auth.md). A client given a credential callback asks it for a new token before
then and sends it on the open connection (`credential` on `/v1/session` and
`/v1/rpc`), so the connection never has to close; if it closes anyway, the client
resumes with a token from the same callback.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeAlias

log = logging.getLogger("portico.client")

CredentialProvider: TypeAlias = Callable[[], Awaitable[str | None] | str | None]
# Refresh this long before `exp`: past the server's default 30 s margin, with room
# for a slow callback (an identity provider's round trip).
REFRESH_LEAD = 60.0
# For a short-lived token, at this fraction of its remaining life: the server closes
# at half of it at the earliest.
REFRESH_FRACTION = 0.4


def token_expiry(token: str | None) -> float | None:
    """A JWT's `exp` (Unix seconds), read without verifying: only to know when to ask
    for the next one (the server verifies). None for anything else."""
    if not token or token.count(".") != 2:
        return None
    payload = token.split(".")[1]
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (binascii.Error, ValueError):
        return None
    exp = claims.get("exp") if isinstance(claims, dict) else None
    return float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else None


def refresh_delay(expires_at: float, now: float, *, lead: float = REFRESH_LEAD) -> float:
    """Seconds from `now` until a token expiring at `expires_at` should be replaced."""
    remaining = expires_at - now
    # Both terms come before the server's close point, max(exp - 30 s, half the life).
    return max(0.0, remaining - lead, remaining * REFRESH_FRACTION)


async def ask(provider: CredentialProvider) -> str | None:
    value = provider()
    return await value if inspect.isawaitable(value) else value


async def keep_fresh(
    token: str | None,
    provider: CredentialProvider,
    send: Callable[[str], Awaitable[None]],
) -> None:
    """Until cancelled: before `token` nears its `exp`, ask `provider` and `send` the
    answer. Stops when a token has no `exp` or the callback has nothing later (the
    4401 and the resume with a fresh token then take over)."""
    while (expires_at := token_expiry(token)) is not None:
        await asyncio.sleep(refresh_delay(expires_at, time.time()))
        try:
            fresh = await ask(provider)
        except Exception as exc:  # the app's callback: its failure must not end the client
            log.warning("credential callback failed: %s", type(exc).__name__)
            return
        fresh_expiry = token_expiry(fresh)
        if fresh is None or fresh_expiry is None or fresh_expiry <= expires_at:
            return
        await send(fresh)
        token = fresh
