"""Media on S3-compatible object storage (`media: s3`), shared by every replica.

Layout in the bucket, under an optional key prefix (``<digest>`` is
`upload_key(upload_id)`, so no credential is at rest; ``<ms>`` a zero-padded
millisecond timestamp, so keys sort by time)::

    tickets/<digest>.json             the ticket
    tickets/<digest>.claim            an attempt holds it (created only if absent)
    tickets/<digest>.used             its body is stored (created only if absent)
    claims/<holder>/<digest>          the claims this store instance took
    ticket-expiry/<ms>/<digest>       the ticket, by expiry, for the sweep
    uploads/<digest>                  a body the client PUT to its presigned URL
    objects/<media id>                the bytes
    records/<media id>.json           the record (commit marker, written after the bytes)
    media-expiry/<ms>/<media id>      the media, by expiry, for the sweep

Claims rest on conditional PUT (`If-None-Match: *`): of two replicas claiming one
ticket, one creates the marker and the other is told `UploadInProgress`. A client
uploads to `uploads/<digest>`, never to the final key, and `confirm` copies the
body server-side before it checks it (HEAD: size and type), so a second PUT to a
still-valid URL cannot change media already confirmed. Expiry is the sweep reading
the `*-expiry/` indexes up to now (each replica runs it; deletes are idempotent);
no bucket lifecycle rule is needed. Every call has the `timeout` deadline; every
S3 or network failure is a `StoreError` (HTTP 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable
from typing import Any, Final, TypeVar

import aiohttp
import msgspec
from aiobotocore.session import get_session  # type: ignore[import-untyped]
from botocore.config import Config  # type: ignore[import-untyped]
from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

from portico.errors import (
    StoreError,
    UploadFailed,
    UploadGone,
    UploadInProgress,
    UploadNotFound,
    UploadTooLarge,
)
from portico.health import Health, probe
from portico.media.base import (
    MEDIA_ID_PATTERN,
    READ_CHUNK_BYTES,
    DirectUpload,
    MediaInfo,
    UploadTicket,
    content_disposition,
    exactly,
    upload_key,
)

T = TypeVar("T")

# S3's smallest multipart part (but the last); a body up to it is one PUT.
PART_BYTES: Final = 8 * 1024 * 1024
# A claim older than this belongs to an attempt that died with its process.
CLAIM_TIMEOUT: Final = 3600.0  # seconds
_MISSING: Final = frozenset({"404", "NoSuchKey", "NotFound", "NoSuchUpload"})
_PRECONDITION: Final = frozenset({"412", "PreconditionFailed", "ConditionalRequestConflict"})
_FAILURES: Final = (BotoCoreError, ClientError, aiohttp.ClientError, OSError, TimeoutError)

_ticket_decoder = msgspec.json.Decoder(UploadTicket)
_info_decoder = msgspec.json.Decoder(MediaInfo)


class _Claim(msgspec.Struct, frozen=True):
    holder: str
    at: float


_claim_decoder = msgspec.json.Decoder(_Claim)


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _missing(exc: BaseException) -> bool:
    return isinstance(exc, ClientError) and (_code(exc) in _MISSING or _status(exc) == 404)


def _precondition(exc: BaseException) -> bool:
    return isinstance(exc, ClientError) and (_code(exc) in _PRECONDITION or _status(exc) == 412)


def _ms(timestamp: float) -> str:
    # Rounded up: an index entry never comes due before its record does.
    return f"{math.ceil(timestamp * 1000):015d}"


def _due(key: str, now: float) -> bool:
    return int(key.split("/")[1]) <= now * 1000


class S3MediaStore:
    def __init__(
        self,
        *,
        bucket: str,
        prefix: str = "",  # keys start with it: one bucket may hold several stores
        endpoint_url: str | None = None,
        public_url: str | None = None,  # the store as clients reach it; None: endpoint_url
        region: str = "us-east-1",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        timeout: float = 10.0,  # seconds, the deadline of every call
        holder: str | None = None,  # this replica's id: its claims, released on open
        claim_timeout: float = CLAIM_TIMEOUT,
        part_bytes: int = PART_BYTES,
    ) -> None:
        self._bucket = bucket
        self._prefix = prefix
        self._endpoint_url = endpoint_url
        self._public_url = public_url
        self._region = region
        self._keys = (access_key_id, secret_access_key)
        self._timeout = timeout
        self._holder = holder or secrets.token_hex(8)
        self._claim_timeout = claim_timeout
        self._part_bytes = part_bytes
        self._stack: contextlib.AsyncExitStack | None = None
        self._s3: Any = None
        self._signer: Any = None  # signs the URLs clients use (no request of its own)

    # -- plumbing ---------------------------------------------------------------

    def _client(self) -> Any:
        if self._s3 is None:
            raise StoreError("media storage is not open")
        return self._s3

    def _presigner(self) -> Any:
        return self._client() if self._signer is None else self._signer

    async def _call(self, call: Awaitable[T]) -> T:
        """One S3 request within the deadline; its failures as `StoreError`."""
        try:
            async with asyncio.timeout(self._timeout):
                return await call
        except _FAILURES as exc:
            raise StoreError("media storage is unavailable") from exc

    async def _get(self, key: str) -> bytes | None:
        async def fetch() -> bytes | None:
            try:
                response = await self._client().get_object(
                    Bucket=self._bucket, Key=self._prefix + key
                )
            except ClientError as exc:
                if _missing(exc):
                    return None
                raise
            async with response["Body"] as body:
                data: bytes = await body.read()
                return data

        return await self._call(fetch())

    async def _head(self, key: str) -> dict[str, Any] | None:
        async def head() -> dict[str, Any] | None:
            try:
                result: dict[str, Any] = await self._client().head_object(
                    Bucket=self._bucket, Key=self._prefix + key
                )
                return result
            except ClientError as exc:
                if _missing(exc):
                    return None
                raise

        return await self._call(head())

    async def _put(self, key: str, body: bytes, **extra: Any) -> None:
        await self._call(
            self._client().put_object(
                Bucket=self._bucket, Key=self._prefix + key, Body=body, **extra
            )
        )

    async def _put_new(self, key: str, body: bytes) -> bool:
        """Create `key` unless it exists; False when it did (conditional PUT)."""

        async def put() -> bool:
            try:
                await self._client().put_object(
                    Bucket=self._bucket, Key=self._prefix + key, Body=body, IfNoneMatch="*"
                )
            except ClientError as exc:
                if _precondition(exc):
                    return False
                raise
            return True

        return await self._call(put())

    async def _delete(self, *keys: str) -> None:
        for key in keys:
            await self._call(
                self._client().delete_object(Bucket=self._bucket, Key=self._prefix + key)
            )

    async def _list(self, prefix: str) -> AsyncGenerator[str, None]:
        """Keys under `prefix` in order, one page (one deadline) at a time."""
        token: str | None = None
        while True:
            extra = {} if token is None else {"ContinuationToken": token}
            page: dict[str, Any] = await self._call(
                self._client().list_objects_v2(
                    Bucket=self._bucket, Prefix=self._prefix + prefix, **extra
                )
            )
            for item in page.get("Contents", []):
                yield str(item["Key"])[len(self._prefix) :]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or token is None:
                return

    # -- lifecycle ----------------------------------------------------------------

    async def open(self) -> None:
        config = Config(
            connect_timeout=self._timeout,
            read_timeout=self._timeout,
            retries={"total_max_attempts": 2, "mode": "standard"},
            # S3-compatible stores (SeaweedFS, MinIO) name the bucket in the path;
            # AWS gets the SDK's default (virtual-hosted names).
            s3={"addressing_style": "path" if self._endpoint_url else "auto"},
            signature_version="s3v4",
        )
        stack = contextlib.AsyncExitStack()
        session = get_session()

        def client(endpoint_url: str | None) -> Any:
            return session.create_client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=self._region,
                aws_access_key_id=self._keys[0],
                aws_secret_access_key=self._keys[1],
                config=config,
            )

        self._s3 = await stack.enter_async_context(client(self._endpoint_url))
        if self._public_url is not None:
            # SigV4 signs the Host: a URL for clients is signed for the host they use.
            self._signer = await stack.enter_async_context(client(self._public_url))
        self._stack = stack
        try:
            await self._ensure_bucket()
            await self._release_own_claims()
        except StoreError as exc:  # at start: say which store, and why
            await self.close()
            where = self._endpoint_url or f"AWS {self._region}"
            raise StoreError(f"cannot open media bucket {self._bucket} at {where}") from exc

    async def _ensure_bucket(self) -> None:
        try:
            await self._call(self._client().head_bucket(Bucket=self._bucket))
        except StoreError as exc:
            if not _missing(exc.__cause__ or exc):
                raise
            extra: dict[str, Any] = {}
            if self._region != "us-east-1":
                extra["CreateBucketConfiguration"] = {"LocationConstraint": self._region}
            await self._call(self._client().create_bucket(Bucket=self._bucket, **extra))

    async def _release_own_claims(self) -> None:
        """An earlier run of this replica died mid-upload: its attempts are over."""
        async with contextlib.aclosing(self._list(f"claims/{self._holder}/")) as claims:
            async for key in claims:
                digest = key.rsplit("/", 1)[1]
                await self._delete(f"tickets/{digest}.claim", key)

    async def health(self, within: float) -> Health:
        """Readiness: a HEAD of the bucket answers within `within` seconds. Every replica
        shares the bucket, so an outage takes them all out of rotation: uploads and
        downloads would fail on every one of them anyway (docs/replicas.md)."""
        return await probe(self._client().head_bucket(Bucket=self._bucket), within)

    async def close(self) -> None:
        stack, self._stack, self._s3, self._signer = self._stack, None, None, None
        if stack is not None:
            with contextlib.suppress(*_FAILURES):
                await stack.aclose()

    # -- tickets ------------------------------------------------------------------

    async def create_ticket(self, upload_id: str, ticket: UploadTicket) -> None:
        digest = upload_key(upload_id)
        await self._put(f"tickets/{digest}.json", msgspec.json.encode(ticket))
        await self._put(f"ticket-expiry/{_ms(ticket.expires_at)}/{digest}", b"")

    async def get_ticket(self, upload_id: str) -> UploadTicket | None:
        digest = upload_key(upload_id)
        if await self._head(f"tickets/{digest}.used") is not None:
            return None
        return self._ticket(await self._get(f"tickets/{digest}.json"))

    @staticmethod
    def _ticket(data: bytes | None) -> UploadTicket | None:
        if data is None:
            return None
        try:
            return _ticket_decoder.decode(data)
        except msgspec.DecodeError:
            return None

    async def claim_ticket(self, upload_id: str, *, now: float) -> UploadTicket:
        digest = upload_key(upload_id)
        await self._refuse_used(digest)
        ticket = self._ticket(await self._get(f"tickets/{digest}.json"))
        if ticket is None:
            raise UploadNotFound()
        if ticket.expires_at <= now:
            raise UploadGone("this upload URL has expired; request a new one")
        claim = msgspec.json.encode(_Claim(self._holder, now))
        claimed = await self._put_new(f"tickets/{digest}.claim", claim)
        if not claimed and not await self._take_stale_claim(digest, claim, now):
            raise UploadInProgress()
        try:
            await self._put(f"claims/{self._holder}/{digest}", b"")
            # The attempt that held it before may have stored the body in between.
            await self._refuse_used(digest)
        except BaseException:
            # No attempt follows a failed claim: it must not hold the ticket.
            await asyncio.shield(
                self._forget(f"tickets/{digest}.claim", f"claims/{self._holder}/{digest}")
            )
            raise
        return ticket

    async def _refuse_used(self, digest: str) -> None:
        if await self._head(f"tickets/{digest}.used") is not None:
            raise UploadGone("this upload URL was already used; request a new one")

    async def _take_stale_claim(self, digest: str, claim: bytes, now: float) -> bool:
        held = await self._get(f"tickets/{digest}.claim")
        try:
            holder = None if held is None else _claim_decoder.decode(held)
        except msgspec.DecodeError:
            holder = None
        if holder is not None and holder.at + self._claim_timeout > now:
            return False
        await self._delete(f"tickets/{digest}.claim")
        return await self._put_new(f"tickets/{digest}.claim", claim)

    async def release_ticket(self, upload_id: str) -> None:
        digest = upload_key(upload_id)
        if await self._head(f"tickets/{digest}.used") is None:
            await self._delete(f"tickets/{digest}.claim")
        await self._delete(f"claims/{self._holder}/{digest}")

    async def _claimed(self, upload_id: str) -> UploadTicket:
        digest = upload_key(upload_id)
        if await self._head(f"tickets/{digest}.claim") is None:
            raise UploadNotFound("the upload was not claimed")
        ticket = self._ticket(await self._get(f"tickets/{digest}.json"))
        if ticket is None:
            raise UploadNotFound("the upload was not claimed")
        return ticket

    # -- uploads --------------------------------------------------------------------

    async def direct_upload(self, upload_id: str, ticket: UploadTicket) -> DirectUpload:
        params = {
            "Bucket": self._bucket,
            "Key": f"{self._prefix}uploads/{upload_key(upload_id)}",
            "ContentType": ticket.mime_type,
            "ContentLength": ticket.size_bytes,
        }
        lifetime = max(1, math.ceil(ticket.expires_at - ticket.created_at))
        url: str = await self._call(
            self._presigner().generate_presigned_url(
                "put_object", Params=params, ExpiresIn=lifetime
            )
        )
        return DirectUpload(url=url, headers={"Content-Type": ticket.mime_type})

    async def confirm(
        self, upload_id: str, *, created_at: float, expires_at: float | None
    ) -> MediaInfo:
        ticket = await self._claimed(upload_id)
        digest = upload_key(upload_id)
        staged, final = f"uploads/{digest}", f"objects/{ticket.media_id}"
        try:
            await self._copy(staged, final)
            head = await self._head(final)
            if head is None:
                raise UploadFailed("nothing was uploaded to the upload URL")
            self._check_arrived(ticket, head)
            info = ticket.media_info(created_at, expires_at)
            await self._commit(upload_id, info)
        except UploadFailed:
            await asyncio.shield(self._forget(final, staged))  # the body was not the one
            raise
        except BaseException:
            # The store failed, not the body: a confirm retried later may still take it.
            await asyncio.shield(self._forget(final))
            raise
        with contextlib.suppress(StoreError):
            await self._delete(staged)  # a leftover goes with the ticket's sweep
        return info

    async def _copy(self, source: str, target: str) -> None:
        async def copy() -> None:
            try:
                await self._client().copy_object(
                    Bucket=self._bucket,
                    Key=self._prefix + target,
                    CopySource={"Bucket": self._bucket, "Key": self._prefix + source},
                )
            except ClientError as exc:
                if _missing(exc):
                    raise UploadFailed(
                        "nothing was uploaded to the upload URL; PUT the file there first"
                    ) from None
                raise

        await self._call(copy())

    @staticmethod
    def _check_arrived(ticket: UploadTicket, head: dict[str, Any]) -> None:
        size = int(head.get("ContentLength", -1))
        if size > ticket.size_bytes:
            raise UploadTooLarge(
                f"the body is {size} bytes, longer than the declared {ticket.size_bytes}"
            )
        if size != ticket.size_bytes:
            raise UploadFailed(f"the body is {size} of the declared {ticket.size_bytes} bytes")
        if head.get("ContentType") != ticket.mime_type:
            raise UploadFailed(f"the body was not sent as {ticket.mime_type}")

    async def _forget(self, *keys: str) -> None:
        with contextlib.suppress(StoreError):
            await self._delete(*keys)

    async def _commit(self, upload_id: str, info: MediaInfo) -> None:
        """Record the stored bytes, then mark the ticket used; undone on any failure."""
        digest = upload_key(upload_id)
        record = f"records/{info.media_id}.json"
        index = None if info.expires_at is None else f"media-expiry/{_ms(info.expires_at)}/"
        try:
            if index is not None:
                index += info.media_id
                await self._put(index, b"")  # first: a record is never left unswept
            await self._put(record, msgspec.json.encode(info))
            await self._put_new(f"tickets/{digest}.used", b"")
        except BaseException:
            await asyncio.shield(
                self._forget(f"tickets/{digest}.used", record, *([index] if index else []))
            )
            raise
        with contextlib.suppress(StoreError):
            await self._delete(f"tickets/{digest}.claim", f"claims/{self._holder}/{digest}")

    async def write(
        self,
        upload_id: str,
        chunks: AsyncIterable[bytes],
        *,
        created_at: float,
        expires_at: float | None,
    ) -> MediaInfo:
        ticket = await self._claimed(upload_id)
        final = f"objects/{ticket.media_id}"
        try:
            await self._upload(final, exactly(chunks, ticket.size_bytes), ticket.mime_type)
            info = ticket.media_info(created_at, expires_at)
            await self._commit(upload_id, info)
        except BaseException:
            await asyncio.shield(self._forget(final))
            raise
        return info

    async def _upload(self, key: str, chunks: AsyncIterable[bytes], mime_type: str) -> None:
        """One PUT for a body up to a part, else a multipart upload; memory: one part."""
        buffer = bytearray()
        multipart: str | None = None
        parts: list[dict[str, Any]] = []
        try:
            async for chunk in chunks:
                buffer += chunk
                while len(buffer) >= self._part_bytes:
                    if multipart is None:
                        multipart = await self._start_multipart(key, mime_type)
                    part, buffer = bytes(buffer[: self._part_bytes]), buffer[self._part_bytes :]
                    parts.append(await self._upload_part(key, multipart, len(parts) + 1, part))
            if multipart is None:
                await self._put(key, bytes(buffer), ContentType=mime_type)
                return
            if buffer or not parts:
                parts.append(await self._upload_part(key, multipart, len(parts) + 1, bytes(buffer)))
            await self._call(
                self._client().complete_multipart_upload(
                    Bucket=self._bucket,
                    Key=self._prefix + key,
                    UploadId=multipart,
                    MultipartUpload={"Parts": parts},
                )
            )
        except BaseException:
            if multipart is not None:
                await asyncio.shield(self._abort(key, multipart))
            raise

    async def _start_multipart(self, key: str, mime_type: str) -> str:
        started: dict[str, Any] = await self._call(
            self._client().create_multipart_upload(
                Bucket=self._bucket, Key=self._prefix + key, ContentType=mime_type
            )
        )
        return str(started["UploadId"])

    async def _upload_part(self, key: str, upload: str, number: int, data: bytes) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            self._client().upload_part(
                Bucket=self._bucket,
                Key=self._prefix + key,
                UploadId=upload,
                PartNumber=number,
                Body=data,
            )
        )
        return {"ETag": result["ETag"], "PartNumber": number}

    async def _abort(self, key: str, upload: str) -> None:
        with contextlib.suppress(StoreError):
            await self._call(
                self._client().abort_multipart_upload(
                    Bucket=self._bucket, Key=self._prefix + key, UploadId=upload
                )
            )

    # -- media --------------------------------------------------------------------

    async def info(self, session_id: str, media_id: str) -> MediaInfo | None:
        if not MEDIA_ID_PATTERN.fullmatch(media_id):
            return None  # also keeps any key syntax out of object names
        data = await self._get(f"records/{media_id}.json")
        if data is None:
            return None
        try:
            info = _info_decoder.decode(data)
        except msgspec.DecodeError:
            return None
        return info if info.session_id == session_id else None

    async def download_url(self, info: MediaInfo, *, expires_in: float) -> str:
        params = {
            "Bucket": self._bucket,
            "Key": f"{self._prefix}objects/{info.media_id}",
            "ResponseContentDisposition": content_disposition(info.filename),
        }
        url: str = await self._call(
            self._presigner().generate_presigned_url(
                "get_object", Params=params, ExpiresIn=max(1, math.ceil(expires_in))
            )
        )
        return url

    async def stream(
        self, session_id: str, media_id: str, *, chunk_size: int = READ_CHUNK_BYTES
    ) -> AsyncGenerator[bytes, None] | None:
        if await self.info(session_id, media_id) is None:
            return None

        async def open_body() -> Any:
            try:
                response = await self._client().get_object(
                    Bucket=self._bucket, Key=f"{self._prefix}objects/{media_id}"
                )
            except ClientError as exc:
                if _missing(exc):
                    return None  # deleted since its record was read
                raise
            return response["Body"]

        body = await self._call(open_body())
        return None if body is None else self._chunks(body, chunk_size)

    async def _chunks(self, body: Any, chunk_size: int) -> AsyncGenerator[bytes, None]:
        try:
            buffer = bytearray()
            while True:
                piece: bytes = await self._call(body.read(chunk_size - len(buffer)))
                if not piece:
                    break
                buffer += piece
                if len(buffer) >= chunk_size:
                    yield bytes(buffer)
                    buffer = bytearray()
            if buffer:
                yield bytes(buffer)
        finally:
            body.close()

    async def delete(self, session_id: str, media_id: str) -> bool:
        info = await self.info(session_id, media_id)
        if info is None:
            return False
        await self._delete_media(info)
        return True

    async def _delete_media(self, info: MediaInfo) -> None:
        keys = [f"records/{info.media_id}.json", f"objects/{info.media_id}"]
        if info.expires_at is not None:
            keys.append(f"media-expiry/{_ms(info.expires_at)}/{info.media_id}")
        await self._delete(*keys)  # the record first: the media is gone the moment it is

    async def sweep(self, *, now: float, ticket_grace: float = 0.0) -> int:
        deleted = 0
        async with contextlib.aclosing(self._list("ticket-expiry/")) as tickets:
            async for key in tickets:
                if not _due(key, now - ticket_grace):
                    break  # keys sort by expiry: the rest is not due either
                deleted += await self._sweep_ticket(key, now)
        async with contextlib.aclosing(self._list("media-expiry/")) as media:
            async for key in media:
                if not _due(key, now):
                    break
                media_id = key.rsplit("/", 1)[1]
                had = await self._head(f"records/{media_id}.json") is not None
                await self._delete(f"records/{media_id}.json", f"objects/{media_id}", key)
                deleted += had
        return deleted

    async def _sweep_ticket(self, key: str, now: float) -> int:
        digest = key.rsplit("/", 1)[1]
        claim = await self._get(f"tickets/{digest}.claim")
        used = await self._head(f"tickets/{digest}.used") is not None
        if claim is not None and not used:
            with contextlib.suppress(msgspec.DecodeError):
                if _claim_decoder.decode(claim).at + self._claim_timeout > now:
                    return 0  # being uploaded: it stays until the attempt ends
        await self._delete(
            f"tickets/{digest}.json",
            f"tickets/{digest}.claim",
            f"tickets/{digest}.used",
            f"uploads/{digest}",
            key,
        )
        return 0 if used else 1
