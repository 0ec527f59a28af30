"""Uploads over `/ws`: `upload_request`, the PUT, and messages that reference media."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from support.conformance import ALICE, BOB, Connect
from support.omnia import OmniaClient, scenario
from support.server import SCRIPT, ServerProcess

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40
LOWERED_MAX_INLINE = 256 * 1024  # an operator's max_inline_media_bytes, below the default


@pytest.fixture(scope="module")
def media_off(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("portico-no-media"), env={"PORTICO_MEDIA": "none"}
    )
    yield process.start()
    process.stop()


@pytest.fixture(scope="module")
def lowered_inline_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("portico-small-inline"),
        env={"PORTICO_MAX_INLINE_MEDIA_BYTES": str(LOWERED_MAX_INLINE)},
    )
    yield process.start()
    process.stop()


@pytest.fixture(scope="module")
def fetching_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Lets `url` parts reach loopback, where the test's origin serves them."""
    process = ServerProcess(
        tmp_path_factory.mktemp("portico-fetching"),
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={"PORTICO_MEDIA_FETCH_PRIVATE": "true"},
    )
    yield process.start()
    process.stop()


@pytest.fixture
async def origin() -> AsyncIterator[str]:
    """A real HTTP server on 127.0.0.1 holding `PNG` at /photo.png (and a redirect to it)."""

    async def photo(request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def moved(request: web.Request) -> web.Response:
        raise web.HTTPFound("/photo.png")

    app = web.Application()
    app.router.add_get("/photo.png", photo)
    app.router.add_get("/moved", moved)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def described(data: bytes, kind: str = "image", mime: str = "image/png") -> str:
    return f"{kind} {mime} {len(data)} bytes sha256:{hashlib.sha256(data).hexdigest()[:16]}\n"


async def request_upload(
    client: OmniaClient, session_id: str | None = None, **fields: Any
) -> dict[str, Any]:
    body = {"filename": "photo.png", "mime_type": "image/png", "size_bytes": len(PNG), **fields}
    frame: dict[str, Any] = {"type": "upload_request", "upload_request": body}
    if session_id:
        frame["session_id"] = session_id
    await client.send(frame)
    return await client.recv()


async def test_upload_then_reference_it_in_a_message(
    connect: Connect, http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    client = await connect()
    session_id = (await client.connected())["session_id"]
    ready = await request_upload(client)
    assert ready["type"] == "upload_ready"
    assert ready["session_id"] == session_id
    grant = ready["upload_ready"]
    assert grant["upload_url"].startswith(f"{server.http_url}/media/upload/")
    assert re.fullmatch(rf"omnia://sessions/{session_id}/media/[\w-]+", grant["storage_ref"])
    assert grant["method"] == "PUT"
    assert grant["headers"]["Content-Type"] == "image/png"
    assert datetime.fromisoformat(grant["expires_at"].replace("Z", "+00:00")) > datetime.now(UTC)

    # The upload URL is the PUT's only credential, as a presigned URL is.
    async with http.put(grant["upload_url"], data=PNG, headers=grant["headers"]) as put:
        assert put.status == 204

    part = {
        "type": "image",
        "media": {"storage_ref": grant["storage_ref"], "mime_type": "image/png"},
    }
    await client.send({"type": "message", "parts": [part], **scenario("media_info")})
    frames = await client.turn()
    assert frames[0]["content"] == described(PNG)
    assert frames[-1]["type"] == "done"


async def test_inline_data_reaches_the_runtime(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    data = b"tiny image"
    media = {"data": base64.b64encode(data).decode(), "mime_type": "image/png"}
    await client.send(
        {"type": "message", "parts": [{"type": "image", "media": media}], **scenario("media_info")}
    )
    assert (await client.turn())[0]["content"] == described(data)


@pytest.mark.parametrize("path", ["/photo.png", "/moved"])
async def test_url_part_bytes_are_fetched_for_the_runtime(
    http: aiohttp.ClientSession, fetching_server: ServerProcess, origin: str, path: str
) -> None:
    client = OmniaClient(await http.ws_connect(fetching_server.ws_url))
    await client.connected()
    media = {"url": origin + path, "mime_type": "image/png"}
    await client.send(
        {"type": "message", "parts": [{"type": "image", "media": media}], **scenario("media_info")}
    )
    frames = await client.turn()
    assert frames[0]["content"] == described(PNG)  # the runtime read the origin's bytes
    assert frames[-1]["type"] == "done"
    await client.ws.close()


async def test_url_part_on_loopback_is_refused_without_media_fetch_private(
    connect: Connect, origin: str
) -> None:
    client = await connect()
    await client.connected()
    media = {"url": f"{origin}/photo.png", "mime_type": "image/png"}
    await client.send(
        {"type": "message", "parts": [{"type": "image", "media": media}], **scenario("media_info")}
    )
    refused = await client.recv()
    assert refused["error"]["code"] == "INVALID_MESSAGE"
    assert refused["error"]["message"].startswith("parts[0]"), refused
    assert "public address" in refused["error"]["message"], refused


async def test_inline_data_above_a_lowered_limit_is_invalid(
    http: aiohttp.ClientSession, lowered_inline_server: ServerProcess
) -> None:
    client = OmniaClient(await http.ws_connect(lowered_inline_server.ws_url))
    await client.connected()
    for size, accepted in ((LOWERED_MAX_INLINE, True), (LOWERED_MAX_INLINE + 1, False)):
        media = {"data": base64.b64encode(b"x" * size).decode(), "mime_type": "image/png"}
        await client.send({"type": "message", "parts": [{"type": "image", "media": media}]})
        frames = await client.turn()
        assert (frames[-1]["type"] == "done") is accepted, frames[-1]
    refused = frames[-1]
    assert refused["error"]["code"] == "INVALID_MESSAGE"
    assert refused["error"]["message"].startswith("parts[0]")
    await client.ws.close()


async def test_storage_ref_of_another_principal_or_session_is_invalid(
    connect: Connect, http: aiohttp.ClientSession
) -> None:
    alice = await connect()
    alice_session = (await alice.connected())["session_id"]
    grant = (await request_upload(alice))["upload_ready"]
    async with http.put(grant["upload_url"], data=PNG, headers=grant["headers"]) as put:
        assert put.status == 204
    part = {
        "type": "image",
        "media": {"storage_ref": grant["storage_ref"], "mime_type": "image/png"},
    }

    bob = await connect(as_token=BOB)
    await bob.connected()
    await bob.send({"type": "message", "parts": [part], "session_id": alice_session})
    assert (await bob.recv())["error"]["code"] == "INVALID_MESSAGE"
    await bob.send({"type": "message", "parts": [part]})  # into bob's own session
    assert (await bob.recv())["error"]["code"] == "INVALID_MESSAGE"

    other = await connect(as_token=ALICE)
    await other.connected()  # alice again, but another session
    await other.send({"type": "message", "parts": [part]})
    refused = await other.recv()
    assert refused["error"]["code"] == "INVALID_MESSAGE"
    assert refused["error"]["message"].startswith("parts[0]")


async def test_reference_before_the_put_is_invalid(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    grant = (await request_upload(client))["upload_ready"]
    part = {
        "type": "image",
        "media": {"storage_ref": grant["storage_ref"], "mime_type": "image/png"},
    }
    await client.send({"type": "message", "parts": [part]})
    assert (await client.recv())["error"]["code"] == "INVALID_MESSAGE"


@pytest.mark.parametrize(
    ("fields", "code", "names"),
    [
        ({"size_bytes": 200 * 1024 * 1024}, "UPLOAD_FAILED", "upload limit"),
        ({"mime_type": "png"}, "INVALID_MESSAGE", "mime_type"),
        ({"filename": ""}, "INVALID_MESSAGE", "filename"),
        ({"filename": "../etc/passwd"}, "INVALID_MESSAGE", "filename"),
        ({"size_bytes": -1}, "INVALID_MESSAGE", "size_bytes"),
        ({"size_bytes": "big"}, "INVALID_MESSAGE", "size_bytes"),
    ],
)
async def test_upload_request_validation(
    connect: Connect, fields: dict[str, Any], code: str, names: str
) -> None:
    client = await connect()
    await client.connected()
    refused = await request_upload(client, **fields)
    assert refused["error"]["code"] == code
    assert names in refused["error"]["message"]


async def test_upload_request_without_a_field_names_it(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    body = {"mime_type": "image/png", "size_bytes": 3}
    await client.send({"type": "upload_request", "upload_request": body})
    refused = await client.recv()
    assert refused["error"]["code"] == "INVALID_MESSAGE"
    assert "filename" in refused["error"]["message"]


async def test_upload_request_for_a_foreign_session_looks_expired(connect: Connect) -> None:
    alice = await connect()
    alice_session = (await alice.connected())["session_id"]
    await alice.ask("open it")
    bob = await connect(as_token=BOB)
    await bob.connected()
    assert (await request_upload(bob, alice_session))["error"]["code"] == "SESSION_EXPIRED"


async def test_media_disabled_answers_media_not_enabled(
    http: aiohttp.ClientSession, media_off: ServerProcess
) -> None:
    client = OmniaClient(await http.ws_connect(media_off.ws_url))
    await client.connected()
    assert (await request_upload(client))["error"]["code"] == "MEDIA_NOT_ENABLED"
    await client.ws.close()
