"""The aiohttp application: one port for WebSocket, HTTP routes and probes."""

from __future__ import annotations

import asyncio
import gc
import importlib.resources
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from portico.config import Settings
from portico.core.periodic import every
from portico.server import media_routes, observability
from portico.server.drain import drain
from portico.server.http_limits import runner_options
from portico.server.rpc_ws import rpc_handler
from portico.server.services import SERVICES, Services
from portico.server.session_ws import LIVE_SESSIONS, session_handler
from portico.server.startup import check_startup, listen_failure
from portico.server.websocket import omnia_handler

log = logging.getLogger("portico.server")

HOUSEKEEPING = web.AppKey("housekeeping", list[asyncio.Task[None]])
# The cyclic collector runs its youngest generation every 10,000 container
# allocations instead of 700: a streaming server allocates hundreds of short-lived
# ones per turn, nearly all freed by reference counting, and the default made the
# collector about 5 % of the event loop's and the archive thread's time (GIL held).
GC_THRESHOLDS = (10_000, 10, 10)

# The demo chat page (src/portico/web): static files, served as they are.
WEB_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# No inline script or style, no other origin: model output rendered by the page can
# never run as code. Agent media arrive as data: URLs, uploads are read back as blobs.
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data: blob:; media-src 'self' data: blob:; connect-src 'self'{extra}; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


async def _open(app: web.Application) -> None:
    services = app[SERVICES]
    settings = services.settings
    await services.store.open()
    await services.media.open()
    await services.engine.start()
    # At once: what expired while the server was stopped goes first.
    prune = _prune_updates(services)
    jobs = [every(settings.update_prune_interval, "update prune", prune, at_once=True)]
    if services.media.enabled:
        jobs.append(
            every(
                settings.media_sweep_interval,
                "media sweep",
                services.media.sweep_expired,
                at_once=True,
            )
        )
    app[HOUSEKEEPING] = [asyncio.create_task(job) for job in jobs]
    services.lifecycle.started()


def _prune_updates(services: Services) -> Callable[[], Awaitable[int]]:
    async def prune() -> int:
        return await services.store.prune_updates(time.time() - services.settings.update_retention)

    return prune


async def _close_sockets(app: web.Application) -> None:
    """What a drain left open (or everything, when the app stops without one)."""
    services = app[SERVICES]
    services.lifecycle.stop_requested(asyncio.get_running_loop().time())
    await asyncio.gather(
        *(connection.going_away() for connection in list(services.connections)),
        return_exceptions=True,
    )


async def _stop(app: web.Application) -> None:
    services = app[SERVICES]
    jobs = app.get(HOUSEKEEPING, [])
    for job in jobs:
        job.cancel()
    await asyncio.gather(*jobs, return_exceptions=True)
    await services.calls.shutdown()  # each call's last voice turn is archived first
    await services.engine.shutdown()
    await services.media.close()
    await services.shared.close()
    await services.store.close()


def create_app(settings: Settings) -> web.Application:
    app = web.Application()
    app[SERVICES] = Services(settings)
    app[LIVE_SESSIONS] = {}
    app.router.add_get("/ws", omnia_handler)
    app.router.add_get("/v1/session", session_handler)
    app.router.add_get("/v1/rpc", rpc_handler)
    observability.add_routes(app)
    media_routes.add_routes(app)
    add_page_routes(app, settings)
    app.on_startup.append(_open)
    app.on_shutdown.append(_close_sockets)
    app.on_cleanup.append(_stop)
    return app


def _object_storage_origin(settings: Settings) -> str:
    """With `media: s3` the page PUTs uploads to, and follows downloads to, the bucket."""
    if settings.media != "s3":
        return ""
    url = settings.s3_public_url or settings.s3_endpoint_url
    if url is None:
        return " https://*.amazonaws.com"
    endpoint = urlsplit(url)
    return f" {endpoint.scheme}://{endpoint.netloc}"


def add_page_routes(app: web.Application, settings: Settings) -> None:
    """`/` and `/web/{name}`: the demo chat page. Files are read once, from a fixed list."""
    folder = importlib.resources.files("portico") / "web"
    files: dict[str, tuple[bytes, str]] = {}
    if folder.is_dir():
        for entry in folder.iterdir():
            content_type = WEB_CONTENT_TYPES.get("." + entry.name.rpartition(".")[2])
            if entry.is_file() and content_type is not None:
                files[entry.name] = (entry.read_bytes(), content_type)
    # Upload URLs start with the public URL when one is set: the page PUTs there.
    public = urlsplit(settings.public_url or "")
    extra = f" {public.scheme}://{public.netloc}" if public.scheme and public.netloc else ""
    extra += _object_storage_origin(settings)
    headers = {
        "Content-Security-Policy": PAGE_CSP.format(extra=extra),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }

    def respond(name: str) -> web.Response:
        found = files.get(name)
        if found is None:
            raise web.HTTPNotFound(text="no such file")
        body, content_type = found
        return web.Response(body=body, headers={**headers, "Content-Type": content_type})

    async def index(request: web.Request) -> web.Response:
        return respond("index.html")

    async def asset(request: web.Request) -> web.Response:
        return respond(request.match_info["name"])

    app.router.add_get("/", index)
    app.router.add_get("/web/{name}", asset)


def _tune_garbage_collector() -> None:
    """Once serving: what is alive now (modules, settings, caches) lives as long as the
    process, so it is frozen out of every later collection (a pass of the oldest
    generation over it paused the event loop about 30 ms), and see GC_THRESHOLDS."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def serve(settings: Settings, *, on_ready: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM; announce the URL once connections are accepted.
    An address or data dir that cannot be used raises `StartupError`."""
    check_startup(settings)
    app = create_app(settings)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, **runner_options(settings))
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    try:
        await site.start()
    except OSError as exc:  # taken since check_startup()
        await runner.cleanup()
        raise listen_failure(exc, settings.host, settings.port) from exc
    host, port = runner.addresses[0][:2]
    _tune_garbage_collector()
    on_ready(f"Portico serving http://{host}:{port}/ (Omnia WebSocket: ws://{host}:{port}/ws)")
    loop = asyncio.get_running_loop()
    services = app[SERVICES]
    stopping = asyncio.Event()

    def stop_signal() -> None:
        # Draining from this very moment: /readyz and new upgrades answer 503 at once.
        # A second signal cuts the drain short (the lifecycle moves its deadline).
        services.lifecycle.stop_requested(loop.time())
        stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_signal)
    try:
        await stopping.wait()
        await drain(services)
    finally:
        log.info("shutting down")
        await runner.cleanup()
