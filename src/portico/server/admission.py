"""Who may open a WebSocket: origin, capacity and drain checks, then the credential."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from aiohttp import web

from portico.auth.base import Identity

if TYPE_CHECKING:
    from portico.server.services import Services

ANY_ORIGIN = "*"
# Close codes of a socket that authenticates in-band (`/v1/rpc` connect, `/v1/session`
# hello) and did not in time: documented in docs/security.md.
CLOSE_HANDSHAKE_TIMEOUT = 4002  # no successful connect/hello within handshake_timeout
CLOSE_TRY_AGAIN_LATER = 1013  # RFC 6455: evicted to make room for a newer stranger


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """Browsers send Origin; other clients do not and are not subject to this check."""
    if origin is None:
        return True
    if ANY_ORIGIN in allowed:
        return True
    if allowed:
        return origin.rstrip("/").lower() in {a.rstrip("/").lower() for a in allowed}
    # Same-origin by default: a page served by this host (the demo page) may connect.
    return urlsplit(origin).netloc.lower() == (host or "").lower()


class ConnectionSlots:
    """Counts open WebSockets across every protocol against `max_connections`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        self.open += 1
        try:
            yield
        finally:
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


async def admit(request: web.Request, services: Services) -> Identity:
    """The caller's identity, or the HTTP refusal a browser or SDK can act on."""
    check_admission(request, services)
    return await services.identity_of(request)


def check_admission(request: web.Request, services: Services) -> None:
    """Refuse an upgrade from a foreign origin, while draining, or at capacity."""
    settings = services.settings
    if not origin_allowed(request.headers.get("Origin"), request.host, settings.origins):
        services.metrics.upgrades_refused.labels("origin").inc()
        raise web.HTTPForbidden(text="origin not allowed")
    if services.draining:
        services.metrics.upgrades_refused.labels("draining").inc()
        raise web.HTTPServiceUnavailable(text="server is draining", headers={"Retry-After": "1"})
    if services.slots.open >= services.slots.limit:
        services.metrics.upgrades_refused.labels("capacity").inc()
        raise web.HTTPServiceUnavailable(text="too many connections", headers={"Retry-After": "1"})
