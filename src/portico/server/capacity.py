"""Capacity counters: open WebSockets, unauthenticated sockets, connections per principal.

Plain counters sized from settings, with no knowledge of requests or services, so both
`Services` (which holds them) and the admission checks (which read them) import this.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from portico.config import Settings


class ConnectionSlots:
    """Counts open WebSockets across every protocol against `max_connections`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    # `take` and `give` rather than a context manager: an `async with` object and its
    # generator frame would stay alive, per idle connection, for the connection's life.
    def take(self) -> None:
        self.open += 1

    def give(self) -> None:
        self.open -= 1


class Stranger(Protocol):
    def evict(self) -> None:
        """Close: a newer unauthenticated socket needs the slot."""


class Strangers:
    """Sockets upgraded but not yet authenticated, at most `limit` of them.

    When the budget is full the oldest is evicted to make room, so a stranger can
    never lock out the next client: a real client authenticates within a round trip,
    long before `limit` newer strangers arrive behind it (FIFO eviction).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiting: dict[Stranger, None] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._waiting)

    def arrived(self, socket: Stranger) -> None:
        while len(self._waiting) >= self.limit:
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.evict()
        self._waiting[socket] = None

    def left(self, socket: Stranger) -> None:
        """Authenticated, timed out or closed."""
        self._waiting.pop(socket, None)


class PrincipalSlots:
    """Open connections per principal, across every protocol, against `limit` (None:
    no cap)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._open: Counter[str] = Counter()

    def take(self, principal: str) -> bool:
        if self.limit is not None and self._open[principal] >= self.limit:
            return False
        self._open[principal] += 1
        return True

    def give(self, principal: str) -> None:
        self._open[principal] -= 1
        if self._open[principal] <= 0:
            del self._open[principal]


def principal_cap(settings: Settings) -> int | None:
    """Connections one principal may hold. Without authentication every client is the
    one principal `local`: a cap per principal would be a second, smaller
    `max_connections`, so it applies only when the auth port tells clients apart."""
    return None if settings.auth == "none" else settings.max_connections_per_principal


def stranger_budget(settings: Settings) -> int:
    """Unauthenticated sockets never hold more than half the connections."""
    return min(settings.max_unauthenticated_connections, max(1, settings.max_connections // 2))
