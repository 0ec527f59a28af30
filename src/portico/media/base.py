"""The MediaStore port and the records every backend shares.

Every backend passes tests/contract/test_media_contract.py. A store keeps two
things: upload tickets (the credential an upload URL carries, single use and
expiring) and media (bytes plus metadata, addressed by session and media id).
It enforces sizes and atomicity; who may do what (owners, sessions, limits,
clocks) is decided by `MediaService`, which passes `now` in.

A backend either receives uploads through Portico (`PUT /media/upload/{id}`,
`write`) or hands the client a URL of its own (`direct_upload`, a presigned PUT)
and then takes the body in with `confirm`, which checks what arrived: object
stores do not all enforce the size a URL was signed for. `write` works on every
backend, so media Portico produces (streamed audio it archives) go in the same
way. `download_url` likewise lets a backend serve bytes itself (a presigned GET).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from datetime import UTC, datetime
from typing import Final, Protocol
from urllib.parse import quote

import msgspec

from portico.domain.model import new_id
from portico.errors import UploadFailed, UploadTooLarge
from portico.health import Health

# The same rule as `/ws` session ids; it also keeps `/` out of storage refs.
SESSION_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
MEDIA_ID_PATTERN: Final = re.compile(r"med-[0-9a-f]{32}")
# "upl-" and secrets.token_urlsafe(32): 256 random bits, URL- and filename-safe.
UPLOAD_ID_PATTERN: Final = re.compile(r"upl-[A-Za-z0-9_\-]{43}")
STORAGE_REF_PATTERN: Final = re.compile(
    r"omnia://sessions/(?P<session>[A-Za-z0-9_.:\-]{1,128})/media/(?P<media>med-[0-9a-f]{32})"
)
UPLOAD_TOKEN_BYTES: Final = 32
READ_CHUNK_BYTES: Final = 256 * 1024


def new_media_id() -> str:
    return new_id("med")


def new_upload_id() -> str:
    return "upl-" + secrets.token_urlsafe(UPLOAD_TOKEN_BYTES)


def upload_key(upload_id: str) -> str:
    """What a backend files a ticket under: a digest, so the credential is never at rest."""
    return hashlib.sha256(upload_id.encode()).hexdigest()


def storage_ref(session_id: str, media_id: str) -> str:
    return f"omnia://sessions/{session_id}/media/{media_id}"


def parse_storage_ref(ref: str) -> tuple[str, str] | None:
    """``(session_id, media_id)`` of a well-formed storage ref, else None."""
    match = STORAGE_REF_PATTERN.fullmatch(ref)
    return None if match is None else (match["session"], match["media"])


def iso8601(timestamp: float) -> str:
    """UTC with millisecond precision and a `Z`, as the Omnia examples write it."""
    moment = datetime.fromtimestamp(timestamp, tz=UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class UploadTicket(msgspec.Struct, frozen=True, kw_only=True):
    """What an upload URL grants: one body of exactly `size_bytes`, until `expires_at`.

    The upload id itself is not part of the record: stores file tickets under
    `upload_key(upload_id)`.
    """

    media_id: str
    session_id: str
    owner: str
    filename: str
    mime_type: str
    size_bytes: int
    created_at: float
    expires_at: float

    def media_info(self, created_at: float, expires_at: float | None) -> MediaInfo:
        """The record of the media this ticket's body became (stored at `created_at`)."""
        return MediaInfo(
            media_id=self.media_id,
            session_id=self.session_id,
            owner=self.owner,
            filename=self.filename,
            mime_type=self.mime_type,
            size_bytes=self.size_bytes,
            created_at=created_at,
            expires_at=expires_at,
        )


class MediaInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A stored media item. `expires_at` None: kept until deleted."""

    media_id: str
    session_id: str
    owner: str
    filename: str
    mime_type: str
    size_bytes: int
    created_at: float
    expires_at: float | None = None

    @property
    def storage_ref(self) -> str:
        return storage_ref(self.session_id, self.media_id)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now


class DirectUpload(msgspec.Struct, frozen=True, kw_only=True):
    """Where a client sends an upload's body itself, and the headers it must send."""

    url: str
    headers: dict[str, str]


def content_disposition(filename: str) -> str:
    """`attachment` with an ASCII fallback and the exact name per RFC 6266/5987."""
    fallback = "".join(
        char if " " <= char <= "~" and char not in '"\\' else "_" for char in filename
    )
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"


class MediaStore(Protocol):
    async def open(self) -> None:
        """Create or check the storage; recover what a stopped server left half done."""

    async def close(self) -> None: ...

    async def health(self, within: float) -> Health:
        """Readiness: the storage answers within `within` seconds (object storage: a
        HEAD of the bucket)."""
        ...

    async def create_ticket(self, upload_id: str, ticket: UploadTicket) -> None: ...

    async def get_ticket(self, upload_id: str) -> UploadTicket | None:
        """The ticket while it is unused (open or being uploaded); else None."""

    async def claim_ticket(self, upload_id: str, *, now: float) -> UploadTicket:
        """Take the ticket for one upload attempt, atomically (one claimant wins).

        Raises `UploadNotFound` (unknown or swept), `UploadGone` (expired at
        `now`, or already used) or `UploadInProgress` (claimed by another attempt).
        """

    async def release_ticket(self, upload_id: str) -> None:
        """Give a claimed ticket back after a failed attempt; the URL stays usable."""

    async def write(
        self,
        upload_id: str,
        chunks: AsyncIterable[bytes],
        *,
        created_at: float,
        expires_at: float | None,
    ) -> MediaInfo:
        """Stream a claimed ticket's body into storage, then mark the ticket used.

        Exactly `size_bytes` must arrive: more raises `UploadTooLarge` as soon as
        the excess arrives, fewer raises `UploadFailed`. On any failure, including
        cancellation, nothing is stored and the ticket stays claimed.
        """

    async def direct_upload(self, upload_id: str, ticket: UploadTicket) -> DirectUpload | None:
        """A URL the client uploads the ticket's body to itself, valid until the ticket
        expires; None: the body goes to Portico's `PUT /media/upload/{id}`."""

    async def confirm(
        self, upload_id: str, *, created_at: float, expires_at: float | None
    ) -> MediaInfo:
        """Take the body a client sent to a claimed ticket's `direct_upload` URL.

        The same outcomes as `write`: a body longer than `size_bytes` raises
        `UploadTooLarge`, a shorter one (or none, or another content type)
        `UploadFailed`; on failure nothing is stored, what arrived is deleted and
        the ticket stays claimed. A backend without direct uploads raises `UploadFailed`.
        """

    async def info(self, session_id: str, media_id: str) -> MediaInfo | None:
        """The media's record, None unless it exists in that session."""

    async def download_url(self, info: MediaInfo, *, expires_in: float) -> str | None:
        """A URL the owner's client fetches the bytes from itself for `expires_in`
        seconds; None: Portico streams them (`stream`)."""

    async def stream(
        self, session_id: str, media_id: str, *, chunk_size: int = READ_CHUNK_BYTES
    ) -> AsyncGenerator[bytes, None] | None:
        """The media's bytes in chunks, opened now (a later delete does not cut it)."""

    async def delete(self, session_id: str, media_id: str) -> bool: ...

    async def sweep(self, *, now: float, ticket_grace: float = 0.0) -> int:
        """Delete media expired at `now` and unused tickets `ticket_grace` past expiry.

        Returns how many media and unused tickets it deleted. Used tickets go with
        the same grace, uncounted. Until then a late upload learns that its URL
        expired (or was used) instead of finding it unknown.
        """


async def exactly(chunks: AsyncIterable[bytes], size: int) -> AsyncIterator[bytes]:
    """Pass `chunks` through, refusing a body that is not exactly `size` bytes."""
    received = 0
    async for chunk in chunks:
        received += len(chunk)
        if received > size:
            raise UploadTooLarge(f"the body is longer than the declared {size} bytes")
        yield chunk
    if received < size:
        raise UploadFailed(f"the body ended after {received} of the declared {size} bytes")
