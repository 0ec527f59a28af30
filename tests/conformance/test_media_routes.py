"""Black-box conformance of the HTTP media routes against real `portico serve` processes.

Servers: `media_server` (API keys for alice and bob, an 8 MiB upload limit),
once on local storage and once on `media: s3` (SeaweedFS), `short_media_server`
(upload URLs and media that expire within a second, a fast sweeper, a
`public_url`), `media_off_server` (`media: none`).

The tests upload as a client does: the body goes to the grant's `upload_url`;
when that URL is not Portico's own `/media/upload/{id}` (a presigned S3 URL),
the client then calls `POST /media/confirm-upload/{id}`, whose answer ends the
upload. Tests about Portico receiving a body itself take `receiving_server`.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import aiohttp
import pytest

from support.conformance import ALICE, BOB
from support.omnia import OmniaClient, scenario
from support.seaweed import ACCESS_KEY, SECRET_KEY, Seaweed
from support.server import SCRIPT, ServerProcess

MiB = 1024 * 1024
MAX_UPLOAD = 8 * MiB
SHORT_UPLOAD_URL_TTL = 0.4
SHORT_MEDIA_TTL = 0.8
SHORT_SWEEP_INTERVAL = 0.2
PUBLIC_URL = "https://chat.example.com/portico"
SHORT_BUCKET = "portico-short"
GRANT_KEYS = {"upload_id", "upload_url", "storage_ref", "expires_at", "method", "headers"}
API_KEYS = f"{ALICE}=alice,{BOB}=bob"
# What ends a successful upload: Portico's PUT (204), or confirm-upload (200, the info).
UPLOAD_DONE = (200, 204)
needs_s3 = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("aiobotocore"), reason="needs portico[s3]"
)


def _start(data_dir: Path, **settings: str) -> ServerProcess:
    env = {"PORTICO_AUTH": "apikey", "PORTICO_API_KEYS": API_KEYS, "PORTICO_RUNTIME": "echo"}
    env.update({f"PORTICO_{name.upper()}": value for name, value in settings.items()})
    return ServerProcess(data_dir, env=env).start()


def s3_settings(seaweed: Seaweed, bucket: str) -> dict[str, str]:
    return {
        "media": "s3",
        "s3_endpoint_url": seaweed.endpoint_url,
        "s3_bucket": bucket,
        "s3_access_key_id": ACCESS_KEY,
        "s3_secret_access_key": SECRET_KEY,
    }


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    server = Seaweed(tmp_path_factory.mktemp("seaweed"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session", params=["local", pytest.param("s3", marks=needs_s3)])
def media_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    backend = {}
    if request.param == "s3":
        backend = s3_settings(request.getfixturevalue("seaweed"), "portico-routes")
    process = _start(
        tmp_path_factory.mktemp("portico-media"), max_upload_bytes=str(MAX_UPLOAD), **backend
    )
    yield process
    process.stop()


def on_s3(server: ServerProcess) -> bool:
    return server.env.get("PORTICO_MEDIA") == "s3"


@pytest.fixture
def receiving_server(media_server: ServerProcess) -> ServerProcess:
    """`media_server` where upload bodies come to Portico (local storage)."""
    if on_s3(media_server):
        pytest.skip("with media: s3 the body goes to the bucket (tests below: confirm-upload)")
    return media_server


@pytest.fixture
def s3_media_server(media_server: ServerProcess) -> ServerProcess:
    if not on_s3(media_server):
        pytest.skip("confirm-upload checks a body that went to object storage")
    return media_server


@pytest.fixture(scope="session", params=["local", pytest.param("s3", marks=needs_s3)])
def short_media_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    backend = {}
    if request.param == "s3":
        backend = s3_settings(request.getfixturevalue("seaweed"), SHORT_BUCKET)
    process = _start(
        tmp_path_factory.mktemp("portico-media-short"),
        upload_url_ttl=str(SHORT_UPLOAD_URL_TTL),
        media_ttl=str(SHORT_MEDIA_TTL),
        media_sweep_interval=str(SHORT_SWEEP_INTERVAL),
        public_url=PUBLIC_URL,
        **backend,
    )
    yield process
    process.stop()


@pytest.fixture(scope="session")
def media_off_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = _start(tmp_path_factory.mktemp("portico-media-off"), media="none")
    yield process
    process.stop()


# -- helpers ------------------------------------------------------------------------


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def new_session() -> str:
    return f"sess-{uuid.uuid4().hex}"


def ids_of(storage_ref: str) -> tuple[str, str]:
    prefix, session_id, media, media_id = storage_ref.rsplit("/", 3)
    assert (prefix, media) == ("omnia://sessions", "media"), storage_ref
    return session_id, media_id


async def error_of(response: aiohttp.ClientResponse) -> tuple[int, str, str]:
    assert response.content_type == "application/json", await response.text()
    body = await response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) >= {"code", "message"}, body
    return response.status, body["error"]["code"], body["error"]["message"]


async def request_upload(
    http: aiohttp.ClientSession,
    server: ServerProcess,
    *,
    token: str | None = ALICE,
    json: Any = None,
    **fields: Any,
) -> aiohttp.ClientResponse:
    body = (
        json
        if json is not None
        else {
            "session_id": new_session(),
            "filename": "photo.jpg",
            "mime_type": "image/jpeg",
            "size_bytes": 5,
            **fields,
        }
    )
    headers = bearer(token) if token else {}
    return await http.post(f"{server.http_url}/media/request-upload", json=body, headers=headers)


async def grant(
    http: aiohttp.ClientSession, server: ServerProcess, **fields: Any
) -> dict[str, Any]:
    response = await request_upload(http, server, **fields)
    assert response.status == 200, await response.text()
    granted: dict[str, Any] = await response.json()
    return granted


def upload_url(server: ServerProcess, granted: dict[str, Any]) -> str:
    """The grant's URL, pointed at this process (a `public_url` names a proxy)."""
    return f"{server.http_url}/media/upload/{granted['upload_id']}"


def is_direct(granted: dict[str, Any]) -> bool:
    """The client's rule: a URL that is not Portico's `/media/upload/{id}` needs a confirm."""
    path = urlsplit(granted["upload_url"]).path
    return not path.endswith(f"/media/upload/{granted['upload_id']}")


async def confirm(
    http: aiohttp.ClientSession, server: ServerProcess, granted: dict[str, Any]
) -> aiohttp.ClientResponse:
    return await http.post(f"{server.http_url}/media/confirm-upload/{granted['upload_id']}")


async def put(
    http: aiohttp.ClientSession, server: ServerProcess, granted: dict[str, Any], data: Any
) -> aiohttp.ClientResponse:
    """Send the body as a client does; the response that ends the upload."""
    # Only the headers the grant lists: the upload URL is the credential.
    if not is_direct(granted):
        return await http.put(upload_url(server, granted), data=data, headers=granted["headers"])
    async with http.put(granted["upload_url"], data=data, headers=granted["headers"]) as sent:
        await sent.read()  # a refusal of the store's own shows in the confirm's answer
    return await confirm(http, server, granted)


async def uploaded(
    http: aiohttp.ClientSession, server: ServerProcess, data: bytes, **fields: Any
) -> dict[str, Any]:
    granted = await grant(http, server, size_bytes=len(data), **fields)
    response = await put(http, server, granted, data)
    assert response.status in UPLOAD_DONE, await response.text()
    return granted


async def info(
    http: aiohttp.ClientSession, server: ServerProcess, storage_ref: str, token: str | None = ALICE
) -> aiohttp.ClientResponse:
    session_id, media_id = ids_of(storage_ref)
    headers = bearer(token) if token else {}
    return await http.get(f"{server.http_url}/media/info/{session_id}/{media_id}", headers=headers)


async def download(
    http: aiohttp.ClientSession, server: ServerProcess, storage_ref: str, token: str | None = ALICE
) -> aiohttp.ClientResponse:
    session_id, media_id = ids_of(storage_ref)
    headers = bearer(token) if token else {}
    url = f"{server.http_url}/media/download/{session_id}/{media_id}"
    response = await http.get(url, headers=headers, allow_redirects=False)
    if response.status != 307:
        return response
    # Object storage serves the bytes at a presigned URL: it alone is the credential.
    assert response.headers["Cache-Control"] == "private, no-store"
    return await http.get(response.headers["Location"])


async def archived_session(http: aiohttp.ClientSession, server: ServerProcess, token: str) -> str:
    """A session the archive attributes to `token`'s principal (opened over /ws)."""
    ws = await http.ws_connect(server.ws_url, headers=bearer(token))
    client = OmniaClient(ws)
    session_id: str = (await client.connected())["session_id"]
    frames = await client.ask("hello")
    assert frames[-1]["type"] == "done", frames
    await ws.close()
    return session_id


def parse_time(text: str) -> float:
    assert text.endswith("Z"), text
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def stored_files(server: ServerProcess) -> list[Path]:
    assert not on_s3(server)
    return [p for p in (server.data_dir / "media" / "objects").rglob("*") if p.is_file()]


# -- the happy path -----------------------------------------------------------------


async def test_request_upload_download(
    http: aiohttp.ClientSession, media_server: ServerProcess
) -> None:
    session_id = new_session()
    data = os.urandom(100_000)
    response = await request_upload(
        http,
        media_server,
        session_id=session_id,
        filename="holiday photo.jpg",
        mime_type="image/jpeg",
        size_bytes=len(data),
    )
    assert response.status == 200
    granted = await response.json()
    assert set(granted) == GRANT_KEYS
    own_url = f"{media_server.http_url}/media/upload/{granted['upload_id']}"
    assert (granted["upload_url"] == own_url) is not on_s3(media_server)
    assert is_direct(granted) is on_s3(media_server)
    assert granted["method"] == "PUT"
    assert granted["headers"] == {"Content-Type": "image/jpeg"}
    assert granted["expires_at"].endswith("Z")
    assert ids_of(granted["storage_ref"])[0] == session_id

    started = time.time()
    response = await http.put(granted["upload_url"], data=data, headers=granted["headers"])
    if on_s3(media_server):
        assert response.status == 200  # the store's answer; not stored until confirmed
        assert (await info(http, media_server, granted["storage_ref"])).status == 404
        response = await confirm(http, media_server, granted)
        assert response.status == 200, await response.text()
        confirmed = await response.json()
    else:
        assert response.status == 204
        assert await response.read() == b""

    response = await info(http, media_server, granted["storage_ref"])
    assert response.status == 200
    described = await response.json()
    if on_s3(media_server):
        assert confirmed == described  # confirm-upload answers the media info
    assert set(described) == {
        "storage_ref",
        "filename",
        "mime_type",
        "size_bytes",
        "created_at",
        "expires_at",
    }
    assert described["storage_ref"] == granted["storage_ref"]
    assert (described["filename"], described["mime_type"], described["size_bytes"]) == (
        "holiday photo.jpg",
        "image/jpeg",
        len(data),
    )
    created, expires = (parse_time(described[key]) for key in ("created_at", "expires_at"))
    assert started - 1 <= created <= time.time() + 1
    assert expires - created == pytest.approx(86400.0)  # the default media_ttl

    session_id, media_id = ids_of(granted["storage_ref"])
    url = f"{media_server.http_url}/media/download/{session_id}/{media_id}"
    async with http.get(url, headers=bearer(ALICE), allow_redirects=False) as response:
        # Object storage serves the bytes itself (spec/replicas.md), local storage streams.
        assert response.status == (307 if on_s3(media_server) else 200)
    response = await download(http, media_server, granted["storage_ref"])
    assert response.status == 200
    assert await response.read() == data
    assert response.headers["Content-Type"] == "image/jpeg"
    assert response.headers["Content-Length"] == str(len(data))
    assert response.headers["Content-Disposition"] == (
        "attachment; filename=\"holiday photo.jpg\"; filename*=UTF-8''holiday%20photo.jpg"
    )
    if not on_s3(media_server):  # a bucket's own headers: its CORS and policy settings
        assert response.headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize(
    "filename", ['na"me;x=1.txt', "résumé 日本.pdf", "semi;colon,comma 100%.bin", "a'b.txt"]
)
async def test_download_names_the_file_safely(
    http: aiohttp.ClientSession, media_server: ServerProcess, filename: str
) -> None:
    granted = await uploaded(http, media_server, b"abc", filename=filename, mime_type="text/plain")
    response = await download(http, media_server, granted["storage_ref"])
    disposition = response.headers["Content-Disposition"]
    fallback, encoded = disposition.split("; filename*=UTF-8''")
    assert fallback.startswith('attachment; filename="')
    assert fallback.count('"') == 2
    assert fallback.isascii()
    assert unquote(encoded) == filename
    assert all(c.isalnum() or c in "%-._~" for c in encoded)


async def test_a_large_upload_streams(
    http: aiohttp.ClientSession, media_server: ServerProcess
) -> None:
    data = os.urandom(5 * MiB)  # above aiohttp's 1 MiB client_max_size
    granted = await uploaded(http, media_server, data, mime_type="application/octet-stream")
    response = await download(http, media_server, granted["storage_ref"])
    assert response.status == 200
    assert await response.read() == data


async def test_a_chunked_upload_without_content_length(
    http: aiohttp.ClientSession, receiving_server: ServerProcess
) -> None:
    data = os.urandom(2 * MiB + 3)
    granted = await grant(http, receiving_server, size_bytes=len(data))

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(data), 100_000):
            yield data[start : start + 100_000]

    response = await put(http, receiving_server, granted, pieces())
    assert response.status == 204, await response.text()
    assert await (await download(http, receiving_server, granted["storage_ref"])).read() == data


async def test_an_empty_file(http: aiohttp.ClientSession, media_server: ServerProcess) -> None:
    granted = await uploaded(http, media_server, b"", mime_type="text/plain")
    response = await download(http, media_server, granted["storage_ref"])
    assert (response.status, await response.read()) == (200, b"")


# -- request-upload validation -------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"session_id": None}, "session_id"),
        ({"session_id": ""}, "session_id"),
        ({"session_id": "a/b"}, "session_id"),
        ({"session_id": "s" * 129}, "session_id"),
        ({"filename": None}, "filename"),
        ({"filename": ""}, "filename"),
        ({"filename": "../../etc/passwd"}, "filename"),
        ({"filename": "a\\b.txt"}, "filename"),
        ({"filename": "bell\x07.txt"}, "filename"),
        ({"filename": "x" * 256}, "filename"),
        ({"filename": 3}, "filename"),
        ({"mime_type": None}, "mime_type"),
        ({"mime_type": "jpeg"}, "mime_type"),
        ({"mime_type": "image/jpeg\r\nSet-Cookie: a=b"}, "mime_type"),
        ({"size_bytes": None}, "size_bytes"),
        ({"size_bytes": -1}, "size_bytes"),
        ({"size_bytes": "5"}, "size_bytes"),
        ({"size_bytes": 2.5}, "size_bytes"),
        ({"size_bytes": False}, "size_bytes"),
    ],
)
async def test_invalid_fields_are_named(
    http: aiohttp.ClientSession, media_server: ServerProcess, fields: dict[str, Any], field: str
) -> None:
    body = {
        "session_id": new_session(),
        "filename": "photo.jpg",
        "mime_type": "image/jpeg",
        "size_bytes": 5,
        **fields,
    }
    if fields[field] is None:
        del body[field]  # absent, as a client that forgot it sends it
    status, code, message = await error_of(await request_upload(http, media_server, json=body))
    assert (status, code) == (400, "INVALID_MESSAGE")
    assert message.startswith(f"{field}:")


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'"text"', b"{", b"null"])
async def test_a_body_that_is_not_an_object(
    http: aiohttp.ClientSession, media_server: ServerProcess, raw: bytes
) -> None:
    response = await http.post(
        f"{media_server.http_url}/media/request-upload", data=raw, headers=bearer(ALICE)
    )
    assert await error_of(response) == (400, "INVALID_MESSAGE", "the body must be a JSON object")


async def test_a_size_above_the_limit(
    http: aiohttp.ClientSession, media_server: ServerProcess
) -> None:
    response = await request_upload(http, media_server, size_bytes=MAX_UPLOAD + 1)
    status, code, message = await error_of(response)
    assert (status, code) == (413, "UPLOAD_FAILED")
    assert message.startswith("size_bytes:")
    assert str(MAX_UPLOAD) in message
    assert (await request_upload(http, media_server, size_bytes=MAX_UPLOAD)).status == 200


async def test_an_oversized_request_body(
    http: aiohttp.ClientSession, media_server: ServerProcess
) -> None:
    body = {"session_id": new_session(), "filename": "a", "padding": "x" * 20_000}
    status, code, _ = await error_of(await request_upload(http, media_server, json=body))
    assert (status, code) == (413, "INVALID_MESSAGE")


# -- upload failures ----------------------------------------------------------------


async def test_a_body_longer_than_declared(
    http: aiohttp.ClientSession, receiving_server: ServerProcess
) -> None:
    granted = await grant(http, receiving_server, size_bytes=10)
    status, code, _ = await error_of(await put(http, receiving_server, granted, b"x" * 20))
    assert (status, code) == (413, "UPLOAD_FAILED")
    assert (await download(http, receiving_server, granted["storage_ref"])).status == 404
    assert (await info(http, receiving_server, granted["storage_ref"])).status == 404


async def test_a_chunked_body_longer_than_declared(
    http: aiohttp.ClientSession, receiving_server: ServerProcess
) -> None:
    granted = await grant(http, receiving_server, size_bytes=300_000)

    async def too_much() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"x" * 100_000

    status, code, _ = await error_of(await put(http, receiving_server, granted, too_much()))
    assert (status, code) == (413, "UPLOAD_FAILED")
    assert (await download(http, receiving_server, granted["storage_ref"])).status == 404


async def test_a_body_shorter_than_declared(
    http: aiohttp.ClientSession, receiving_server: ServerProcess
) -> None:
    granted = await grant(http, receiving_server, size_bytes=10)
    status, code, _ = await error_of(await put(http, receiving_server, granted, b"x" * 9))
    assert (status, code) == (400, "UPLOAD_FAILED")
    assert (await download(http, receiving_server, granted["storage_ref"])).status == 404
    # A failed attempt does not spend the URL.
    assert (await put(http, receiving_server, granted, b"y" * 10)).status == 204


async def test_a_second_put_is_refused(
    http: aiohttp.ClientSession, media_server: ServerProcess
) -> None:
    granted = await uploaded(http, media_server, b"first")
    status, code, _ = await error_of(await put(http, media_server, granted, b"again"))
    assert (status, code) == (410, "UPLOAD_FAILED")
    assert await (await download(http, media_server, granted["storage_ref"])).read() == b"first"


@pytest.mark.parametrize(
    "upload_id", ["upl-" + "A" * 43, "upl-short", "..%2F..%2Fetc%2Fpasswd", "x" * 300]
)
async def test_an_unknown_upload_id(
    http: aiohttp.ClientSession, media_server: ServerProcess, upload_id: str
) -> None:
    response = await http.put(f"{media_server.http_url}/media/upload/{upload_id}", data=b"abc")
    status, code, _ = await error_of(response)
    assert (status, code) == (404, "UPLOAD_FAILED")


async def test_a_client_that_goes_away_mid_upload(
    http: aiohttp.ClientSession, receiving_server: ServerProcess
) -> None:
    granted = await grant(http, receiving_server, size_bytes=1_000_000)
    _reader, writer = await asyncio.open_connection("127.0.0.1", receiving_server.port)
    writer.write(
        (
            f"PUT /media/upload/{granted['upload_id']} HTTP/1.1\r\n"
            f"Host: 127.0.0.1\r\nContent-Length: 1000000\r\n\r\n"
        ).encode()
        + b"x" * 400_000
    )
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    # Nothing stored; once the server has noticed, the same URL works again.
    deadline = time.monotonic() + 5
    while True:
        response = await put(http, receiving_server, granted, b"z" * 1_000_000)
        if response.status != 409 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert response.status == 204, await response.text()
    assert await (await download(http, receiving_server, granted["storage_ref"])).read() == (
        b"z" * 1_000_000
    )


# -- confirm-upload (media: s3) --------------------------------------------------------


async def s3_client(seaweed: Seaweed) -> Any:
    from aiobotocore.session import get_session

    return get_session().create_client(
        "s3",
        endpoint_url=seaweed.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )


async def bucket_keys(seaweed: Seaweed, bucket: str, prefix: str) -> list[str]:
    async with await s3_client(seaweed) as s3:
        page = await s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
        return [item["Key"] for item in page.get("Contents", [])]


async def test_confirm_before_the_body_arrived(
    http: aiohttp.ClientSession, s3_media_server: ServerProcess
) -> None:
    granted = await grant(http, s3_media_server, size_bytes=5)
    status, code, message = await error_of(await confirm(http, s3_media_server, granted))
    assert (status, code) == (400, "UPLOAD_FAILED")
    assert "nothing was uploaded" in message
    assert (await put(http, s3_media_server, granted, b"hello")).status == 200  # still usable


async def test_a_body_the_store_refuses_for_its_size_is_not_confirmed(
    http: aiohttp.ClientSession, s3_media_server: ServerProcess
) -> None:
    granted = await grant(http, s3_media_server, size_bytes=10)
    async with http.put(granted["upload_url"], data=b"x" * 20, headers=granted["headers"]) as r:
        assert r.status == 403  # SigV4 signs Content-Length: the store itself refuses
    assert (await error_of(await confirm(http, s3_media_server, granted)))[:2] == (
        400,
        "UPLOAD_FAILED",
    )
    assert (await info(http, s3_media_server, granted["storage_ref"])).status == 404


async def test_an_oversize_body_the_store_took_is_refused_at_confirm(
    http: aiohttp.ClientSession, s3_media_server: ServerProcess, seaweed: Seaweed
) -> None:
    """As a store that does not check the signed size would take it: confirm HEADs."""
    from portico.media.base import upload_key

    granted = await grant(http, s3_media_server, size_bytes=10)
    staged = f"uploads/{upload_key(granted['upload_id'])}"
    async with await s3_client(seaweed) as s3:
        await s3.put_object(
            Bucket="portico-routes", Key=staged, Body=b"x" * 11, ContentType="image/jpeg"
        )
    status, code, message = await error_of(await confirm(http, s3_media_server, granted))
    assert (status, code) == (413, "UPLOAD_FAILED")  # as Portico's own PUT answers it
    assert "longer than the declared 10" in message
    assert (await info(http, s3_media_server, granted["storage_ref"])).status == 404
    media_id = ids_of(granted["storage_ref"])[1]
    assert await bucket_keys(seaweed, "portico-routes", staged) == []
    assert await bucket_keys(seaweed, "portico-routes", f"objects/{media_id}") == []
    # The URL stays usable for the right body.
    assert (await put(http, s3_media_server, granted, b"y" * 10)).status == 200


@pytest.mark.parametrize("upload_id", ["upl-" + "A" * 43, "upl-short", "x" * 300])
async def test_confirming_an_unknown_upload(
    http: aiohttp.ClientSession, media_server: ServerProcess, upload_id: str
) -> None:
    response = await http.post(f"{media_server.http_url}/media/confirm-upload/{upload_id}")
    assert (await error_of(response))[:2] == (404, "UPLOAD_FAILED")


async def test_local_storage_has_nothing_to_confirm(
    http: aiohttp.ClientSession, receiving_server: ServerProcess
) -> None:
    granted = await grant(http, receiving_server, size_bytes=5)
    status, code, message = await error_of(await confirm(http, receiving_server, granted))
    assert (status, code) == (400, "UPLOAD_FAILED")
    assert "nothing to confirm" in message
    assert (await put(http, receiving_server, granted, b"hello")).status == 204
    assert (await error_of(await confirm(http, receiving_server, granted)))[:2] == (
        410,
        "UPLOAD_FAILED",
    )


@needs_s3
async def test_replicas_on_one_bucket_serve_each_others_media(
    http: aiohttp.ClientSession, tmp_path: Path, seaweed: Seaweed
) -> None:
    """Granted on one replica, confirmed and read on another (separate archives)."""
    settings = s3_settings(seaweed, "portico-replicas")
    first = _start(tmp_path / "first", **settings)
    second = _start(tmp_path / "second", **settings)
    try:
        granted = await grant(http, first, size_bytes=6)
        async with http.put(granted["upload_url"], data=b"shared", headers=granted["headers"]):
            pass
        assert (await confirm(http, second, granted)).status == 200
        for server in (first, second):
            assert (await info(http, server, granted["storage_ref"])).status == 200
            response = await download(http, server, granted["storage_ref"])
            assert (response.status, await response.read()) == (200, b"shared")
        assert (await error_of(await confirm(http, first, granted)))[:2] == (410, "UPLOAD_FAILED")
        assert (await info(http, second, granted["storage_ref"], BOB)).status == 404
    finally:
        first.stop()
        second.stop()


@needs_s3
async def test_a_ws_upload_goes_to_the_bucket_and_the_agent_reads_it(
    http: aiohttp.ClientSession, tmp_path: Path, seaweed: Seaweed
) -> None:
    """`/ws` `upload_ready` names the presigned URL; after the confirm, a message part
    with the `storage_ref` reaches the runtime through the S3 store."""
    settings = {**s3_settings(seaweed, "portico-routes"), "runtime": "scripted"}
    server = _start(tmp_path / "portico", script=str(SCRIPT), **settings)
    try:
        ws = await http.ws_connect(server.ws_url, headers=bearer(ALICE))
        client = OmniaClient(ws)
        await client.connected()
        data = b"\x89PNG\r\n\x1a\n" + os.urandom(2000)
        request = {"filename": "photo.png", "mime_type": "image/png", "size_bytes": len(data)}
        await client.send({"type": "upload_request", "upload_request": request})
        ready = await client.recv()
        assert ready["type"] == "upload_ready", ready
        granted = ready["upload_ready"]
        assert is_direct(granted)
        assert (await put(http, server, granted, data)).status == 200
        media = {"storage_ref": granted["storage_ref"], "mime_type": "image/png"}
        part = {"type": "image", "media": media}
        await client.send({"type": "message", "parts": [part], **scenario("media_info")})
        frames = await client.turn()
        assert frames[0]["content"].startswith(f"image image/png {len(data)} bytes"), frames
        assert frames[-1]["type"] == "done"
        await ws.close()
    finally:
        server.stop()


@needs_s3
async def test_object_storage_down_is_a_defined_error_and_service_resumes(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    store = Seaweed(tmp_path / "seaweed")
    store.directory.mkdir()
    store.start()
    async with await s3_client(store) as s3:
        # SeaweedFS gives a new bucket its volumes on the first write, which takes longer
        # than a deadline may allow: done here, before the server's first call.
        await s3.create_bucket(Bucket="portico-down")
        await s3.put_object(Bucket="portico-down", Key="warm", Body=b"")
    server = _start(tmp_path / "portico", s3_timeout="5", **s3_settings(store, "portico-down"))
    try:
        kept = await uploaded(http, server, b"kept")
        pending = await grant(http, server, size_bytes=5)
        async with http.put(pending["upload_url"], data=b"after", headers=pending["headers"]):
            pass  # sent to the bucket; its confirm comes while the store is down
        store.stop()
        async with asyncio.timeout(60):  # far above the deadlines: a hang fails here
            for response in (
                await request_upload(http, server),
                await info(http, server, kept["storage_ref"]),
                await download(http, server, kept["storage_ref"]),
                await confirm(http, server, pending),
            ):
                assert (await error_of(response))[:2] == (503, "INTERNAL_ERROR")
        store.start()  # the same port: service resumes by itself, once the store has
        deadline = time.monotonic() + 30  # found its volumes again
        while (response := await download(http, server, kept["storage_ref"])).status == 503:
            assert time.monotonic() < deadline, "media did not come back with the store"
            await asyncio.sleep(0.2)
        assert (response.status, await response.read()) == (200, b"kept")
        # The failed confirm kept the body: confirming again is enough.
        assert (await confirm(http, server, pending)).status == 200
        response = await download(http, server, pending["storage_ref"])
        assert (response.status, await response.read()) == (200, b"after")
    finally:
        server.stop()
        store.stop()


async def test_the_python_client_uploads_and_downloads(
    http: aiohttp.ClientSession, media_server: ServerProcess
) -> None:
    """`portico.client.media` confirms exactly when the upload URL is object storage's."""
    from portico.client.media import MediaError, download_media, upload_media

    data = os.urandom(3000)
    session_id = new_session()
    media = await upload_media(
        http,
        media_server.http_url,
        data,
        session_id=session_id,
        filename="notes.bin",
        mime_type="application/octet-stream",
        token=ALICE,
    )
    assert ids_of(media["storage_ref"])[0] == session_id
    assert (await info(http, media_server, media["storage_ref"])).status == 200
    _, media_id = ids_of(media["storage_ref"])
    assert await download_media(http, media_server.http_url, session_id, media_id, token=ALICE) == (
        data
    )
    with pytest.raises(MediaError) as refused:
        await download_media(http, media_server.http_url, session_id, media_id, token=BOB)
    assert (refused.value.status, refused.value.code) == (404, "MEDIA_NOT_FOUND")


# -- expiry -------------------------------------------------------------------------


async def test_an_expired_upload_url(
    http: aiohttp.ClientSession, short_media_server: ServerProcess
) -> None:
    granted = await grant(http, short_media_server)
    await asyncio.sleep(SHORT_UPLOAD_URL_TTL + 0.05)
    status, code, message = await error_of(await put(http, short_media_server, granted, b"hello"))
    assert (status, code) == (410, "UPLOAD_FAILED")
    assert "expired" in message


async def test_media_expires_and_is_swept(
    http: aiohttp.ClientSession, short_media_server: ServerProcess
) -> None:
    granted = await uploaded(http, short_media_server, b"short-lived")
    media_id = ids_of(granted["storage_ref"])[1]
    assert (await info(http, short_media_server, granted["storage_ref"])).status == 200
    await asyncio.sleep(SHORT_MEDIA_TTL)
    assert (await info(http, short_media_server, granted["storage_ref"])).status == 404
    assert (await download(http, short_media_server, granted["storage_ref"])).status == 404
    deadline = time.monotonic() + 5
    while await stored_media(short_media_server, media_id):
        assert time.monotonic() < deadline, "the sweeper did not delete the expired media"
        await asyncio.sleep(SHORT_SWEEP_INTERVAL)


async def stored_media(server: ServerProcess, media_id: str) -> list[str]:
    """What the server's storage still holds of `media_id` (files, or bucket keys)."""
    if not on_s3(server):
        return [p.name for p in stored_files(server) if media_id in p.name]
    endpoint = server.env["PORTICO_S3_ENDPOINT_URL"]
    seaweed = Seaweed(Path("."), s3_port=int(endpoint.rsplit(":", 1)[1]))
    keys: list[str] = []
    for prefix in ("objects/", "records/", "media-expiry/"):
        keys += [k for k in await bucket_keys(seaweed, SHORT_BUCKET, prefix) if media_id in k]
    return keys


async def test_public_url_is_the_base_of_upload_urls(
    http: aiohttp.ClientSession, short_media_server: ServerProcess
) -> None:
    granted = await grant(http, short_media_server)
    if on_s3(short_media_server):  # the bucket's URL; public_url is not its base
        assert is_direct(granted)
        assert not granted["upload_url"].startswith(PUBLIC_URL)
        return
    assert granted["upload_url"] == f"{PUBLIC_URL}/media/upload/{granted['upload_id']}"


# -- authentication and ownership ------------------------------------------------------


async def test_a_credential_is_required(
    http: aiohttp.ClientSession, media_server: ServerProcess
) -> None:
    granted = await uploaded(http, media_server, b"hello")
    for token in (None, "wrong-token"):
        for response in (
            await request_upload(http, media_server, token=token),
            await info(http, media_server, granted["storage_ref"], token=token),
            await download(http, media_server, granted["storage_ref"], token=token),
        ):
            assert (await error_of(response))[:2] == (401, "UNAUTHENTICATED")
            assert response.headers["WWW-Authenticate"].startswith("Bearer")


async def test_another_principals_session_and_media_are_hidden(
    http: aiohttp.ClientSession, media_server: ServerProcess
) -> None:
    alices = await archived_session(http, media_server, ALICE)
    granted = await uploaded(http, media_server, b"alice's", session_id=alices)

    status, code, _ = await error_of(
        await request_upload(http, media_server, token=BOB, session_id=alices)
    )
    assert (status, code) == (404, "SESSION_EXPIRED")
    for route in (info, download):
        hidden = await error_of(await route(http, media_server, granted["storage_ref"], BOB))
        session_id, _ = ids_of(granted["storage_ref"])
        missing = f"omnia://sessions/{session_id}/media/med-{uuid.uuid4().hex}"
        absent = await error_of(await route(http, media_server, missing, ALICE))
        assert hidden == absent == (404, "MEDIA_NOT_FOUND", "no such media")
    assert (await download(http, media_server, granted["storage_ref"], ALICE)).status == 200


async def test_media_uploaded_by_another_principal_to_an_unseen_session(
    http: aiohttp.ClientSession, media_server: ServerProcess
) -> None:
    granted = await uploaded(http, media_server, b"bob's", token=BOB)
    assert (await info(http, media_server, granted["storage_ref"], BOB)).status == 200
    assert (await info(http, media_server, granted["storage_ref"], ALICE)).status == 404


@pytest.mark.parametrize(
    ("session_id", "media_id"),
    [("..", "med-" + "0" * 32), ("s1", ".."), ("s1", "med-..%2F..%2Ftickets"), ("s1", "x" * 500)],
)
async def test_path_tricks_find_nothing(
    http: aiohttp.ClientSession, media_server: ServerProcess, session_id: str, media_id: str
) -> None:
    for route in ("info", "download"):
        url = f"{media_server.http_url}/media/{route}/{session_id}/{media_id}"
        response = await http.get(url, headers=bearer(ALICE))
        assert response.status == 404


# -- media disabled -----------------------------------------------------------------


async def test_every_route_answers_media_not_enabled(
    http: aiohttp.ClientSession, media_off_server: ServerProcess
) -> None:
    base = media_off_server.http_url
    ref = f"s1/med-{uuid.uuid4().hex}"
    for response in (
        await request_upload(http, media_off_server),
        await http.put(f"{base}/media/upload/upl-{'A' * 43}", data=b"abc"),
        await http.get(f"{base}/media/info/{ref}", headers=bearer(ALICE)),
        await http.get(f"{base}/media/download/{ref}", headers=bearer(ALICE)),
    ):
        assert (await error_of(response))[:2] == (404, "MEDIA_NOT_ENABLED")
    assert not (media_off_server.data_dir / "media").exists()


# -- restart ------------------------------------------------------------------------


async def test_upload_urls_and_media_survive_a_restart(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = _start(tmp_path / "portico")
    try:
        kept = await uploaded(http, server, b"before the restart")
        pending = await grant(http, server, size_bytes=5)
        server.restart()
        assert await (await download(http, server, kept["storage_ref"])).read() == (
            b"before the restart"
        )
        assert (await put(http, server, pending, b"after")).status == 204
        assert (await put(http, server, kept, b"x" * 18)).status == 410
    finally:
        server.stop()
