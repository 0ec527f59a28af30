"""The MediaStore port's contract: every media backend must pass this one suite.

A backend joins by adding one `Backend` to `BACKENDS`: a factory that returns an
unopened store for a test's temporary directory (the same directory again means
the same storage, for the reopen tests), and a probe listing what it holds
besides tickets, so "nothing stored" is checked against the real storage. A
backend on a server (s3: SeaweedFS, started once per session) names the fixture
that provides it; its factory and probe get that fixture's value.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from portico.errors import (
    StoreError,
    UploadFailed,
    UploadGone,
    UploadInProgress,
    UploadNotFound,
    UploadTooLarge,
)
from portico.media.base import MediaStore, UploadTicket, new_media_id, new_upload_id
from portico.media.local import LocalMediaStore
from support.seaweed import ACCESS_KEY, SECRET_KEY, Seaweed
from support.tcprelay import TcpRelay

NOW = 1_000_000.0
# Small parts, so the contract's larger bodies go through S3's multipart upload too.
S3_TEST_PART_BYTES = 5 * 1024 * 1024  # the smallest part S3 (and SeaweedFS) takes


@dataclass(frozen=True)
class Backend:
    make: Callable[[Path, Any], Awaitable[MediaStore]]
    stored: Callable[[Path, Any], Awaitable[list[str]]]
    resource: str | None = None  # the fixture the backend runs on, if any
    # Put a body where a direct upload lands, as a store that ignores the signed size
    # and type would take it (SeaweedFS does, for SigV2 URLs): what `confirm` must check.
    stage: Callable[[Path, Any, str, bytes, str], Awaitable[None]] | None = None


async def local_store(tmp_path: Path, _: Any) -> MediaStore:
    return LocalMediaStore(tmp_path / "media")


async def local_stored(tmp_path: Path, _: Any) -> list[str]:
    objects = tmp_path / "media" / "objects"
    return sorted(str(p.relative_to(objects)) for p in objects.rglob("*") if p.is_file())


S3_BUCKET = "portico-contract"


def prefix_of(tmp_path: Path) -> str:
    """A key prefix per test in one bucket (SeaweedFS gives each bucket its own
    volumes, so a bucket per test would run out): the same directory, the same storage."""
    return hashlib.sha256(str(tmp_path).encode()).hexdigest()[:24] + "/"


async def s3_store(tmp_path: Path, seaweed: Seaweed, **options: Any) -> MediaStore:
    from portico.media.s3 import S3MediaStore

    return S3MediaStore(
        bucket=S3_BUCKET,
        prefix=prefix_of(tmp_path),
        endpoint_url=seaweed.endpoint_url,
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        holder="replica-1",
        part_bytes=S3_TEST_PART_BYTES,
        **options,
    )


async def s3_keys(seaweed: Seaweed, bucket: str, prefix: str = "") -> list[str]:
    from aiobotocore.session import get_session

    async with get_session().create_client(
        "s3",
        endpoint_url=seaweed.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    ) as s3:
        page = await s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for item in page.get("Contents", []))


async def s3_stage(
    tmp_path: Path, seaweed: Seaweed, upload_id: str, body: bytes, mime_type: str
) -> None:
    from aiobotocore.session import get_session

    from portico.media.base import upload_key

    async with get_session().create_client(
        "s3",
        endpoint_url=seaweed.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    ) as s3:
        key = f"{prefix_of(tmp_path)}uploads/{upload_key(upload_id)}"
        await s3.put_object(Bucket=S3_BUCKET, Key=key, Body=body, ContentType=mime_type)


async def s3_stored(tmp_path: Path, seaweed: Seaweed) -> list[str]:
    prefix = prefix_of(tmp_path)
    keys = [key[len(prefix) :] for key in await s3_keys(seaweed, S3_BUCKET, prefix)]
    return [key for key in keys if key.startswith(("objects/", "records/"))]


needs_s3 = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("aiobotocore"), reason="needs portico[s3]"
)

BACKENDS = [
    pytest.param(Backend(local_store, local_stored), id="local"),
    pytest.param(Backend(s3_store, s3_stored, "seaweed", s3_stage), id="s3", marks=needs_s3),
]


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    server = Seaweed(Path(tmp_path_factory.mktemp("seaweed")))
    server.start()
    yield server
    server.stop()


@dataclass
class Harness:
    backend: Backend
    path: Path
    store: MediaStore
    resource: Any = None

    async def reopen(self) -> MediaStore:
        await self.store.close()
        self.store = await self.backend.make(self.path, self.resource)
        await self.store.open()
        return self.store

    async def stored(self) -> list[str]:
        return await self.backend.stored(self.path, self.resource)

    async def stage(self, upload_id: str, body: bytes, mime_type: str = "image/jpeg") -> None:
        assert self.backend.stage is not None
        await self.backend.stage(self.path, self.resource, upload_id, body, mime_type)


@pytest.fixture(params=BACKENDS)
async def harness(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    backend: Backend = request.param
    resource = None if backend.resource is None else request.getfixturevalue(backend.resource)
    store = await backend.make(tmp_path, resource)
    await store.open()
    harness = Harness(backend, tmp_path, store, resource)
    try:
        yield harness
    finally:
        await harness.store.close()


@pytest.fixture
async def harness_s3(tmp_path: Path, seaweed: Seaweed) -> AsyncIterator[Harness]:
    backend = Backend(s3_store, s3_stored, "seaweed", s3_stage)
    store = await s3_store(tmp_path, seaweed)
    await store.open()
    harness = Harness(backend, tmp_path, store, seaweed)
    try:
        yield harness
    finally:
        await harness.store.close()


@pytest.fixture
def store(harness: Harness) -> MediaStore:
    return harness.store


# -- helpers ------------------------------------------------------------------------


def make_ticket(
    size: int = 10,
    *,
    session_id: str = "s1",
    owner: str = "alice",
    expires_at: float = NOW + 900,
) -> UploadTicket:
    return UploadTicket(
        media_id=new_media_id(),
        session_id=session_id,
        owner=owner,
        filename="photo.jpg",
        mime_type="image/jpeg",
        size_bytes=size,
        created_at=NOW,
        expires_at=expires_at,
    )


async def chunks_of(data: bytes, size: int = 7) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def granted(store: MediaStore, size: int = 10, **fields: object) -> tuple[str, UploadTicket]:
    upload_id, ticket = new_upload_id(), make_ticket(size, **fields)  # type: ignore[arg-type]
    await store.create_ticket(upload_id, ticket)
    return upload_id, ticket


async def uploaded(
    store: MediaStore, data: bytes, *, expires_at: float | None = NOW + 3600, **fields: object
) -> UploadTicket:
    upload_id, ticket = await granted(store, len(data), **fields)
    await store.claim_ticket(upload_id, now=NOW)
    await store.write(upload_id, chunks_of(data), created_at=NOW, expires_at=expires_at)
    return ticket


async def read_all(store: MediaStore, session_id: str, media_id: str) -> bytes | None:
    body = await store.stream(session_id, media_id)
    if body is None:
        return None
    return b"".join([chunk async for chunk in body])


# -- tickets ------------------------------------------------------------------------


async def test_an_open_media_store_is_ready(store: MediaStore) -> None:
    health = await store.health(5.0)
    assert health.ready, health.reason


async def test_ticket_round_trip(store: MediaStore) -> None:
    upload_id, ticket = await granted(store)
    assert await store.get_ticket(upload_id) == ticket
    assert await store.get_ticket(new_upload_id()) is None


async def test_a_ticket_is_claimed_once(store: MediaStore) -> None:
    upload_id, ticket = await granted(store)
    assert await store.claim_ticket(upload_id, now=NOW) == ticket
    with pytest.raises(UploadInProgress) as caught:
        await store.claim_ticket(upload_id, now=NOW)
    assert caught.value.http_status == 409
    assert await store.get_ticket(upload_id) == ticket  # unused until written


async def test_concurrent_claims_have_one_winner(store: MediaStore) -> None:
    upload_id, _ = await granted(store)
    results = await asyncio.gather(
        *(store.claim_ticket(upload_id, now=NOW) for _ in range(8)), return_exceptions=True
    )
    assert sum(isinstance(r, UploadTicket) for r in results) == 1
    assert all(isinstance(r, UploadTicket | UploadInProgress) for r in results)


async def test_claiming_an_unknown_ticket(store: MediaStore) -> None:
    with pytest.raises(UploadNotFound) as caught:
        await store.claim_ticket(new_upload_id(), now=NOW)
    assert caught.value.http_status == 404


async def test_claiming_an_expired_ticket(store: MediaStore) -> None:
    upload_id, _ = await granted(store, expires_at=NOW)
    with pytest.raises(UploadGone) as caught:
        await store.claim_ticket(upload_id, now=NOW)
    assert caught.value.http_status == 410


async def test_a_released_ticket_can_be_claimed_again(store: MediaStore) -> None:
    upload_id, ticket = await granted(store)
    await store.claim_ticket(upload_id, now=NOW)
    await store.release_ticket(upload_id)
    assert await store.claim_ticket(upload_id, now=NOW) == ticket


async def test_a_used_ticket_is_gone(store: MediaStore) -> None:
    upload_id, _ = await granted(store, 3)
    await store.claim_ticket(upload_id, now=NOW)
    await store.write(upload_id, chunks_of(b"abc"), created_at=NOW, expires_at=None)
    assert await store.get_ticket(upload_id) is None
    with pytest.raises(UploadGone):
        await store.claim_ticket(upload_id, now=NOW)
    await store.release_ticket(upload_id)  # no effect on a used ticket
    with pytest.raises(UploadGone):
        await store.claim_ticket(upload_id, now=NOW)


# -- writing ------------------------------------------------------------------------


async def test_write_then_info_and_read_are_byte_exact(store: MediaStore) -> None:
    data = os.urandom(700_001)  # spans several write buffers, ends mid-chunk
    upload_id, ticket = await granted(store, len(data))
    await store.claim_ticket(upload_id, now=NOW)
    info = await store.write(
        upload_id, chunks_of(data, 65_536), created_at=NOW + 1, expires_at=NOW + 3600
    )
    assert (info.media_id, info.session_id, info.owner) == (ticket.media_id, "s1", "alice")
    assert (info.filename, info.mime_type, info.size_bytes) == (
        "photo.jpg",
        "image/jpeg",
        len(data),
    )
    assert (info.created_at, info.expires_at) == (NOW + 1, NOW + 3600)
    assert info.storage_ref == f"omnia://sessions/s1/media/{ticket.media_id}"
    assert await store.info("s1", ticket.media_id) == info
    assert await read_all(store, "s1", ticket.media_id) == data


async def test_an_empty_upload(store: MediaStore) -> None:
    ticket = await uploaded(store, b"")
    assert await read_all(store, "s1", ticket.media_id) == b""


async def test_small_read_chunks(store: MediaStore) -> None:
    ticket = await uploaded(store, b"0123456789")
    body = await store.stream("s1", ticket.media_id, chunk_size=3)
    assert body is not None
    assert [chunk async for chunk in body] == [b"012", b"345", b"678", b"9"]


async def test_a_longer_body_is_refused_as_it_arrives(harness: Harness) -> None:
    store = harness.store
    upload_id, ticket = await granted(store, 10)
    await store.claim_ticket(upload_id, now=NOW)
    sent: list[int] = []

    async def endless() -> AsyncIterator[bytes]:
        for n in range(1000):
            sent.append(n)
            yield b"x" * 4

    with pytest.raises(UploadTooLarge) as caught:
        await store.write(upload_id, endless(), created_at=NOW, expires_at=None)
    assert caught.value.http_status == 413
    assert len(sent) == 3  # stopped at the chunk that passed the declared size
    assert await store.info("s1", ticket.media_id) is None
    assert await harness.stored() == []


async def test_a_shorter_body_is_refused(harness: Harness) -> None:
    store = harness.store
    upload_id, ticket = await granted(store, 10)
    await store.claim_ticket(upload_id, now=NOW)
    with pytest.raises(UploadFailed) as caught:
        await store.write(upload_id, chunks_of(b"123456789"), created_at=NOW, expires_at=None)
    assert not isinstance(caught.value, UploadTooLarge)
    assert caught.value.http_status == 400
    assert await store.info("s1", ticket.media_id) is None
    assert await harness.stored() == []


async def test_a_failed_write_keeps_the_ticket_claimed(store: MediaStore) -> None:
    upload_id, ticket = await granted(store, 10)
    await store.claim_ticket(upload_id, now=NOW)
    with pytest.raises(UploadFailed):
        await store.write(upload_id, chunks_of(b"short"), created_at=NOW, expires_at=None)
    with pytest.raises(UploadInProgress):
        await store.claim_ticket(upload_id, now=NOW)
    await store.release_ticket(upload_id)
    await store.claim_ticket(upload_id, now=NOW)
    info = await store.write(upload_id, chunks_of(b"0123456789"), created_at=NOW, expires_at=None)
    assert info.media_id == ticket.media_id


async def test_a_broken_source_stores_nothing(harness: Harness) -> None:
    store = harness.store
    upload_id, ticket = await granted(store, 1_000_000)
    await store.claim_ticket(upload_id, now=NOW)

    async def broken() -> AsyncIterator[bytes]:
        yield b"x" * 600_000
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        await store.write(upload_id, broken(), created_at=NOW, expires_at=None)
    assert await store.info("s1", ticket.media_id) is None
    assert await harness.stored() == []


async def test_a_cancelled_write_stores_nothing(harness: Harness) -> None:
    store = harness.store
    upload_id, ticket = await granted(store, 1_000_000)
    await store.claim_ticket(upload_id, now=NOW)
    halfway = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield b"x" * 600_000
        yield b"x" * 100
        halfway.set()
        await asyncio.Event().wait()
        yield b""

    task = asyncio.create_task(store.write(upload_id, stalls(), created_at=NOW, expires_at=None))
    await halfway.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.info("s1", ticket.media_id) is None
    assert await harness.stored() == []


async def test_writing_an_unclaimed_ticket_is_refused(store: MediaStore) -> None:
    upload_id, _ = await granted(store, 3)
    with pytest.raises(UploadNotFound):
        await store.write(upload_id, chunks_of(b"abc"), created_at=NOW, expires_at=None)


# -- reading and deleting -----------------------------------------------------------


async def test_media_is_addressed_by_session_and_id(store: MediaStore) -> None:
    ticket = await uploaded(store, b"abc")
    assert await store.info("s2", ticket.media_id) is None
    assert await store.stream("s2", ticket.media_id) is None
    assert await store.info("s1", new_media_id()) is None
    assert await store.stream("s1", new_media_id()) is None


@pytest.mark.parametrize("media_id", ["../../tickets/x", "med-..", "", "med-" + "0" * 31 + "/"])
async def test_malformed_media_ids_find_nothing(store: MediaStore, media_id: str) -> None:
    assert await store.info("s1", media_id) is None
    assert await store.stream("s1", media_id) is None
    assert await store.delete("s1", media_id) is False


async def test_delete(store: MediaStore) -> None:
    ticket = await uploaded(store, b"abc")
    assert await store.delete("s2", ticket.media_id) is False
    assert await store.delete("s1", ticket.media_id) is True
    assert await store.info("s1", ticket.media_id) is None
    assert await store.stream("s1", ticket.media_id) is None
    assert await store.delete("s1", ticket.media_id) is False


async def test_an_open_stream_outlives_a_delete(store: MediaStore) -> None:
    ticket = await uploaded(store, b"0123456789")
    body = await store.stream("s1", ticket.media_id, chunk_size=4)
    assert body is not None
    await store.delete("s1", ticket.media_id)
    assert b"".join([chunk async for chunk in body]) == b"0123456789"


# -- expiry -------------------------------------------------------------------------


async def test_sweep_deletes_expired_media_and_unused_tickets(harness: Harness) -> None:
    store = harness.store
    expired = await uploaded(store, b"old", expires_at=NOW + 10)
    fresh = await uploaded(store, b"new", expires_at=NOW + 100)
    forever = await uploaded(store, b"kept", expires_at=None)
    stale_upload, _ = await granted(store, expires_at=NOW + 10)
    live_upload, _ = await granted(store, expires_at=NOW + 100)

    assert await store.sweep(now=NOW + 10) == 2
    assert await store.info("s1", expired.media_id) is None
    assert await read_all(store, "s1", fresh.media_id) == b"new"
    assert await read_all(store, "s1", forever.media_id) == b"kept"
    assert await store.get_ticket(stale_upload) is None
    assert await store.get_ticket(live_upload) is not None
    assert len(await harness.stored()) == 4  # two media, data and record each

    assert await store.sweep(now=NOW + 10) == 0
    assert await store.sweep(now=NOW + 10**9) == 2
    assert await read_all(store, "s1", forever.media_id) == b"kept"


async def test_sweep_keeps_expired_tickets_for_a_grace_period(store: MediaStore) -> None:
    stale, _ = await granted(store, expires_at=NOW + 10)
    used, _ = await granted(store, 1, expires_at=NOW + 10)
    await store.claim_ticket(used, now=NOW)
    await store.write(used, chunks_of(b"x"), created_at=NOW, expires_at=None)

    assert await store.sweep(now=NOW + 15, ticket_grace=10) == 0
    with pytest.raises(UploadGone, match="expired"):
        await store.claim_ticket(stale, now=NOW + 15)
    with pytest.raises(UploadGone, match="used"):
        await store.claim_ticket(used, now=NOW + 15)

    assert await store.sweep(now=NOW + 20, ticket_grace=10) == 1  # the used one is not counted
    for upload_id in (stale, used):
        with pytest.raises(UploadNotFound):
            await store.claim_ticket(upload_id, now=NOW + 20)


async def test_sweep_keeps_a_ticket_being_uploaded(store: MediaStore) -> None:
    upload_id, ticket = await granted(store, 3, expires_at=NOW + 10)
    await store.claim_ticket(upload_id, now=NOW)
    assert await store.sweep(now=NOW + 20) == 0
    info = await store.write(upload_id, chunks_of(b"abc"), created_at=NOW, expires_at=None)
    assert info.media_id == ticket.media_id


# -- restart ------------------------------------------------------------------------


async def test_tickets_and_media_survive_a_reopen(harness: Harness) -> None:
    store = harness.store
    upload_id, ticket = await granted(store)
    media = await uploaded(store, b"persistent")
    store = await harness.reopen()
    assert await store.get_ticket(upload_id) == ticket
    info = await store.info("s1", media.media_id)
    assert info is not None
    assert info.filename == "photo.jpg"
    assert await read_all(store, "s1", media.media_id) == b"persistent"


async def test_a_used_ticket_stays_used_after_a_reopen(harness: Harness) -> None:
    upload_id, _ = await granted(harness.store, 1)
    await harness.store.claim_ticket(upload_id, now=NOW)
    await harness.store.write(upload_id, chunks_of(b"x"), created_at=NOW, expires_at=None)
    store = await harness.reopen()
    with pytest.raises(UploadGone):
        await store.claim_ticket(upload_id, now=NOW)


async def test_an_interrupted_upload_reopens_usable(harness: Harness) -> None:
    upload_id, ticket = await granted(harness.store, 3)
    await harness.store.claim_ticket(upload_id, now=NOW)
    store = await harness.reopen()  # as after a crash mid-upload
    assert await store.claim_ticket(upload_id, now=NOW) == ticket


# -- local backend specifics ----------------------------------------------------------


# -- direct uploads and downloads (any backend: local has neither) ------------------


async def put_direct(store: MediaStore, upload_id: str, ticket: UploadTicket, data: bytes) -> bool:
    """PUT `data` to the ticket's direct upload URL; False when the backend has none."""
    direct = await store.direct_upload(upload_id, ticket)
    if direct is None:
        return False
    async with (
        aiohttp.ClientSession() as http,
        http.put(direct.url, data=data, headers=direct.headers) as response,
    ):
        assert response.status == 200, await response.text()
    return True


async def test_a_direct_upload_is_confirmed_and_served(harness: Harness) -> None:
    store = harness.store
    data = os.urandom(70_000)
    upload_id, ticket = await granted(store, len(data))
    direct = await put_direct(store, upload_id, ticket, data)
    await store.claim_ticket(upload_id, now=NOW)
    if not direct:
        with pytest.raises(UploadFailed, match="nothing to confirm"):
            await store.confirm(upload_id, created_at=NOW, expires_at=None)
        info = await store.write(upload_id, chunks_of(data), created_at=NOW, expires_at=None)
        assert await store.download_url(info, expires_in=60) is None
        return
    info = await store.confirm(upload_id, created_at=NOW, expires_at=NOW + 3600)
    assert (info.media_id, info.size_bytes, info.mime_type) == (
        ticket.media_id,
        len(data),
        "image/jpeg",
    )
    assert await store.info("s1", ticket.media_id) == info
    assert await read_all(store, "s1", ticket.media_id) == data
    assert await store.get_ticket(upload_id) is None
    with pytest.raises(UploadGone, match="used"):
        await store.claim_ticket(upload_id, now=NOW)
    url = await store.download_url(info, expires_in=60)
    assert url is not None
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200
        assert await response.read() == data
        assert response.headers["Content-Disposition"].startswith(
            'attachment; filename="photo.jpg"'
        )


async def test_a_second_put_to_a_used_url_does_not_change_the_media(harness: Harness) -> None:
    store = harness.store
    upload_id, ticket = await granted(store, 5)
    if not await put_direct(store, upload_id, ticket, b"first"):
        pytest.skip("the backend has no direct uploads")
    await store.claim_ticket(upload_id, now=NOW)
    await store.confirm(upload_id, created_at=NOW, expires_at=None)
    await put_direct(store, upload_id, ticket, b"other")
    assert await read_all(store, "s1", ticket.media_id) == b"first"


async def test_a_signed_upload_url_refuses_another_size_or_type(harness: Harness) -> None:
    """Where the store checks the signature (SigV4 signs Content-Length and -Type)."""
    store = harness.store
    upload_id, ticket = await granted(store, 10)
    direct = await store.direct_upload(upload_id, ticket)
    if direct is None:
        pytest.skip("the backend has no direct uploads")
    async with aiohttp.ClientSession() as http:
        for body, mime_type in [(b"0123456789!", "image/jpeg"), (b"0123456789", "text/html")]:
            headers = {"Content-Type": mime_type}
            async with http.put(direct.url, data=body, headers=headers) as response:
                assert response.status == 403


@pytest.mark.parametrize(
    ("body", "mime_type", "error", "status"),
    [
        pytest.param(b"0123456789!", "image/jpeg", UploadTooLarge, 413, id="longer"),
        pytest.param(b"012345678", "image/jpeg", UploadFailed, 400, id="shorter"),
        pytest.param(b"0123456789", "text/html", UploadFailed, 400, id="other-type"),
        pytest.param(None, "image/jpeg", UploadFailed, 400, id="nothing"),
    ],
)
async def test_confirm_refuses_a_body_that_is_not_the_declared_one(
    harness: Harness, body: bytes | None, mime_type: str, error: type[UploadFailed], status: int
) -> None:
    """A store may take a body other than signed (SeaweedFS with SigV2 URLs): confirm checks."""
    store = harness.store
    upload_id, ticket = await granted(store, 10)
    if await store.direct_upload(upload_id, ticket) is None:
        pytest.skip("the backend has no direct uploads")
    if body is not None:
        await harness.stage(upload_id, body, mime_type)
    await store.claim_ticket(upload_id, now=NOW)
    with pytest.raises(error) as caught:
        await store.confirm(upload_id, created_at=NOW, expires_at=None)
    assert caught.value.http_status == status
    assert await store.info("s1", ticket.media_id) is None
    assert await harness.stored() == []
    # What arrived is gone; the ticket stays claimed, and once released the URL works again.
    with pytest.raises(UploadInProgress):
        await store.claim_ticket(upload_id, now=NOW)
    await store.release_ticket(upload_id)
    await put_direct(store, upload_id, ticket, b"0123456789")
    await store.claim_ticket(upload_id, now=NOW)
    await store.confirm(upload_id, created_at=NOW, expires_at=None)
    assert await read_all(store, "s1", ticket.media_id) == b"0123456789"


async def test_confirming_an_unclaimed_ticket_is_refused(store: MediaStore) -> None:
    upload_id, _ = await granted(store, 3)
    with pytest.raises(UploadFailed):
        await store.confirm(upload_id, created_at=NOW, expires_at=None)


# -- s3 backend specifics ---------------------------------------------------------------


async def _black_hole() -> tuple[asyncio.Server, int]:
    """A port that accepts connections and never answers: a stalled object store."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@needs_s3
@pytest.mark.parametrize("fault", ["stalled", "refused"])
async def test_s3_unreachable_is_a_store_error_within_the_deadline(
    tmp_path: Path, fault: str
) -> None:
    from portico.media.s3 import S3MediaStore

    server, port = await _black_hole()
    if fault == "refused":
        server.close()
        await server.wait_closed()
    store = S3MediaStore(
        bucket="portico-media",
        endpoint_url=f"http://127.0.0.1:{port}",
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        timeout=0.5,
    )
    try:
        async with asyncio.timeout(30):  # far above the deadline: a hang fails here
            with pytest.raises(StoreError, match="cannot open media bucket portico-media"):
                await store.open()
    finally:
        server.close()


@needs_s3
async def test_s3_a_store_gone_silent_fails_each_call_within_the_deadline(
    tmp_path: Path, seaweed: Seaweed
) -> None:
    """Opened against a live store that then stops answering, on open connections too."""
    from portico.media.s3 import S3MediaStore

    async with TcpRelay(seaweed.s3_port) as relay:
        store = S3MediaStore(
            bucket=S3_BUCKET,
            prefix=prefix_of(tmp_path),
            endpoint_url=f"http://127.0.0.1:{relay.port}",
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            timeout=2.0,  # room for the calls before the stall on a busy machine
        )
        await store.open()
        try:
            media = await uploaded(store, b"kept")
            relay.stall()
            async with asyncio.timeout(30):  # far above the deadline: a hang fails here
                with pytest.raises(StoreError) as caught:
                    await store.info("s1", media.media_id)
                assert caught.value.http_status == 503
                with pytest.raises(StoreError):
                    await granted(store)
                with pytest.raises(StoreError):
                    await store.sweep(now=NOW)
                health = await store.health(1.0)  # /readyz: not ready, with a reason
                assert not health.ready, health
                assert health.reason, health
            relay.resume()  # and it works again by itself
            assert await read_all(store, "s1", media.media_id) == b"kept"
            assert (await store.health(5.0)).ready
        finally:
            await store.close()


@needs_s3
async def test_s3_urls_for_clients_are_signed_for_the_public_url(
    tmp_path: Path, seaweed: Seaweed
) -> None:
    """Replicas reach the store at one address, clients at another (a proxy here)."""
    async with TcpRelay(seaweed.s3_port) as relay:
        public = f"http://127.0.0.1:{relay.port}"
        store = await s3_store(tmp_path, seaweed, public_url=public)
        await store.open()
        try:
            upload_id, ticket = await granted(store, 6)
            direct = await store.direct_upload(upload_id, ticket)
            assert direct is not None
            assert direct.url.startswith(f"{public}/{S3_BUCKET}/")
            assert await put_direct(store, upload_id, ticket, b"public")
            await store.claim_ticket(upload_id, now=NOW)
            info = await store.confirm(upload_id, created_at=NOW, expires_at=None)
            url = await store.download_url(info, expires_in=60)
            assert url is not None
            assert url.startswith(public)
            async with aiohttp.ClientSession() as http, http.get(url) as response:
                assert (response.status, await response.read()) == (200, b"public")
        finally:
            await store.close()


@needs_s3
async def test_s3_two_replicas_claim_one_ticket_once(tmp_path: Path, seaweed: Seaweed) -> None:
    """Two stores on one bucket (two replicas): conditional PUT gives one claim."""
    from portico.media.s3 import S3MediaStore

    first = await s3_store(tmp_path, seaweed)
    second = S3MediaStore(
        bucket=S3_BUCKET,
        prefix=prefix_of(tmp_path),
        endpoint_url=seaweed.endpoint_url,
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        holder="replica-2",
    )
    await first.open()
    await second.open()
    try:
        upload_id, _ = await granted(first)
        results = await asyncio.gather(
            *(store.claim_ticket(upload_id, now=NOW) for store in (first, second) * 4),
            return_exceptions=True,
        )
        assert sum(isinstance(r, UploadTicket) for r in results) == 1
        assert all(isinstance(r, UploadTicket | UploadInProgress) for r in results)
        # A replica's restart releases only its own claims.
        media = await uploaded(first, b"shared")
        winner = first if await first.get_ticket(upload_id) else second
        await winner.release_ticket(upload_id)
        await second.claim_ticket(upload_id, now=NOW)
        await first.close()
        await first.open()
        with pytest.raises(UploadInProgress):
            await first.claim_ticket(upload_id, now=NOW)
        assert await read_all(second, "s1", media.media_id) == b"shared"
    finally:
        await first.close()
        await second.close()


@needs_s3
async def test_s3_a_claim_its_replica_never_released_goes_stale(
    tmp_path: Path, seaweed: Seaweed
) -> None:
    store = await s3_store(tmp_path, seaweed, claim_timeout=100)
    await store.open()
    try:
        upload_id, ticket = await granted(store, expires_at=NOW + 900)
        await store.claim_ticket(upload_id, now=NOW)
        with pytest.raises(UploadInProgress):
            await store.claim_ticket(upload_id, now=NOW + 99)
        assert await store.claim_ticket(upload_id, now=NOW + 100) == ticket
    finally:
        await store.close()


@needs_s3
async def test_s3_a_body_larger_than_a_part_goes_up_in_parts(harness_s3: Harness) -> None:
    store = harness_s3.store
    data = os.urandom(2 * S3_TEST_PART_BYTES + 3)
    ticket = await uploaded(store, data)
    assert await read_all(store, "s1", ticket.media_id) == data


async def test_local_reopen_removes_leftovers_of_a_crash(tmp_path: Path) -> None:
    store = LocalMediaStore(tmp_path / "media")
    await store.open()
    ticket = await uploaded(store, b"kept")
    shard = tmp_path / "media" / "objects" / ticket.media_id[4:6]
    (shard / f".{ticket.media_id}.abc.part").write_bytes(b"partial")
    orphan = new_media_id()
    (tmp_path / "media" / "objects" / "zz").mkdir()
    (tmp_path / "media" / "objects" / "zz" / f"{orphan}.data").write_bytes(b"unrecorded")
    await store.close()
    store = LocalMediaStore(tmp_path / "media")
    await store.open()
    assert await local_stored(tmp_path, None) == sorted(
        f"{ticket.media_id[4:6]}/{ticket.media_id}{suffix}" for suffix in (".data", ".json")
    )
    assert await read_all(store, "s1", ticket.media_id) == b"kept"


async def test_local_tickets_are_filed_under_a_digest(tmp_path: Path) -> None:
    store = LocalMediaStore(tmp_path / "media")
    await store.open()
    upload_id, _ = await granted(store)
    names = [p.name for p in (tmp_path / "media" / "tickets").iterdir()]
    assert len(names) == 1
    assert upload_id not in names[0]
    assert upload_id.encode() not in (tmp_path / "media" / "tickets" / names[0]).read_bytes()


async def test_local_disk_failure_is_a_store_error(tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.write_text("not a directory")
    with pytest.raises(StoreError):
        await LocalMediaStore(root).open()
