"""No authentication: every caller is the one principal `local`.

Only for loopback binds unless the operator passes --allow-unauthenticated.
"""

from __future__ import annotations

from portico.auth.base import Identity, IdentityAuthenticator

LOCAL_PRINCIPAL = "local"
_LOCAL = Identity(principal=LOCAL_PRINCIPAL)


class NoAuth(IdentityAuthenticator):
    async def identify(self, credential: str | None) -> Identity:
        return _LOCAL
