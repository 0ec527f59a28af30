"""Static API keys mapped to principal ids."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from portico.errors import Unauthenticated


class ApiKeyAuth:
    def __init__(self, keys: Mapping[str, str]) -> None:
        self._keys = dict(keys)

    async def authenticate(self, credential: str | None) -> str:
        if credential:
            # Compare against every key in constant time so timing leaks no prefix.
            for token, principal in self._keys.items():
                if hmac.compare_digest(token.encode(), credential.encode()):
                    return principal
        raise Unauthenticated("missing or invalid API key")
