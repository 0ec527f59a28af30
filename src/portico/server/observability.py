"""Logs and probes. Logs never carry message bodies, tool arguments or credentials."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from portico.runtime.base import HealthReporter, Runtime
from portico.server.readiness import check_all, verdict
from portico.server.services import SERVICES

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class LineFormatter(logging.Formatter):
    """`LOG_FORMAT`, with the timestamp's text made once a second, not once a line.

    A turn logs a line as it ends: at a thousand turns a second the standard
    `formatTime` (a `strftime` a record) was a good part of logging's cost
    (docs/performance.md, "Logging"). The text is the standard one to the millisecond.
    """

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)
        self._second = -1
        self._second_text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        second = int(record.created)
        if second != self._second:
            self._second_text = time.strftime(self.default_time_format, self.converter(second))
            self._second = second
        return f"{self._second_text},{int(record.msecs):03d}"  # the default_msec_format


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # The format names no source line, thread or process: skip collecting them for
    # every record (the logging HOWTO's "Optimization"; the caller's frame lookup was
    # the largest part of a line's cost).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    # aiohttp's access log line per HTTP request would drown the per-connection lines.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: admitting, every backend answering, required runtimes healthy."""
    services = request.app[SERVICES]
    within = services.settings.readiness_timeout
    backends, agents = await asyncio.gather(
        check_all(
            {
                "archive": services.store.health(within),
                "bus": services.shared.bus.health(within),
                "session_state": services.shared.session_states.health(within),
                "media": services.media.health(within),
            },
            within,
        ),
        unhealthy_runtimes(services.runtimes),
    )
    status, body = verdict(services.lifecycle.phase, backends, agents)
    return web.json_response(body, status=status)


async def unhealthy_runtimes(runtimes: Mapping[str, Runtime]) -> dict[str, str]:
    """Agent name -> reason, for each runtime readiness depends on that is unhealthy."""
    required = {
        name: runtime
        for name, runtime in runtimes.items()
        if isinstance(runtime, HealthReporter) and runtime.health_required
    }
    answers = await asyncio.gather(*(runtime.health() for runtime in required.values()))
    return {
        name: health.reason
        for name, health in zip(required, answers, strict=True)
        if not health.healthy
    }


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition of this server's registry."""
    registry = request.app[SERVICES].metrics.registry
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


def add_routes(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
