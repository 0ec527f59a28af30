"""Media on local disk, the embedded default.

Layout under the root (``<data_dir>/media``)::

    tickets/<sha256 of upload id>.open|.uploading|.used   the ticket, as JSON
    objects/<2 hex>/<media id>.data                       the bytes
    objects/<2 hex>/<media id>.json                       the record (commit marker)
    objects/<2 hex>/.<media id>.<random>.part             a body being received

A ticket's state is its file suffix, so claiming one is a single `rename`: atomic,
and only one of two racing claimants finds the `.open` file. A body streams into
a temporary file next to its final name and is renamed into place once its size
checks out; the record is written last (temp file and rename), so a reader never
sees half an upload. There is no fsync: a process crash loses nothing committed,
an OS crash may lose the last uploads, the trade the SQLite archive makes too.
Blocking file calls run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from pathlib import Path
from typing import Any, BinaryIO, Final, TypeVar

import msgspec

from portico.errors import StoreError, UploadFailed, UploadGone, UploadInProgress, UploadNotFound
from portico.health import IN_PROCESS, Health
from portico.media.base import (
    MEDIA_ID_PATTERN,
    READ_CHUNK_BYTES,
    DirectUpload,
    MediaInfo,
    UploadTicket,
    exactly,
    upload_key,
)

T = TypeVar("T")

OPEN: Final = ".open"
UPLOADING: Final = ".uploading"
USED: Final = ".used"
PART: Final = ".part"
# Bytes gathered before one write in a worker thread: fewer thread hops, bounded memory.
WRITE_BUFFER_BYTES: Final = 256 * 1024

_ticket_decoder = msgspec.json.Decoder(UploadTicket)
_info_decoder = msgspec.json.Decoder(MediaInfo)


def _load(path: Path, decoder: msgspec.json.Decoder[T]) -> T | None:
    """The record in `path`; None when it is missing or unreadable (never half-written)."""
    try:
        return decoder.decode(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError):
        return None


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=PART)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class LocalMediaStore:
    def __init__(self, root: str | Path, *, write_buffer: int = WRITE_BUFFER_BYTES) -> None:
        self._root = Path(root)
        self._tickets = self._root / "tickets"
        self._objects = self._root / "objects"
        self._write_buffer = write_buffer

    # -- plumbing ---------------------------------------------------------------

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args)
        except OSError as exc:
            raise StoreError("media storage failed") from exc

    def _ticket_path(self, upload_id: str, state: str) -> Path:
        return self._tickets / (upload_key(upload_id) + state)

    def _shard(self, media_id: str) -> Path:
        # Media ids are `med-<32 hex>`; two hex digits spread them over 256 folders.
        return self._objects / media_id[4:6]

    def _paths(self, media_id: str) -> tuple[Path, Path]:
        shard = self._shard(media_id)
        return shard / f"{media_id}.data", shard / f"{media_id}.json"

    # -- lifecycle ----------------------------------------------------------------

    async def open(self) -> None:
        try:
            await asyncio.to_thread(self._recover)
        except OSError as exc:  # at start: say which folder, and why
            reason = (exc.strerror or str(exc)).lower()
            raise StoreError(f"cannot open media storage at {self._root}: {reason}") from exc

    def _recover(self) -> None:
        """No upload survives a restart: claimed tickets reopen, partial bodies go."""
        self._tickets.mkdir(parents=True, exist_ok=True)
        self._objects.mkdir(parents=True, exist_ok=True)
        for path in self._tickets.iterdir():
            if path.suffix == UPLOADING:
                with contextlib.suppress(FileNotFoundError):
                    os.replace(path, path.with_suffix(OPEN))
            elif path.suffix == PART:
                path.unlink(missing_ok=True)
        for shard in self._objects.iterdir():
            if not shard.is_dir():
                continue
            for path in shard.iterdir():
                if path.suffix == PART:
                    path.unlink(missing_ok=True)
                elif path.suffix == ".data" and not path.with_suffix(".json").exists():
                    # Renamed into place but never recorded: the upload did not finish.
                    path.unlink(missing_ok=True)

    async def close(self) -> None:
        return None

    async def health(self, within: float) -> Health:
        return IN_PROCESS

    # -- tickets ------------------------------------------------------------------

    async def create_ticket(self, upload_id: str, ticket: UploadTicket) -> None:
        data = msgspec.json.encode(ticket)
        await self._io(_write_atomically, self._ticket_path(upload_id, OPEN), data)

    async def get_ticket(self, upload_id: str) -> UploadTicket | None:
        return await self._io(self._get_ticket, upload_id)

    def _get_ticket(self, upload_id: str) -> UploadTicket | None:
        for state in (OPEN, UPLOADING):
            ticket = _load(self._ticket_path(upload_id, state), _ticket_decoder)
            if ticket is not None:
                return ticket
        return None

    async def claim_ticket(self, upload_id: str, *, now: float) -> UploadTicket:
        return await self._io(self._claim, upload_id, now)

    def _claim(self, upload_id: str, now: float) -> UploadTicket:
        path = self._ticket_path(upload_id, OPEN)
        ticket = _load(path, _ticket_decoder)
        if ticket is None:
            if self._ticket_path(upload_id, UPLOADING).exists():
                raise UploadInProgress()
            if self._ticket_path(upload_id, USED).exists():
                raise UploadGone("this upload URL was already used; request a new one")
            raise UploadNotFound()
        if ticket.expires_at <= now:
            raise UploadGone("this upload URL has expired; request a new one")
        try:
            os.rename(path, self._ticket_path(upload_id, UPLOADING))
        except FileNotFoundError:
            # Another attempt claimed it first, or a sweep removed it as it expired.
            if self._ticket_path(upload_id, UPLOADING).exists():
                raise UploadInProgress() from None
            raise UploadGone("this upload URL has expired; request a new one") from None
        return ticket

    async def release_ticket(self, upload_id: str) -> None:
        await self._io(self._release, upload_id)

    def _release(self, upload_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.rename(self._ticket_path(upload_id, UPLOADING), self._ticket_path(upload_id, OPEN))

    # -- media --------------------------------------------------------------------

    async def write(
        self,
        upload_id: str,
        chunks: AsyncIterable[bytes],
        *,
        created_at: float,
        expires_at: float | None,
    ) -> MediaInfo:
        ticket: UploadTicket | None = await self._io(
            _load, self._ticket_path(upload_id, UPLOADING), _ticket_decoder
        )
        if ticket is None:
            raise UploadNotFound("the upload was not claimed")
        file, tmp = await self._io(self._open_part, self._shard(ticket.media_id), ticket.media_id)
        # The file call in flight, if any: cleanup waits for it before closing the file.
        pending: asyncio.Future[Any] | None = None
        committing: MediaInfo | None = None
        try:
            buffer = bytearray()
            async for chunk in exactly(chunks, ticket.size_bytes):
                buffer += chunk
                if len(buffer) >= self._write_buffer:
                    data, buffer = buffer, bytearray()
                    pending = self._start(file.write, data)
                    await self._finish(pending)
            pending = self._start(self._close_part, file, bytes(buffer))
            await self._finish(pending)
            info = ticket.media_info(created_at, expires_at)
            committing = info
            pending = self._start(self._commit, tmp, info, upload_id)
            await self._finish(pending)
            return info
        except BaseException:
            # Shielded: a second cancellation must not leave the partial file behind.
            await asyncio.shield(self._discard(pending, file, tmp, committing, upload_id))
            raise

    @staticmethod
    def _start(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(None, fn, *args)

    @staticmethod
    async def _finish(pending: asyncio.Future[T]) -> T:
        # Shielded so a cancelled upload still knows when the thread is done with the file.
        try:
            return await asyncio.shield(pending)
        except OSError as exc:
            raise StoreError("media storage failed") from exc

    @staticmethod
    def _close_part(file: BinaryIO, rest: bytes) -> None:
        with file:
            file.write(rest)

    def _open_part(self, shard: Path, media_id: str) -> tuple[BinaryIO, Path]:
        shard.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=shard, prefix=f".{media_id}.", suffix=PART)
        return os.fdopen(fd, "wb"), Path(tmp)

    async def _discard(
        self,
        pending: asyncio.Future[Any] | None,
        file: BinaryIO,
        tmp: Path,
        committing: MediaInfo | None,
        upload_id: str,
    ) -> None:
        committed = False
        if pending is not None:
            with contextlib.suppress(BaseException):
                await pending
                committed = committing is not None
        await asyncio.to_thread(self._remove_part, file, tmp)
        if committed and committing is not None:
            # Cancelled while the commit ran: undo it, the caller reports a failure.
            await asyncio.to_thread(self._uncommit, committing.media_id, upload_id)

    def _uncommit(self, media_id: str, upload_id: str) -> None:
        self._delete(media_id)
        with contextlib.suppress(FileNotFoundError):
            os.rename(self._ticket_path(upload_id, USED), self._ticket_path(upload_id, UPLOADING))

    @staticmethod
    def _remove_part(file: BinaryIO, tmp: Path) -> None:
        with contextlib.suppress(OSError):
            file.close()
        tmp.unlink(missing_ok=True)

    def _commit(self, tmp: Path, info: MediaInfo, upload_id: str) -> None:
        data_path, record_path = self._paths(info.media_id)
        os.replace(tmp, data_path)
        try:
            _write_atomically(record_path, msgspec.json.encode(info))
        except BaseException:
            data_path.unlink(missing_ok=True)
            raise
        with contextlib.suppress(FileNotFoundError):
            os.rename(self._ticket_path(upload_id, UPLOADING), self._ticket_path(upload_id, USED))

    async def direct_upload(self, upload_id: str, ticket: UploadTicket) -> DirectUpload | None:
        return None  # bodies come to `PUT /media/upload/{id}`

    async def confirm(
        self, upload_id: str, *, created_at: float, expires_at: float | None
    ) -> MediaInfo:
        raise UploadFailed("this server takes uploads at their upload URL; nothing to confirm")

    async def download_url(self, info: MediaInfo, *, expires_in: float) -> str | None:
        return None  # the download route streams the file

    async def info(self, session_id: str, media_id: str) -> MediaInfo | None:
        if not MEDIA_ID_PATTERN.fullmatch(media_id):
            return None  # also keeps any path syntax out of file names
        info = await self._io(_load, self._paths(media_id)[1], _info_decoder)
        return info if info is not None and info.session_id == session_id else None

    async def stream(
        self, session_id: str, media_id: str, *, chunk_size: int = READ_CHUNK_BYTES
    ) -> AsyncGenerator[bytes, None] | None:
        if await self.info(session_id, media_id) is None:
            return None
        file = await self._io(self._open_data, media_id)
        return None if file is None else self._chunks(file, chunk_size)

    def _open_data(self, media_id: str) -> BinaryIO | None:
        try:
            return self._paths(media_id)[0].open("rb")
        except FileNotFoundError:
            return None  # deleted since its record was read

    @staticmethod
    async def _chunks(file: BinaryIO, chunk_size: int) -> AsyncGenerator[bytes, None]:
        try:
            while chunk := await asyncio.to_thread(file.read, chunk_size):
                yield chunk
        finally:
            file.close()

    async def delete(self, session_id: str, media_id: str) -> bool:
        if await self.info(session_id, media_id) is None:
            return False
        return await self._io(self._delete, media_id)

    def _delete(self, media_id: str) -> bool:
        data_path, record_path = self._paths(media_id)
        try:
            record_path.unlink()  # first: the media is gone the moment its record is
        except FileNotFoundError:
            return False
        data_path.unlink(missing_ok=True)
        return True

    async def sweep(self, *, now: float, ticket_grace: float = 0.0) -> int:
        return await self._io(self._sweep, now, ticket_grace)

    def _sweep(self, now: float, ticket_grace: float) -> int:
        deleted = 0
        for path in self._tickets.iterdir():
            if path.suffix not in (OPEN, USED):
                continue
            ticket = _load(path, _ticket_decoder)
            if ticket is None or ticket.expires_at + ticket_grace <= now:
                path.unlink(missing_ok=True)
                # A used ticket only remembers that its URL was spent; it is not counted.
                deleted += path.suffix == OPEN
        for shard in self._objects.iterdir():
            if not shard.is_dir():
                continue
            for record_path in shard.glob("med-*.json"):
                info = _load(record_path, _info_decoder)
                if info is None or info.expired(now):
                    deleted += self._delete(record_path.stem)
        return deleted
