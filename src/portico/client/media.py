"""Upload a file to a Portico server and fetch stored media (Omnia "Media upload").

    async with aiohttp.ClientSession() as http:
        media = await upload_media(http, "http://127.0.0.1:8080", b"...", session_id="s1",
                                   filename="photo.png", mime_type="image/png", token=key)
        # media["storage_ref"] goes into a message part: {"type": "image", "media": media}

Two requests, or three: the upload URL (with the credential), the bytes (to that URL,
with only the headers the grant lists: the URL is the credential), and, when the URL is
not the server's own `/media/upload/{id}` but object storage's (a presigned URL,
`media: s3`), `POST /media/confirm-upload/{id}`, whose answer ends the upload.
"""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import quote, urlsplit

import aiohttp

__all__ = ["MediaError", "download_media", "needs_confirm", "upload_media"]

DEFAULT_TIMEOUT: Final = 60.0  # seconds for each request (the body's included)


class MediaError(Exception):
    """A media route or the object store refused; `code` is the server's error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{code} ({status}): {message}")
        self.status = status
        self.code = code
        self.message = message


def needs_confirm(grant: dict[str, Any]) -> bool:
    """True when the grant's URL is object storage's: the upload is then confirmed."""
    path = urlsplit(str(grant["upload_url"])).path
    return not path.endswith(f"/media/upload/{grant['upload_id']}")


async def _refusal(response: aiohttp.ClientResponse) -> MediaError:
    code, message = f"HTTP_{response.status}", response.reason or ""
    if response.content_type == "application/json":
        body = await response.json()
        error = body.get("error", {}) if isinstance(body, dict) else {}
        code, message = error.get("code", code), error.get("message", message)
    return MediaError(response.status, code, message)


async def upload_media(
    http: aiohttp.ClientSession,
    base_url: str,
    data: bytes,
    *,
    session_id: str,
    filename: str,
    mime_type: str,
    token: str | None = None,
    request_timeout: float = DEFAULT_TIMEOUT,
) -> dict[str, Any]:
    """Upload `data` into `session_id`; the part's `media` object naming it."""
    base = base_url.rstrip("/")
    limit = aiohttp.ClientTimeout(total=request_timeout)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    body = {
        "session_id": session_id,
        "filename": filename,
        "mime_type": mime_type,
        "size_bytes": len(data),
    }
    async with http.post(
        f"{base}/media/request-upload", json=body, headers=auth, timeout=limit
    ) as response:
        if response.status != 200:
            raise await _refusal(response)
        grant: dict[str, Any] = await response.json()
    method = str(grant.get("method") or "PUT")
    headers = dict(grant.get("headers") or {})
    async with http.request(
        method, grant["upload_url"], data=data, headers=headers, timeout=limit
    ) as response:
        if response.status >= 300:
            raise await _refusal(response)
    if needs_confirm(grant):
        confirm = f"{base}/media/confirm-upload/{quote(grant['upload_id'], safe='')}"
        async with http.post(confirm, timeout=limit) as response:
            if response.status != 200:
                raise await _refusal(response)
    return {
        "storage_ref": grant["storage_ref"],
        "mime_type": mime_type,
        "filename": filename,
        "size_bytes": len(data),
    }


async def download_media(
    http: aiohttp.ClientSession,
    base_url: str,
    session_id: str,
    media_id: str,
    *,
    token: str | None = None,
    request_timeout: float = DEFAULT_TIMEOUT,
) -> bytes:
    """Stored media's bytes; a `307` to object storage is followed without the credential."""
    limit = aiohttp.ClientTimeout(total=request_timeout)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    path = f"/media/download/{quote(session_id, safe='')}/{quote(media_id, safe='')}"
    async with http.get(
        base_url.rstrip("/") + path, headers=auth, timeout=limit, allow_redirects=False
    ) as response:
        if response.status == 200:
            return await response.read()
        if response.status != 307:
            raise await _refusal(response)
        location = response.headers["Location"]
    # The presigned URL is the credential; a bearer token beside it would be refused.
    async with http.get(location, timeout=limit) as response:
        if response.status != 200:
            raise await _refusal(response)
        return await response.read()
