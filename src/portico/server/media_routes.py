"""The HTTP media routes (Omnia "Media upload"): thin adapters over `MediaService`.

`request-upload`, `info` and `download` take the same credential as `/ws`. The
upload URL is itself the credential for its `PUT` (256 random bits, single use,
expiring), so a browser can send the file with only the headers `upload_ready`
listed. Every error is JSON: ``{"error": {"code": ..., "message": ...}}``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import aiohttp
import msgspec
from aiohttp import web

from portico.auth.base import Identity
from portico.errors import (
    InvalidMessage,
    MediaNotEnabled,
    PayloadTooLarge,
    PorticoError,
    UploadFailed,
)
from portico.media.base import MediaInfo, content_disposition
from portico.media.service import MediaDescription, MediaService
from portico.server.http_limits import UploadTooSlow, paced_body
from portico.server.services import SERVICES

log = logging.getLogger("portico.media")

# A request-upload body holds four short fields; anything longer is not one.
MAX_REQUEST_BODY_BYTES: Final = 16 * 1024
UPLOAD_CHUNK_BYTES: Final = 256 * 1024
# What aiohttp raises when the client's body stops short or is malformed.
_BODY_ERRORS: Final = (
    ConnectionError,
    aiohttp.ClientPayloadError,
    aiohttp.http.HttpProcessingError,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    body = msgspec.json.encode({"error": {"code": code, "message": message}})
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def _json(payload: msgspec.Struct, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode(payload), content_type="application/json"
    )


def _json_errors(handler: Handler) -> Handler:
    """Answer every refusal as a JSON error carrying the exception's wire code."""

    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except PorticoError as exc:
            if exc.http_status >= 500:
                log.error("media route failed: %s", exc, exc_info=exc.__cause__ or exc)
            return _error_response(exc.http_status, exc.code, exc.message)
        except web.HTTPUnauthorized as exc:
            headers = {"WWW-Authenticate": exc.headers.get("WWW-Authenticate", "Bearer")}
            return _error_response(401, "UNAUTHENTICATED", exc.text or "unauthenticated", headers)
        except web.HTTPServiceUnavailable as exc:  # the identity provider is down
            retry = {"Retry-After": exc.headers.get("Retry-After", "1")}
            return _error_response(503, "UNAUTHENTICATED", exc.text or "unavailable", retry)

    return wrapper


def _media(request: web.Request) -> MediaService:
    media = request.app[SERVICES].media
    if not media.enabled:
        raise MediaNotEnabled()
    return media


async def _identity(request: web.Request) -> Identity:
    return await request.app[SERVICES].identity_of(request)


async def _read_bounded(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
    body = bytearray()
    async for chunk in request.content.iter_chunked(limit):
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body is larger than {limit} bytes")
    return bytes(body)


class UploadRequestBody(msgspec.Struct, frozen=True):
    """`POST /media/request-upload`; the service checks each field and names the bad one."""

    session_id: Any = None
    filename: Any = None
    mime_type: Any = None
    size_bytes: Any = None


@_json_errors
async def request_upload(request: web.Request) -> web.StreamResponse:
    media = _media(request)
    identity = await _identity(request)
    raw = await _read_bounded(request, MAX_REQUEST_BODY_BYTES)
    try:
        body = msgspec.json.decode(raw, type=UploadRequestBody)
    except msgspec.DecodeError:
        raise InvalidMessage("the body must be a JSON object") from None
    grant = await media.request_upload(
        principal=identity.principal,
        binding=identity.session_value,
        session_id=body.session_id,
        filename=body.filename,
        mime_type=body.mime_type,
        size_bytes=body.size_bytes,
        base_url=str(request.url.origin()),
    )
    request.app[SERVICES].metrics.uploads.labels("granted").inc()
    return _json(grant)


async def _body(request: web.Request) -> AsyncIterator[bytes]:
    """The request body in chunks, as it arrives; a broken body is `UploadFailed`."""
    settings = request.app[SERVICES].settings
    chunks = paced_body(
        request.content,
        chunk_bytes=UPLOAD_CHUNK_BYTES,
        min_rate=settings.upload_min_rate_bytes,
        window=settings.http_header_timeout,
    )
    try:
        async for chunk in chunks:
            yield chunk
    except _BODY_ERRORS as exc:
        raise UploadFailed("the upload body was not received completely") from exc


@_json_errors
async def upload(request: web.Request) -> web.StreamResponse:
    uploads = request.app[SERVICES].metrics.uploads
    try:
        # Not `request.read()`: that buffers the whole body and stops at client_max_size.
        info = await _media(request).upload(
            upload_id=request.match_info["upload_id"],
            chunks=_body(request),
            content_length=request.content_length,
        )
    except UploadTooSlow as exc:
        uploads.labels("failed").inc()
        return await _hang_up(request, exc)
    except UploadFailed:
        uploads.labels("failed").inc()
        raise
    uploads.labels("stored").inc()
    log.info(
        "media uploaded session=%s media=%s size_bytes=%d",
        info.session_id,
        info.media_id,
        info.size_bytes,
    )
    return web.Response(status=204)


async def _hang_up(request: web.Request, error: UploadTooSlow) -> web.StreamResponse:
    """Answer 408 and close: aiohttp would otherwise go on reading the rest of the
    trickling body (its lingering close) before letting the connection go."""
    response = _error_response(error.http_status, error.code, error.message)
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response


@_json_errors
async def media_info(request: web.Request) -> web.StreamResponse:
    media = _media(request)
    identity = await _identity(request)
    info = await media.info(
        principal=identity.principal,
        binding=identity.session_value,
        session_id=request.match_info["session_id"],
        media_id=request.match_info["media_id"],
    )
    return _json(MediaDescription.of(info))


# The presigned URL is the owner's for a while: no cache may keep or share it.
REDIRECT_HEADERS: Final = {"Cache-Control": "private, no-store", "Referrer-Policy": "no-referrer"}


def download_headers(info: MediaInfo) -> dict[str, str]:
    return {
        "Content-Type": info.mime_type,
        "Content-Disposition": content_disposition(info.filename),
        # The bytes are the uploader's: never sniff or render them as this origin's page.
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": "default-src 'none'; sandbox",
        "Cache-Control": "private, no-store",
    }


@_json_errors
async def download(request: web.Request) -> web.StreamResponse:
    media = _media(request)
    identity = await _identity(request)
    info, body = await media.download(
        principal=identity.principal,
        binding=identity.session_value,
        session_id=request.match_info["session_id"],
        media_id=request.match_info["media_id"],
    )
    if isinstance(body, str):
        # The storage serves the bytes itself (a presigned URL, spec/replicas.md).
        return web.Response(status=307, headers={"Location": body, **REDIRECT_HEADERS})
    async with contextlib.aclosing(body):
        response = web.StreamResponse(headers=download_headers(info))
        response.content_length = info.size_bytes
        await response.prepare(request)
        try:
            async for chunk in body:
                await response.write(chunk)
        except PorticoError as exc:
            # The headers are sent: no JSON error can follow, only a cut connection.
            raise RuntimeError("media download failed after its headers were sent") from exc
        await response.write_eof()
    return response


@_json_errors
async def confirm_upload(request: web.Request) -> web.StreamResponse:
    uploads = request.app[SERVICES].metrics.uploads
    try:
        info = await _media(request).confirm_upload(upload_id=request.match_info["upload_id"])
    except UploadFailed:
        uploads.labels("failed").inc()
        raise
    uploads.labels("stored").inc()
    log.info(
        "media confirmed session=%s media=%s size_bytes=%d",
        info.session_id,
        info.media_id,
        info.size_bytes,
    )
    return _json(MediaDescription.of(info))


def add_routes(app: web.Application) -> None:
    # Registered with media off too, so clients get MEDIA_NOT_ENABLED, not a bare 404.
    app.router.add_post("/media/request-upload", request_upload)
    app.router.add_put("/media/upload/{upload_id}", upload)
    app.router.add_post("/media/confirm-upload/{upload_id}", confirm_upload)
    app.router.add_get("/media/info/{session_id}/{media_id}", media_info, allow_head=False)
    app.router.add_get("/media/download/{session_id}/{media_id}", download, allow_head=False)
