"""The media service: who may upload what, where, for how long; what a part may name.

The `/ws` adapter and the HTTP media routes call this; it talks to a
`MediaStore` (bytes and tickets) and to the archive (who owns a session). Time
comes from `clock`, so every expiry rule is testable without sleeping.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import re
import socket
import time
import unicodedata
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from typing import Any, Final, Literal
from urllib.parse import urljoin, urlsplit

import aiohttp
import msgspec
from aiohttp.abc import AbstractResolver, ResolveResult

from portico.core.reservations import SessionReservations
from portico.domain.model import MediaContent
from portico.domain.validation import base64_decoded_size
from portico.errors import (
    InvalidMessage,
    MediaNotEnabled,
    MediaNotFound,
    SessionExpired,
    TooManyUploads,
    UploadFailed,
    UploadNotFound,
    UploadTooLarge,
)
from portico.health import Health
from portico.media.base import (
    MEDIA_ID_PATTERN,
    SESSION_ID_PATTERN,
    UPLOAD_ID_PATTERN,
    MediaInfo,
    MediaStore,
    UploadTicket,
    iso8601,
    new_media_id,
    new_upload_id,
    parse_storage_ref,
    storage_ref,
)
from portico.store.base import Store

# Bounds on what a client names; the byte limits themselves are settings.
MAX_FILENAME_BYTES: Final = 255  # the usual file-system limit for one name
MAX_URL_LENGTH: Final = 8192
MAX_REDIRECTS: Final = 5
FETCH_CHUNK_BYTES: Final = 64 * 1024
REDIRECT_STATUSES: Final = frozenset({301, 302, 303, 307, 308})
# RFC 6838 restricted names: `type/subtype`, no parameters, nothing to escape in a header.
_MIME_NAME = r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+\-]{0,126}"
MIME_TYPE_PATTERN: Final = re.compile(f"{_MIME_NAME}/{_MIME_NAME}")
_UNKNOWN_REF: Final = "storage_ref: no such media in this session (unknown, expired or not yours)"
# Strict base64 (RFC 4648 4, padded) once its length is a multiple of 4: the same
# text `b64decode(validate=True)` takes, checked without allocating its bytes.
_BASE64: Final = re.compile(r"[A-Za-z0-9+/]*={0,2}")


class UploadGrant(msgspec.Struct, frozen=True, kw_only=True):
    """An upload URL and what to send with it (Omnia `upload_ready`)."""

    upload_id: str
    upload_url: str
    storage_ref: str
    expires_at: str  # ISO 8601, UTC
    method: Literal["PUT"] = "PUT"
    headers: dict[str, str] = msgspec.field(default_factory=dict)


class MediaDescription(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The media info endpoint's answer; `expires_at` absent when it never expires."""

    storage_ref: str
    filename: str
    mime_type: str
    size_bytes: int
    created_at: str
    expires_at: str | None = None

    @classmethod
    def of(cls, info: MediaInfo) -> MediaDescription:
        return cls(
            storage_ref=info.storage_ref,
            filename=info.filename,
            mime_type=info.mime_type,
            size_bytes=info.size_bytes,
            created_at=iso8601(info.created_at),
            expires_at=None if info.expires_at is None else iso8601(info.expires_at),
        )


def check_filename(filename: Any) -> str:
    if not isinstance(filename, str) or not filename:
        raise InvalidMessage("filename: required, a non-empty string")
    if len(filename.encode("utf-8", "surrogatepass")) > MAX_FILENAME_BYTES:
        raise InvalidMessage(f"filename: longer than {MAX_FILENAME_BYTES} bytes")
    if filename in (".", "..") or "/" in filename or "\\" in filename:
        raise InvalidMessage("filename: a name without a path")
    if any(unicodedata.category(char) in ("Cc", "Cs") for char in filename):
        raise InvalidMessage("filename: control characters are not allowed")
    return filename


def check_mime_type(mime_type: Any) -> str:
    if not isinstance(mime_type, str) or not MIME_TYPE_PATTERN.fullmatch(mime_type):
        raise InvalidMessage("mime_type: required, `type/subtype` such as image/png")
    return mime_type


def check_session_id(session_id: Any) -> str:
    if not isinstance(session_id, str) or not SESSION_ID_PATTERN.fullmatch(session_id):
        raise InvalidMessage("session_id: required, 1 to 128 letters, digits, '_', '.', ':' or '-'")
    return session_id


def check_size(size_bytes: Any) -> int:
    # bool is an int in Python; `true` is not a size.
    if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or size_bytes < 0:
        raise InvalidMessage("size_bytes: required, a whole number of bytes, 0 or more")
    return size_bytes


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global


def _literal_address(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


class _PublicResolver(AbstractResolver):
    """Resolves names to public addresses only, so a `url` part cannot reach inside."""

    def __init__(self) -> None:
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        resolved = await self._inner.resolve(host, port, family)
        results = [result for result in resolved if _is_public(result["host"])]
        if not results:
            raise OSError(f"{host} has no public address")
        return results

    async def close(self) -> None:
        await self._inner.close()


class MediaService:
    def __init__(
        self,
        store: MediaStore | None,
        *,
        archive: Store,
        max_upload_bytes: int = 100 * 1024 * 1024,
        max_inline_media_bytes: int = 12 * 1024 * 1024,
        media_ttl: float | None = 86400.0,  # seconds; None keeps media until deleted
        upload_url_ttl: float = 900.0,  # seconds
        public_url: str | None = None,
        fetch_timeout: float = 30.0,  # seconds, for a whole `url` fetch
        fetch_private: bool = False,  # let `url` parts reach non-public addresses
        max_pending_uploads: int | None = None,  # unused upload URLs per principal
        reservations: SessionReservations | None = None,
        download_url_ttl: float = 300.0,  # seconds a backend's own download URL is valid
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._archive = archive
        self._max_upload_bytes = max_upload_bytes
        self._max_inline_bytes = max_inline_media_bytes
        self._media_ttl = media_ttl
        self._upload_url_ttl = upload_url_ttl
        self._public_url = public_url.rstrip("/") if public_url else None
        self._fetch_timeout = fetch_timeout
        self._fetch_private = fetch_private
        self._clock = clock
        self._http: aiohttp.ClientSession | None = None
        self._max_pending = max_pending_uploads
        self._reservations = reservations or SessionReservations()
        self._download_url_ttl = download_url_ttl
        # principal -> upload id -> expiry: the URLs it holds, in this process.
        self._pending: dict[str, dict[str, float]] = {}

    @property
    def enabled(self) -> bool:
        return self._store is not None

    def _storage(self) -> MediaStore:
        if self._store is None:
            raise MediaNotEnabled()
        return self._store

    async def open(self) -> None:
        if self._store is not None:
            await self._store.open()

    async def health(self, within: float) -> Health:
        if self._store is None:
            return Health(True, "disabled")
        return await self._store.health(within)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._store is not None:
            await self._store.close()

    # -- uploads ------------------------------------------------------------------

    async def request_upload(
        self,
        *,
        principal: str,
        session_id: str,
        filename: str,
        mime_type: str,
        size_bytes: int,
        base_url: str,
        binding: str | None = None,
    ) -> UploadGrant:
        """Grant an upload URL for one file of `size_bytes` in the caller's session
        (`binding`: the caller's session-binding value, checked as a resume is)."""
        store = self._storage()
        check_session_id(session_id)
        check_filename(filename)
        check_mime_type(mime_type)
        check_size(size_bytes)
        if size_bytes > self._max_upload_bytes:
            raise UploadTooLarge(
                f"size_bytes: {size_bytes} is above the {self._max_upload_bytes}-byte upload limit"
            )
        await self._check_session(principal, session_id, SessionExpired, binding)
        pending = self._pending_of(principal, self._clock())
        upload_id, ticket = await self._open_ticket(
            store, principal, session_id, filename, mime_type, size_bytes
        )
        pending[upload_id] = ticket.expires_at
        direct = await store.direct_upload(upload_id, ticket)
        base = self._public_url or base_url.rstrip("/")
        return UploadGrant(
            upload_id=upload_id,
            upload_url=f"{base}/media/upload/{upload_id}" if direct is None else direct.url,
            storage_ref=storage_ref(session_id, ticket.media_id),
            expires_at=iso8601(ticket.expires_at),
            headers={"Content-Type": mime_type} if direct is None else direct.headers,
        )

    async def upload(
        self, *, upload_id: str, chunks: AsyncIterable[bytes], content_length: int | None
    ) -> MediaInfo:
        """Receive an upload URL's body. The URL is the credential: no principal here."""
        store = self._storage()
        if not UPLOAD_ID_PATTERN.fullmatch(upload_id):
            raise UploadNotFound()
        ticket = await store.claim_ticket(upload_id, now=self._clock())
        try:
            if content_length is not None and content_length != ticket.size_bytes:
                # Refused before a byte is read: the declared length cannot match.
                error = UploadTooLarge if content_length > ticket.size_bytes else UploadFailed
                raise error(
                    f"Content-Length is {content_length}; {ticket.size_bytes} bytes were declared"
                )
            now = self._clock()
            info = await store.write(
                upload_id, chunks, created_at=now, expires_at=self._expiry(now)
            )
        except BaseException:
            # A failed attempt gives the ticket back: the URL works again until it expires.
            await asyncio.shield(store.release_ticket(upload_id))
            raise
        self._pending.get(ticket.owner, {}).pop(upload_id, None)
        return info

    async def confirm_upload(self, *, upload_id: str) -> MediaInfo:
        """Take in the body a client sent to a presigned upload URL, checked against its
        ticket. The upload id is the credential, as for the `PUT`."""
        store = self._storage()
        if not UPLOAD_ID_PATTERN.fullmatch(upload_id):
            raise UploadNotFound()
        ticket = await store.claim_ticket(upload_id, now=self._clock())
        try:
            now = self._clock()
            info = await store.confirm(upload_id, created_at=now, expires_at=self._expiry(now))
        except BaseException:
            # A failed confirm gives the ticket back: the client may PUT and confirm again.
            await asyncio.shield(store.release_ticket(upload_id))
            raise
        self._pending.get(ticket.owner, {}).pop(upload_id, None)
        return info

    def _pending_of(self, principal: str, now: float) -> dict[str, float]:
        """The principal's unused, unexpired upload URLs; `TooManyUploads` at the quota."""
        held = self._pending.get(principal, {})
        pending = {upload_id: at for upload_id, at in held.items() if at > now}
        if self._max_pending is not None and len(pending) >= self._max_pending:
            raise TooManyUploads()
        self._pending[principal] = pending
        return pending

    async def _open_ticket(
        self,
        store: MediaStore,
        principal: str,
        session_id: str,
        filename: str,
        mime_type: str,
        size_bytes: int,
    ) -> tuple[str, UploadTicket]:
        """A new upload ticket for one file, stored; its upload id and the ticket."""
        now = self._clock()
        upload_id = new_upload_id()
        ticket = UploadTicket(
            media_id=new_media_id(),
            session_id=session_id,
            owner=principal,
            filename=filename,
            mime_type=mime_type,
            size_bytes=size_bytes,
            created_at=now,
            expires_at=now + self._upload_url_ttl,
        )
        await store.create_ticket(upload_id, ticket)
        return upload_id, ticket

    def _expiry(self, now: float) -> float | None:
        return None if self._media_ttl is None else now + self._media_ttl

    async def keep(
        self, *, principal: str, session_id: str, mime_type: str, data: bytes, filename: str
    ) -> MediaContent | None:
        """Archive media an agent streamed (it has no part of its own) in the turn's
        session, kept for `media_ttl` like an upload; None when media are not enabled or
        it is larger than an upload may be."""
        if self._store is None or not data or len(data) > self._max_upload_bytes:
            return None
        # The same steps as an upload, so the media store needs no second way in.
        store = self._store
        upload_id, ticket = await self._open_ticket(
            store, principal, session_id, filename, mime_type, len(data)
        )
        now = self._clock()
        await store.claim_ticket(upload_id, now=now)
        await store.write(upload_id, _single(data), created_at=now, expires_at=self._expiry(now))
        return MediaContent(
            mime_type=mime_type,
            storage_ref=storage_ref(session_id, ticket.media_id),
            filename=filename,
            size_bytes=len(data),
        )

    # -- reading --------------------------------------------------------------------

    async def info(
        self, *, principal: str, session_id: str, media_id: str, binding: str | None = None
    ) -> MediaInfo:
        """The caller's media; `MediaNotFound` when missing, expired or not theirs."""
        store = self._storage()
        if not SESSION_ID_PATTERN.fullmatch(session_id) or not MEDIA_ID_PATTERN.fullmatch(media_id):
            raise MediaNotFound()
        await self._check_session(principal, session_id, MediaNotFound, binding)
        info = await store.info(session_id, media_id)
        if info is None or info.owner != principal or info.expired(self._clock()):
            raise MediaNotFound()
        return info

    async def download(
        self, *, principal: str, session_id: str, media_id: str, binding: str | None = None
    ) -> tuple[MediaInfo, AsyncGenerator[bytes, None] | str]:
        """The caller's media and either its bytes, opened (close the generator when
        done), or a URL the storage serves them at for a while (a presigned GET)."""
        info = await self.info(
            principal=principal, session_id=session_id, media_id=media_id, binding=binding
        )
        store = self._storage()
        ttl = self._download_url_ttl
        if info.expires_at is not None:
            ttl = min(ttl, info.expires_at - self._clock())  # never outlives the media
        url = await store.download_url(info, expires_in=ttl)
        if url is not None:
            return info, url
        body = await store.stream(session_id, media_id)
        if body is None:
            raise MediaNotFound()
        return info, body

    async def check_part(self, *, principal: str, session_id: str, media: MediaContent) -> None:
        """Refuse a message part whose media source the runtime could not read."""
        if media.storage_ref is not None:
            await self._stored(principal, session_id, media.storage_ref)
        elif media.data is not None:
            self._check_inline(media.data)
        elif media.url is not None:
            self._check_url(media.url)
        else:
            raise InvalidMessage("media: exactly one of data, url, storage_ref is required")

    async def read(self, *, session_id: str, media: MediaContent) -> bytes:
        """The bytes of a part for a runtime; `check_part` has vetted the part."""
        if media.storage_ref is not None:
            info = await self._stored(None, session_id, media.storage_ref)
            body = await self._storage().stream(session_id, info.media_id)
            if body is None:
                raise InvalidMessage(_UNKNOWN_REF)
            async with contextlib.aclosing(body):
                return b"".join([chunk async for chunk in body])
        if media.data is not None:
            return self._decode_inline(media.data)
        if media.url is not None:
            return await self._fetch(media.url)
        raise InvalidMessage("media: exactly one of data, url, storage_ref is required")

    async def sweep_expired(self) -> int:
        """Delete media past `media_ttl` and expired unused upload URLs; how many.

        An upload URL is kept for one more `upload_url_ttl` after it expires, so
        a late `PUT` is told 410 (expired) rather than 404 (unknown).
        """
        if self._store is None:
            return 0
        return await self._store.sweep(now=self._clock(), ticket_grace=self._upload_url_ttl)

    # -- rules ------------------------------------------------------------------------

    async def _check_session(
        self,
        principal: str,
        session_id: str,
        error: type[SessionExpired | MediaNotFound],
        binding: str | None,
    ) -> None:
        # A session the archive has not seen is allowed: /ws writes sessions lazily,
        # on their first message, and a client uploads before it sends one.
        session = await self._archive.get_session(session_id)
        if session is None and self._reservations.foreign(session_id, principal):
            raise error()
        if session is not None and session.owner != principal:
            raise error()
        # A session bound to another session-claim value is foreign (spec/identity.md).
        if session is not None and binding is not None and session.binding != binding:
            raise error()

    async def _stored(self, principal: str | None, session_id: str, ref: str) -> MediaInfo:
        parsed = parse_storage_ref(ref)
        if parsed is None:
            raise InvalidMessage("storage_ref: expected omnia://sessions/<session>/media/<media>")
        store = self._storage()
        ref_session, media_id = parsed
        info = None if ref_session != session_id else await store.info(session_id, media_id)
        if (
            info is None
            or info.expired(self._clock())
            or (principal is not None and info.owner != principal)
        ):
            raise InvalidMessage(_UNKNOWN_REF)  # a foreign ref looks like a missing one
        return info

    def _check_inline(self, data: str) -> None:
        """Refuse `data` that is not strict base64 or decodes to more than the limit.

        Checked on the text, never decoded here: a part of a maximal frame is
        decoded once, when a runtime reads it (a runtime that sends it on as base64
        never decodes it at all).
        """
        limit = self._max_inline_bytes
        if base64_decoded_size(data) > limit:
            raise InvalidMessage(f"data: larger than {limit} bytes; upload it instead")
        if len(data) % 4 or not _BASE64.fullmatch(data):
            raise InvalidMessage("data: not valid base64")

    def _decode_inline(self, data: str) -> bytes:
        self._check_inline(data)
        return base64.b64decode(data)

    def _check_url(self, url: str) -> None:
        if len(url) > MAX_URL_LENGTH:
            raise InvalidMessage(f"url: longer than {MAX_URL_LENGTH} characters")
        if any(char.isspace() or unicodedata.category(char) == "Cc" for char in url):
            raise InvalidMessage("url: whitespace and control characters are not allowed")
        try:
            parts = urlsplit(url)
            host = parts.hostname
        except ValueError:
            raise InvalidMessage("url: not a valid URL") from None
        if parts.scheme.lower() not in ("http", "https") or not host:
            raise InvalidMessage("url: must be an http or https URL")
        address = _literal_address(host)
        if address is not None and not self._fetch_private and not _is_public(address):
            raise InvalidMessage("url: must name a public address")

    async def _fetch(self, url: str) -> bytes:
        limit = self._max_upload_bytes
        http = self._client()
        for _ in range(MAX_REDIRECTS + 1):
            self._check_url(url)
            try:
                async with http.get(url, allow_redirects=False) as response:
                    if response.status in REDIRECT_STATUSES and "Location" in response.headers:
                        url = urljoin(url, response.headers["Location"])
                        continue
                    if response.status != 200:
                        raise InvalidMessage(f"url: the server answered HTTP {response.status}")
                    if (response.content_length or 0) > limit:
                        raise InvalidMessage(f"url: larger than {limit} bytes")
                    body = bytearray()
                    async for chunk in response.content.iter_chunked(FETCH_CHUNK_BYTES):
                        body += chunk
                        if len(body) > limit:
                            raise InvalidMessage(f"url: larger than {limit} bytes")
                    return bytes(body)
            except TimeoutError:
                raise InvalidMessage("url: the fetch timed out") from None
            except (aiohttp.ClientError, OSError) as exc:
                raise InvalidMessage("url: cannot fetch it") from exc
        raise InvalidMessage(f"url: more than {MAX_REDIRECTS} redirects")

    def _client(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            resolver = None if self._fetch_private else _PublicResolver()
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(resolver=resolver),
                timeout=aiohttp.ClientTimeout(total=self._fetch_timeout),
                # No proxy from the environment: it would resolve names we never vet.
                trust_env=False,
            )
        return self._http


async def _single(data: bytes) -> AsyncGenerator[bytes, None]:
    yield data
