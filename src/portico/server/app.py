"""The aiohttp application: one port for WebSocket, HTTP routes and probes."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from aiohttp import WSCloseCode, web

from portico.config import Settings
from portico.server import observability
from portico.server.services import SERVICES, Services
from portico.server.websocket import omnia_handler

log = logging.getLogger("portico.server")


async def _open(app: web.Application) -> None:
    services = app[SERVICES]
    await services.store.open()
    await services.engine.start()
    services.ready = True


async def _close_sockets(app: web.Application) -> None:
    services = app[SERVICES]
    services.ready = False
    await asyncio.gather(
        *(
            ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
            for ws in list(services.websockets)
        ),
        return_exceptions=True,
    )


async def _stop(app: web.Application) -> None:
    services = app[SERVICES]
    await services.engine.shutdown()
    await services.store.close()


def create_app(settings: Settings) -> web.Application:
    app = web.Application()
    app[SERVICES] = Services(settings)
    app.router.add_get("/ws", omnia_handler)
    observability.add_routes(app)
    app.on_startup.append(_open)
    app.on_shutdown.append(_close_sockets)
    app.on_cleanup.append(_stop)
    return app


async def serve(settings: Settings, *, on_ready: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM; announce the URL once connections are accepted."""
    runner = web.AppRunner(create_app(settings), handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    on_ready(f"Portico serving http://{host}:{port}/ (Omnia WebSocket: ws://{host}:{port}/ws)")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await runner.cleanup()
