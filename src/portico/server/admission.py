"""Who may open a WebSocket: origin, capacity and drain checks, then the credential.

The counters it consults live in server/capacity.py, which `Services` builds: so this
module imports `Services` and `Services` does not import it."""

from __future__ import annotations

from typing import TYPE_CHECKING
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
