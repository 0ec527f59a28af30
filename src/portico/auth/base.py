"""The Authenticator port.

Adapters extract the credential (the `Authorization: Bearer` header on `/ws`
and HTTP routes, or a `Sec-WebSocket-Protocol` entry on `/ws` from a browser,
`hello.credential` on `/v1/session`, `connect.token` on `/v1/rpc`) and pass it
here; an authenticator never sees a request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, Protocol

import msgspec

# A browser cannot set `Authorization` on a WebSocket upgrade; it offers the token
# as a subprotocol entry `portico.bearer.<token>` next to a real subprotocol name,
# and the server selects the real one, so the token is never echoed (docs/auth.md).
BEARER_SUBPROTOCOL_PREFIX = "portico.bearer."


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """A verified credential: whose it is, until when, and what it asserts."""

    principal: str
    expires_at: float | None = None  # Unix seconds; None: does not expire (API keys, none)
    # The session-binding claim's value (`jwt_session_claim`); "" when unbound.
    session_value: str = ""
    claims: dict[str, Any] = msgspec.field(default_factory=dict)


class Authenticator(Protocol):
    async def identify(self, credential: str | None) -> Identity:
        """The verified identity for this credential; raises `Unauthenticated`."""

    async def authenticate(self, credential: str | None) -> str:
        """The principal id for this credential; raises `Unauthenticated`."""


class IdentityAuthenticator(ABC):
    """An authenticator defined by `identify`; `authenticate` is its principal."""

    @abstractmethod
    async def identify(self, credential: str | None) -> Identity: ...

    async def authenticate(self, credential: str | None) -> str:
        return (await self.identify(credential)).principal


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if any."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def offered_subprotocols(header: str | None) -> list[str]:
    """The entries of a `Sec-WebSocket-Protocol` request header, in order."""
    if not header:
        return []
    return [entry.strip() for entry in header.split(",") if entry.strip()]


def subprotocol_token(offered: Iterable[str]) -> str | None:
    """The token a browser offered as `portico.bearer.<token>`, if any."""
    for entry in offered:
        if entry.startswith(BEARER_SUBPROTOCOL_PREFIX):
            return entry[len(BEARER_SUBPROTOCOL_PREFIX) :] or None
    return None
