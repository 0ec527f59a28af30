"""A bounded cache of verified JWTs, so a client reconnecting with the same token skips
the signature check (a verification costs 50-100 µs a token; a hit costs a hash).

Only tokens that passed full verification are stored, so junk from a stranger can neither
grow it nor evict real users' entries. A hit is used only while the token's own time
window (`nbf`..`exp`, widened by the leeway) holds and only while the key set still holds
the very key object it was verified with; otherwise the entry is dropped and the token is
verified afresh, which gives the precise rejection. Least recently used entries go first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from portico.auth.base import Identity
from portico.errors import Unauthenticated


class TimeWindow(NamedTuple):
    not_before: float  # nbf minus leeway (minus infinity without nbf)
    not_after: float  # exp plus leeway

    @classmethod
    def of(cls, claims: dict[str, Any], leeway: float) -> TimeWindow:
        """From verified claims (`check_claims` has required `exp` and checked both are numbers)."""
        nbf = claims.get("nbf")
        not_before = float(nbf) - leeway if nbf is not None else float("-inf")
        return cls(not_before, float(claims["exp"]) + leeway)

    def check(self, now: float) -> None:
        if now >= self.not_after:
            raise Unauthenticated("token expired")
        if now < self.not_before:
            raise Unauthenticated("token not yet valid")


class Verified(NamedTuple):
    identity: Identity
    window: TimeWindow
    kid: str | None
    key: object  # the key set's entry it was verified with; compared by identity


def token_digest(token: str) -> bytes:
    """The cache key: a fixed 32 bytes whatever the token's size."""
    return hashlib.sha256(token.encode()).digest()


class VerifiedTokens:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[bytes, Verified] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self, digest: bytes, now: float, current_key: Callable[[str | None], object]
    ) -> Identity | None:
        """The cached identity, if in its window and its key is still `current_key(kid)`."""
        entry = self._entries.get(digest)
        if entry is None:
            return None
        window = entry.window
        if (
            current_key(entry.kid) is not entry.key
            or not window.not_before <= now < window.not_after
        ):
            del self._entries[digest]  # expired or its key rotated away: verify afresh
            return None
        self._entries.move_to_end(digest)
        return entry.identity

    def put(self, digest: bytes, entry: Verified) -> None:
        if self._capacity <= 0:
            return
        self._entries[digest] = entry
        self._entries.move_to_end(digest)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
