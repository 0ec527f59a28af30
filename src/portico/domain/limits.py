"""Rate limits as pure arithmetic: time comes in as `now`, so tests need no clock."""

from __future__ import annotations


class TokenBucket:
    """`rate` tokens per second, holding at most `burst`; a full bucket to start."""

    __slots__ = ("_burst", "_rate", "_tokens", "_updated")  # two per connection

    def __init__(self, *, rate: float, burst: float, now: float) -> None:
        self._rate = rate
        self._burst = burst
        self._tokens = burst
        self._updated = now

    def allow(self, now: float, cost: float = 1.0) -> bool:
        """Take `cost` tokens if there are enough; refused requests take nothing."""
        # min(burst, tokens) written out (NaN included): twice per frame of a voice call.
        tokens = self._tokens + (now - self._updated) * self._rate
        if not tokens < self._burst:
            tokens = self._burst
        self._updated = now
        if cost > tokens:
            self._tokens = tokens
            return False
        self._tokens = tokens - cost
        return True
