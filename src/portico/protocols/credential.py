"""A connection's credential deadline and its refresh rule, sans-I/O (spec identity.md).

Shared by the three protocol cores. Time arrives as `now` (the adapter's monotonic
clock); a token's `exp` is wall-clock, so it is placed on the monotonic clock once,
when the token is accepted, with the wall-clock time at that `now`.

- The deadline is the token's `exp`. The connection closes (4401) `margin` seconds
  before it, or at half the token's remaining life (counted from when it was
  accepted) when that is shorter, once no turn is running on it.
- A message after the deadline is refused (`CREDENTIAL_EXPIRED`).
- A refresh is accepted only for the same principal, the same session-binding value
  and a later expiry; anything else, a repeat of the current token included, is
  ignored.
"""

from __future__ import annotations

import math

from portico.auth.base import Identity

CLOSE_CREDENTIAL_EXPIRED = 4401
CREDENTIAL_EXPIRED_REASON = "credential expired"


def held_off(clock: CredentialClock | Unexpiring, now: float, turn_running: bool) -> bool:
    """A close that is due waits for `turn_running`: marked due, so the clock stops
    asking for a timer (a keepalive timer or the turn's end asks again)."""
    if turn_running:
        clock.close_due(now, turn_running=True)
    return turn_running


class CredentialClock:
    __slots__ = ("_closing", "_margin", "close_at", "deadline", "identity")  # one per connection

    def __init__(self, identity: Identity, *, margin: float, now: float, wall: float) -> None:
        """`wall` is the wall-clock time (Unix seconds) at `now`."""
        self._margin = margin
        self.identity = identity
        self.deadline = math.inf
        self.close_at = math.inf
        self._closing = False  # the close is due; it waits only for a running turn
        self._place(identity, now=now, wall=wall)

    def _place(self, identity: Identity, *, now: float, wall: float) -> None:
        self.identity = identity
        self._closing = False
        if identity.expires_at is None:  # API keys, auth none: no deadline
            self.deadline = self.close_at = math.inf
            return
        remaining = identity.expires_at - wall
        self.deadline = now + remaining
        self.close_at = self.deadline - min(self._margin, max(remaining, 0.0) / 2)

    def expired(self, now: float) -> bool:
        """A message arriving at `now` comes after the deadline."""
        return now >= self.deadline

    def close_due(self, now: float, *, turn_running: bool) -> bool:
        """Whether to close with 4401 now: the close point passed and no turn runs."""
        if now >= self.close_at:
            self._closing = True
        return self._closing and not turn_running

    def close_point_passed(self, now: float) -> bool:
        """The close is due but for a running turn (asks nothing of the turn)."""
        return self._closing or now >= self.close_at

    def next_deadline(self) -> float:
        """When to ask `close_due` again; once the close is due, a turn's end asks."""
        return math.inf if self._closing else self.close_at

    def refresh(self, new: Identity, *, now: float, wall: float) -> bool:
        """Take `new` when it may replace the current credential; False: ignored."""
        current = self.identity
        if (
            new.principal != current.principal
            or new.session_value != current.session_value
            or new.expires_at is None
            or current.expires_at is None
            or new.expires_at <= current.expires_at
        ):
            return False
        self._place(new, now=now, wall=wall)
        return True


class Unexpiring:
    """The clock of a credential that never expires (API keys, `auth: none`): it has no
    deadline and takes no refresh (a refresh needs a current expiry), so it holds
    nothing and one instance serves every such connection."""

    __slots__ = ()

    def expired(self, now: float) -> bool:
        return False

    def close_point_passed(self, now: float) -> bool:
        return False

    def close_due(self, now: float, *, turn_running: bool) -> bool:
        return False

    def next_deadline(self) -> float:
        return math.inf

    def refresh(self, new: Identity, *, now: float, wall: float) -> bool:
        return False


UNEXPIRING = Unexpiring()


def clock_for(
    identity: Identity, *, margin: float, now: float, wall: float
) -> CredentialClock | Unexpiring:
    """A `CredentialClock` for a credential with an expiry; else the shared `UNEXPIRING`
    (an idle connection keeps no clock of its own, docs/performance.md)."""
    if identity.expires_at is None:
        return UNEXPIRING
    return CredentialClock(identity, margin=margin, now=now, wall=wall)
