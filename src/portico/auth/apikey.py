"""Static API keys mapped to principal ids."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from portico.auth.base import Identity, IdentityAuthenticator
from portico.errors import Unauthenticated


class ApiKeyAuth(IdentityAuthenticator):
    def __init__(self, keys: Mapping[str, str]) -> None:
        self._keys = dict(keys)

    async def identify(self, credential: str | None) -> Identity:
        if credential:
            # Compare against every key in constant time so timing leaks no prefix.
            for token, principal in self._keys.items():
                if hmac.compare_digest(token.encode(), credential.encode()):
                    return Identity(principal=principal)
        raise Unauthenticated("missing or invalid API key")
