"""No authentication: every caller is the one principal `local`.

Only for loopback binds unless the operator passes --allow-unauthenticated.
"""

from __future__ import annotations

LOCAL_PRINCIPAL = "local"


class NoAuth:
    async def authenticate(self, credential: str | None) -> str:
        return LOCAL_PRINCIPAL
