"""HTTP connections that strangers cannot hold open: the request head's deadline, the
upload body's minimum rate, and malformed requests logged without their headers.

aiohttp has no header-read timeout of its own. Its keep-alive timer does the job:
it is armed when a connection opens (and again after each response), is not moved
by bytes that arrive, and closes the connection when it fires while no complete
request head has been parsed. So `http_header_timeout` is passed to aiohttp as
`keepalive_timeout` (`runner_options`), which also closes a kept-alive connection
that stays idle that long between requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import StreamReader
from aiohttp.http_exceptions import HttpProcessingError

from portico.config import Settings
from portico.errors import UploadFailed

HTTP_LOGGER = "portico.http"


class UploadTooSlow(UploadFailed):
    http_status = 408

    def __init__(self, min_rate: int) -> None:
        super().__init__(f"the upload body arrived slower than {min_rate} bytes per second")


def runner_options(settings: Settings) -> dict[str, Any]:
    """What `web.AppRunner` takes from the settings."""
    return {"keepalive_timeout": settings.http_header_timeout, "logger": http_logger()}


async def paced_body(
    content: StreamReader, *, chunk_bytes: int, min_rate: int, window: float
) -> AsyncIterator[bytes]:
    """The body in chunks; `UploadTooSlow` when a `window` brought fewer than
    `min_rate * window` bytes (a trickling upload would hold its connection forever)."""
    loop = asyncio.get_running_loop()
    needed = min_rate * window
    window_end, received = loop.time() + window, 0
    while True:
        chunk: bytes | None = None
        try:
            async with asyncio.timeout_at(window_end):
                chunk = await content.read(chunk_bytes)
        except TimeoutError:
            pass
        if chunk == b"":
            return
        if chunk:
            received += len(chunk)
            yield chunk
        if loop.time() >= window_end:
            if received < needed:
                raise UploadTooSlow(min_rate)
            window_end, received = loop.time() + window, 0


class MalformedRequestFilter(logging.Filter):
    """aiohttp logs a request it cannot parse with its traceback at ERROR, and the
    exception's text quotes the offending line, which may be an `Authorization`
    header: log one WARNING line with the status and the error's kind instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "-"
            record.msg = "malformed HTTP request from %s: %s (HTTP %s)"
            record.args = (peer, type(error).__name__, error.code)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def http_logger() -> logging.Logger:
    logger = logging.getLogger(HTTP_LOGGER)
    if not any(isinstance(f, MalformedRequestFilter) for f in logger.filters):
        logger.addFilter(MalformedRequestFilter())
    return logger
