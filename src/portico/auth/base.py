"""The Authenticator port.

Adapters extract the credential (the `Authorization: Bearer` header on `/ws`
and HTTP routes, `hello.credential` on `/v1/session`, `connect.token` on
`/v1/rpc`) and pass it here; an authenticator never sees a request.
"""

from __future__ import annotations

from typing import Protocol


class Authenticator(Protocol):
    async def authenticate(self, credential: str | None) -> str:
        """The principal id for this credential; raises `Unauthenticated`."""


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if any."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
