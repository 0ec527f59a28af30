"""Who may open a WebSocket: origin, capacity and drain checks, then the credential."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from aiohttp import web

from portico.auth.base import Identity

if TYPE_CHECKING:
    from portico.server.services import Services

ANY_ORIGIN = "*"


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
