"""MediaService: upload grants and their validation, part checks, reads, expiry.

Real parts throughout: a local media store on a temporary directory, the memory
archive, and (for `url` parts) a real HTTP server on loopback. Time is a clock
the test moves.
"""

from __future__ import annotations

import base64
import binascii
import tracemalloc
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from portico.config import Settings
from portico.core.reservations import SessionReservations
from portico.domain.model import MediaContent, Session
from portico.errors import (
    ConfigError,
    InvalidMessage,
    MediaNotEnabled,
    MediaNotFound,
    SessionExpired,
    TooManyUploads,
    UploadFailed,
    UploadGone,
    UploadInProgress,
    UploadNotFound,
    UploadTooLarge,
)
from portico.media.base import parse_storage_ref
from portico.media.local import LocalMediaStore
from portico.media.service import MediaDescription, MediaService, UploadGrant
from portico.server.services import build_media
from portico.store.memory import MemoryStore

START = 1_700_000_000.0
MAX_UPLOAD = 4096
MAX_INLINE = 30
MEDIA_TTL = 3600.0
UPLOAD_TTL = 60.0
BASE = "http://portico.test:8080"


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def archive() -> AsyncIterator[MemoryStore]:
    store = MemoryStore()
    await store.open()
    await store.create_session(
        Session(
            id="bobs", owner="bob", agent="default", created_at=1, updated_at=1, last_activity_at=1
        )
    )
    await store.create_session(
        Session(
            id="alices",
            owner="alice",
            agent="default",
            created_at=1,
            updated_at=1,
            last_activity_at=1,
        )
    )
    yield store
    await store.close()


def build(
    archive: MemoryStore, clock: Clock, tmp_path: Path | None, **overrides: Any
) -> MediaService:
    options: dict[str, Any] = {
        "archive": archive,
        "max_upload_bytes": MAX_UPLOAD,
        "max_inline_media_bytes": MAX_INLINE,
        "media_ttl": MEDIA_TTL,
        "upload_url_ttl": UPLOAD_TTL,
        "clock": clock,
        **overrides,
    }
    store = None if tmp_path is None else LocalMediaStore(tmp_path / "media")
    return MediaService(store, **options)


@pytest.fixture
async def media(archive: MemoryStore, clock: Clock, tmp_path: Path) -> AsyncIterator[MediaService]:
    service = build(archive, clock, tmp_path)
    await service.open()
    yield service
    await service.close()


@pytest.fixture
async def disabled(archive: MemoryStore, clock: Clock) -> AsyncIterator[MediaService]:
    service = build(archive, clock, None)
    await service.open()
    yield service
    await service.close()


async def grant(
    media: MediaService, *, principal: str = "alice", session_id: str = "s1", **fields: Any
) -> UploadGrant:
    request: dict[str, Any] = {
        "filename": "photo.jpg",
        "mime_type": "image/jpeg",
        "size_bytes": 5,
        "base_url": BASE,
        **fields,
    }
    return await media.request_upload(principal=principal, session_id=session_id, **request)


async def body(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def upload(media: MediaService, data: bytes = b"hello", **fields: Any) -> MediaContent:
    granted = await grant(media, size_bytes=len(data), **fields)
    await media.upload(upload_id=granted.upload_id, chunks=body(data), content_length=len(data))
    return MediaContent(mime_type="image/jpeg", storage_ref=granted.storage_ref)


def media_id_of(ref: MediaContent) -> str:
    assert ref.storage_ref is not None
    parsed = parse_storage_ref(ref.storage_ref)
    assert parsed is not None
    return parsed[1]


# -- request_upload -----------------------------------------------------------------


async def test_a_grant_has_the_upload_ready_shape(media: MediaService) -> None:
    granted = await grant(media, session_id="sess-abc")
    assert granted.upload_id.startswith("upl-")
    assert len(granted.upload_id) == 47
    assert granted.upload_url == f"{BASE}/media/upload/{granted.upload_id}"
    parsed = parse_storage_ref(granted.storage_ref)
    assert parsed is not None
    assert parsed[0] == "sess-abc"
    assert granted.method == "PUT"
    assert granted.headers == {"Content-Type": "image/jpeg"}
    expires = datetime.fromisoformat(granted.expires_at.replace("Z", "+00:00"))
    assert granted.expires_at.endswith("Z")
    assert expires.timestamp() == START + UPLOAD_TTL


async def test_upload_ids_are_unguessable_and_distinct(media: MediaService) -> None:
    ids = {(await grant(media)).upload_id for _ in range(20)}
    assert len(ids) == 20


async def test_public_url_is_the_upload_base(
    archive: MemoryStore, clock: Clock, tmp_path: Path
) -> None:
    service = build(archive, clock, tmp_path, public_url="https://chat.example.com/portico/")
    await service.open()
    granted = await grant(service)
    assert granted.upload_url == (
        f"https://chat.example.com/portico/media/upload/{granted.upload_id}"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("session_id", None),
        ("session_id", ""),
        ("session_id", "a/b"),
        ("session_id", "x" * 129),
        ("session_id", 7),
        ("filename", None),
        ("filename", ""),
        ("filename", "dir/photo.jpg"),
        ("filename", "dir\\photo.jpg"),
        ("filename", ".."),
        ("filename", "a\x00b"),
        ("filename", "line\nbreak.txt"),
        ("filename", "del\x7f.txt"),
        ("filename", "é" * 128),  # 256 bytes in UTF-8
        ("filename", 42),
        ("mime_type", None),
        ("mime_type", ""),
        ("mime_type", "image"),
        ("mime_type", "image/"),
        ("mime_type", "/png"),
        ("mime_type", "text/plain; charset=utf-8"),
        ("mime_type", "text/plain\r\nX-Injected: 1"),
        ("mime_type", ["image/png"]),
        ("size_bytes", None),
        ("size_bytes", -1),
        ("size_bytes", "5"),
        ("size_bytes", 1.5),
        ("size_bytes", True),
    ],
)
async def test_each_invalid_field_is_named(media: MediaService, field: str, value: Any) -> None:
    with pytest.raises(InvalidMessage) as caught:
        await grant(media, **{field: value})
    assert caught.value.message.startswith(f"{field}:")
    assert caught.value.code == "INVALID_MESSAGE"


@pytest.mark.parametrize(
    "filename", ["a" * 255, "é" * 127 + "a", "photo (1).jpg", "日本語.png", ".hidden", "x"]
)
async def test_acceptable_filenames(media: MediaService, filename: str) -> None:
    await grant(media, filename=filename)


@pytest.mark.parametrize(
    "mime_type", ["image/png", "audio/mp3", "application/vnd.api+json", "video/x-matroska"]
)
async def test_acceptable_mime_types(media: MediaService, mime_type: str) -> None:
    assert (await grant(media, mime_type=mime_type)).headers["Content-Type"] == mime_type


async def test_sizes_up_to_the_limit_are_granted(media: MediaService) -> None:
    await grant(media, size_bytes=0)
    await grant(media, size_bytes=MAX_UPLOAD)
    with pytest.raises(UploadFailed) as caught:
        await grant(media, size_bytes=MAX_UPLOAD + 1)
    assert isinstance(caught.value, UploadTooLarge)
    assert caught.value.code == "UPLOAD_FAILED"
    assert caught.value.http_status == 413
    assert caught.value.message.startswith("size_bytes:")


async def test_disabled_media_refuses_uploads(disabled: MediaService) -> None:
    assert disabled.enabled is False
    with pytest.raises(MediaNotEnabled) as caught:
        await grant(disabled)
    assert (caught.value.code, caught.value.http_status) == ("MEDIA_NOT_ENABLED", 404)
    with pytest.raises(MediaNotEnabled):
        await disabled.upload(upload_id="upl-x", chunks=body(b""), content_length=0)
    with pytest.raises(MediaNotEnabled):
        await disabled.info(principal="alice", session_id="s1", media_id="med-x")
    assert await disabled.sweep_expired() == 0


async def test_another_principals_session_is_expired(media: MediaService) -> None:
    assert media.enabled is True
    with pytest.raises(SessionExpired) as caught:
        await grant(media, session_id="bobs")
    assert caught.value.code == "SESSION_EXPIRED"


async def test_own_and_unseen_sessions_are_granted(media: MediaService) -> None:
    await grant(media, session_id="alices")
    await grant(media, session_id="never-seen")


# -- upload -------------------------------------------------------------------------


async def test_upload_stores_the_declared_file(media: MediaService, clock: Clock) -> None:
    clock.now += 5
    ref = await upload(media, b"hello", filename="hi.txt", mime_type="text/plain")
    info = await media.info(principal="alice", session_id="s1", media_id=media_id_of(ref))
    assert (info.filename, info.mime_type, info.size_bytes, info.owner) == (
        "hi.txt",
        "text/plain",
        5,
        "alice",
    )
    assert (info.created_at, info.expires_at) == (START + 5, START + 5 + MEDIA_TTL)
    description = MediaDescription.of(info)
    assert description.storage_ref == ref.storage_ref
    assert description.created_at == "2023-11-14T22:13:25.000Z"


async def test_a_content_length_mismatch_is_refused_before_reading(media: MediaService) -> None:
    granted = await grant(media, size_bytes=5)
    with pytest.raises(UploadTooLarge):
        await media.upload(upload_id=granted.upload_id, chunks=body(b"toolong"), content_length=7)
    with pytest.raises(UploadFailed) as caught:
        await media.upload(upload_id=granted.upload_id, chunks=body(b"shor"), content_length=4)
    assert caught.value.http_status == 400
    # Each failure gave the ticket back: the same URL still works.
    await media.upload(upload_id=granted.upload_id, chunks=body(b"right"), content_length=5)
    with pytest.raises(UploadGone):
        await media.upload(upload_id=granted.upload_id, chunks=body(b"right"), content_length=5)


async def test_a_body_without_length_is_bounded_while_streaming(media: MediaService) -> None:
    granted = await grant(media, size_bytes=5)
    with pytest.raises(UploadTooLarge):
        await media.upload(
            upload_id=granted.upload_id, chunks=body(b"toolong"), content_length=None
        )
    await media.upload(upload_id=granted.upload_id, chunks=body(b"right"), content_length=None)


async def test_an_expired_upload_url(media: MediaService, clock: Clock) -> None:
    granted = await grant(media)
    clock.now += UPLOAD_TTL
    with pytest.raises(UploadGone) as caught:
        await media.upload(upload_id=granted.upload_id, chunks=body(b"hello"), content_length=5)
    assert caught.value.http_status == 410


@pytest.mark.parametrize("upload_id", ["upl-unknown", "../../etc/passwd", "upl-" + "A" * 43])
async def test_an_unknown_upload_id(media: MediaService, upload_id: str) -> None:
    with pytest.raises(UploadNotFound):
        await media.upload(upload_id=upload_id, chunks=body(b""), content_length=0)


async def test_a_concurrent_second_upload_is_in_progress(media: MediaService) -> None:
    granted = await grant(media, size_bytes=5)
    second: list[BaseException] = []

    async def first_body() -> AsyncIterator[bytes]:
        yield b"he"
        try:
            await media.upload(upload_id=granted.upload_id, chunks=body(b"hello"), content_length=5)
        except UploadInProgress as exc:
            second.append(exc)
        yield b"llo"

    await media.upload(upload_id=granted.upload_id, chunks=first_body(), content_length=5)
    assert len(second) == 1


# -- info and download ----------------------------------------------------------------


async def test_info_and_download_are_the_owners(media: MediaService) -> None:
    ref = await upload(media, b"hello")
    media_id = media_id_of(ref)
    info, chunks = await media.download(principal="alice", session_id="s1", media_id=media_id)
    assert not isinstance(chunks, str)  # local storage streams the bytes itself
    assert b"".join([chunk async for chunk in chunks]) == b"hello"
    assert info.size_bytes == 5
    for principal, session_id, wanted in [
        ("bob", "s1", media_id),
        ("alice", "s2", media_id),
        ("alice", "s1", "med-" + "0" * 32),
        ("alice", "s1", "../x"),
        ("alice", "bad/session", media_id),
    ]:
        with pytest.raises(MediaNotFound):
            await media.info(principal=principal, session_id=session_id, media_id=wanted)
        with pytest.raises(MediaNotFound):
            await media.download(principal=principal, session_id=session_id, media_id=wanted)


async def test_media_in_a_session_taken_by_another_principal_is_hidden(
    media: MediaService, archive: MemoryStore
) -> None:
    # Uploaded to a session id the archive had not seen, which bob then opened.
    ref = await upload(media, session_id="later-bobs")
    await archive.create_session(
        Session(
            id="later-bobs",
            owner="bob",
            agent="default",
            created_at=2,
            updated_at=2,
            last_activity_at=2,
        )
    )
    with pytest.raises(MediaNotFound):
        await media.info(principal="alice", session_id="later-bobs", media_id=media_id_of(ref))


async def test_expired_media_is_not_found(media: MediaService, clock: Clock) -> None:
    ref = await upload(media)
    clock.now += MEDIA_TTL
    with pytest.raises(MediaNotFound):
        await media.info(principal="alice", session_id="s1", media_id=media_id_of(ref))


# -- check_part ---------------------------------------------------------------------


async def test_an_uploaded_ref_passes(media: MediaService) -> None:
    ref = await upload(media)
    await media.check_part(principal="alice", session_id="s1", media=ref)


async def test_foreign_other_session_missing_and_expired_refs_look_alike(
    media: MediaService, clock: Clock
) -> None:
    ref = await upload(media)
    granted_only = await grant(media)  # granted, never uploaded
    messages = set()
    cases = [
        ("bob", "s1", ref),
        ("alice", "s2", ref),
        ("alice", "s1", MediaContent(mime_type="image/png", storage_ref=granted_only.storage_ref)),
        (
            "alice",
            "s1",
            MediaContent(
                mime_type="image/png", storage_ref="omnia://sessions/s1/media/med-" + "0" * 32
            ),
        ),
    ]
    for principal, session_id, part in cases:
        with pytest.raises(InvalidMessage) as caught:
            await media.check_part(principal=principal, session_id=session_id, media=part)
        messages.add(caught.value.message)
    clock.now += MEDIA_TTL
    with pytest.raises(InvalidMessage) as caught:
        await media.check_part(principal="alice", session_id="s1", media=ref)
    messages.add(caught.value.message)
    assert len(messages) == 1
    assert messages.pop().startswith("storage_ref:")


@pytest.mark.parametrize(
    "ref",
    [
        "med-" + "0" * 32,
        "s3://bucket/key",
        "omnia://sessions/s1/media/../../x",
        "omnia://sessions/s1/media/med-123",
        "omnia://sessions//media/med-" + "0" * 32,
    ],
)
async def test_malformed_refs_are_invalid(media: MediaService, ref: str) -> None:
    with pytest.raises(InvalidMessage, match=r"^storage_ref:"):
        await media.check_part(
            principal="alice", session_id="s1", media=MediaContent(mime_type="a/b", storage_ref=ref)
        )


async def test_a_ref_with_media_disabled(disabled: MediaService) -> None:
    part = MediaContent(mime_type="a/b", storage_ref="omnia://sessions/s1/media/med-" + "0" * 32)
    with pytest.raises(MediaNotEnabled):
        await disabled.check_part(principal="alice", session_id="s1", media=part)


def inline(data: bytes | str) -> MediaContent:
    text = data if isinstance(data, str) else base64.b64encode(data).decode()
    return MediaContent(mime_type="image/png", data=text)


async def test_inline_data_up_to_the_limit(media: MediaService, disabled: MediaService) -> None:
    for service in (media, disabled):  # inline data needs no storage
        await service.check_part(
            principal="alice", session_id="s1", media=inline(b"x" * MAX_INLINE)
        )
        assert await service.read(session_id="s1", media=inline(b"\x00\xff" * 3)) == b"\x00\xff" * 3


@pytest.mark.parametrize(
    "data",
    [
        "not base64!",
        "aGVsbG8",  # missing padding
        "aGVs bG8=",
        "aGVsbG8=\n",
        "aGVsbG8=aGVs",  # padding inside
        "A===",
        "=AAA",
        base64.b64encode(b"x" * (MAX_INLINE + 1)).decode(),
        "A" * 10_000_000,
    ],
)
async def test_bad_or_oversized_inline_data(media: MediaService, data: str) -> None:
    with pytest.raises(InvalidMessage, match=r"^data:"):
        await media.check_part(principal="alice", session_id="s1", media=inline(data))


@settings(max_examples=300)
@given(text=st.text(alphabet="AZaz09+/=- \n", max_size=12))
async def test_inline_data_is_accepted_exactly_when_strict_base64_decodes_it(text: str) -> None:
    service = MediaService(None, archive=MemoryStore())
    # RFC 4648 base64: Python's strict decoder, which also takes excess padding ("AAAA=").
    try:
        base64.b64decode(text, validate=True)
        decodes = len(text) % 4 == 0
    except binascii.Error:
        decodes = False
    try:
        await service.check_part(principal="alice", session_id="s1", media=inline(text))
        accepted = True
    except InvalidMessage:
        accepted = False
    assert accepted == decodes


async def test_an_inline_part_as_large_as_a_frame_carries_is_checked_without_decoding_it() -> None:
    service = MediaService(None, archive=MemoryStore())  # the default limit
    image = bytes(range(256)) * (12 * 1024 * 1024 // 256)
    part = inline(image)
    tracemalloc.start()
    try:
        await service.check_part(principal="alice", session_id="s1", media=part)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(image) // 100  # no decoded copy, not even for a moment
    assert await service.read(session_id="s1", media=part) == image


@pytest.mark.parametrize(
    "url", ["https://example.com/a.png", "http://example.com:8080/x?y=1", "HTTPS://EXAMPLE.COM/"]
)
async def test_http_urls_pass(media: MediaService, url: str) -> None:
    await media.check_part(
        principal="alice", session_id="s1", media=MediaContent(mime_type="a/b", url=url)
    )


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.com/a.png",
        "file:///etc/passwd",
        "javascript:alert(1)",
        "data:image/png;base64,AAAA",
        "http://",
        "example.com/a.png",
        "http://exa mple.com/",
        "http://[::1",
        "https://example.com/" + "a" * 8200,
        "http://127.0.0.1/admin",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/",
        "http://[::ffff:10.0.0.1]/",
    ],
)
async def test_other_urls_are_invalid(media: MediaService, url: str) -> None:
    with pytest.raises(InvalidMessage, match=r"^url:"):
        await media.check_part(
            principal="alice", session_id="s1", media=MediaContent(mime_type="a/b", url=url)
        )


async def test_a_part_without_a_source(media: MediaService) -> None:
    with pytest.raises(InvalidMessage, match=r"^media:"):
        await media.check_part(principal="alice", session_id="s1", media=MediaContent("a/b"))


# -- read ---------------------------------------------------------------------------


async def test_read_a_stored_ref(media: MediaService) -> None:
    data = bytes(range(256)) * 10
    ref = await upload(media, data)
    assert await media.read(session_id="s1", media=ref) == data
    with pytest.raises(InvalidMessage, match=r"^storage_ref:"):
        await media.read(session_id="s2", media=ref)


@pytest.fixture
async def origin() -> AsyncIterator[str]:
    """A real HTTP server on loopback for `url` parts."""

    async def file(request: web.Request) -> web.Response:
        return web.Response(body=b"remote bytes", content_type="image/png")

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * (MAX_UPLOAD + 1))

    async def missing(request: web.Request) -> web.Response:
        return web.Response(status=404)

    async def hop(request: web.Request) -> web.Response:
        raise web.HTTPFound("/file")

    async def loop(request: web.Request) -> web.Response:
        raise web.HTTPFound("/loop")

    app = web.Application()
    app.router.add_get("/file", file)
    app.router.add_get("/big", big)
    app.router.add_get("/missing", missing)
    app.router.add_get("/hop", hop)
    app.router.add_get("/loop", loop)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()


@pytest.fixture
async def fetching(
    archive: MemoryStore, clock: Clock, tmp_path: Path
) -> AsyncIterator[MediaService]:
    """A service allowed to fetch from loopback, where the test origin is."""
    service = build(archive, clock, tmp_path, fetch_private=True, fetch_timeout=5.0)
    await service.open()
    yield service
    await service.close()


def at(url: str) -> MediaContent:
    return MediaContent(mime_type="image/png", url=url)


async def test_read_a_url(fetching: MediaService, origin: str) -> None:
    assert await fetching.read(session_id="s1", media=at(f"{origin}/file")) == b"remote bytes"
    assert await fetching.read(session_id="s1", media=at(f"{origin}/hop")) == b"remote bytes"


@pytest.mark.parametrize(
    ("path", "reason"),
    [("/big", "larger than"), ("/missing", "HTTP 404"), ("/loop", "redirects")],
)
async def test_read_a_url_that_fails(
    fetching: MediaService, origin: str, path: str, reason: str
) -> None:
    with pytest.raises(InvalidMessage, match=reason):
        await fetching.read(session_id="s1", media=at(origin + path))


async def test_urls_cannot_reach_private_addresses_by_default(
    media: MediaService, origin: str
) -> None:
    port = origin.rsplit(":", 1)[1]
    with pytest.raises(InvalidMessage, match=r"^url:"):
        await media.read(session_id="s1", media=at(f"{origin}/file"))
    # A name resolving to loopback is refused at connect time, not only literal addresses.
    with pytest.raises(InvalidMessage, match=r"^url: cannot fetch"):
        await media.read(session_id="s1", media=at(f"http://localhost:{port}/file"))


# -- sweep --------------------------------------------------------------------------


async def test_sweep_expired(media: MediaService, clock: Clock) -> None:
    ref = await upload(media)
    late = await grant(media)  # an upload URL never used
    assert await media.sweep_expired() == 0
    clock.now += UPLOAD_TTL
    # Kept one more upload_url_ttl, so a late upload hears "expired", not "unknown".
    assert await media.sweep_expired() == 0
    with pytest.raises(UploadGone):
        await media.upload(upload_id=late.upload_id, chunks=body(b"hello"), content_length=5)
    clock.now += UPLOAD_TTL
    assert await media.sweep_expired() == 1
    with pytest.raises(UploadNotFound):
        await media.upload(upload_id=late.upload_id, chunks=body(b"hello"), content_length=5)
    clock.now = START + MEDIA_TTL
    assert await media.sweep_expired() == 1
    with pytest.raises(InvalidMessage):
        await media.read(session_id="s1", media=ref)


# -- settings -----------------------------------------------------------------------


async def test_media_is_built_from_the_settings(tmp_path: Path) -> None:
    archive = MemoryStore()
    assert build_media(Settings(media="none", data_dir=str(tmp_path)), archive).enabled is False
    local = build_media(Settings(media="local", data_dir=str(tmp_path)), archive)
    assert local.enabled is True
    await local.open()
    assert (tmp_path / "media" / "tickets").is_dir()
    await local.close()


def test_media_s3_builds_the_s3_store(tmp_path: Path) -> None:
    """Never silently `none` or local: a replica set configured for s3 shares its bucket."""
    pytest.importorskip("aiobotocore")
    from portico.media.s3 import S3MediaStore

    media = build_media(Settings(media="s3", data_dir=str(tmp_path)), MemoryStore())
    assert media.enabled is True
    assert isinstance(media._store, S3MediaStore)
    assert not (tmp_path / "media").exists()


@pytest.mark.parametrize("public_url", ["chat.example.com", "ftp://chat.example.com"])
def test_public_url_must_be_http(public_url: str) -> None:
    with pytest.raises(ConfigError, match="public_url"):
        Settings(public_url=public_url).check_startable()
    Settings(public_url="https://chat.example.com/portico").check_startable()


async def test_pending_upload_urls_are_capped_per_principal(
    archive: MemoryStore, clock: Clock, tmp_path: Path
) -> None:
    media = build(archive, clock, tmp_path, max_pending_uploads=2)
    await media.open()
    try:
        first = await grant(media)
        await grant(media)
        with pytest.raises(TooManyUploads):
            await grant(media)
        await grant(media, principal="bob", session_id="s2")  # bob has his own quota
        # A used URL frees its place; so does an expired one.
        await media.upload(upload_id=first.upload_id, chunks=body(b"hello"), content_length=5)
        await grant(media)
        with pytest.raises(TooManyUploads):
            await grant(media)
        clock.now += UPLOAD_TTL + 1
        await grant(media)
    finally:
        await media.close()


async def test_a_reserved_session_refuses_other_principals_uploads(
    archive: MemoryStore, clock: Clock, tmp_path: Path
) -> None:
    reservations = SessionReservations()
    reservations.reserve("fresh", "alice")
    media = build(archive, clock, tmp_path, reservations=reservations)
    await media.open()
    try:
        with pytest.raises(SessionExpired):
            await grant(media, principal="bob", session_id="fresh")
        await grant(media, principal="alice", session_id="fresh")
    finally:
        await media.close()
