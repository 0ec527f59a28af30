"""What Omnia's own dashboard client needs of `/ws`: a `timestamp` on every server
frame, inline attachments as large as a frame, and frame limits that are inclusive."""

from __future__ import annotations

import base64
import hashlib
import json
import random
import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from portico.protocols.omnia.binary import media_frames
from support.archive import wait_for_messages
from support.conformance import SMALL_MAX_PAYLOAD, Connect, rpc_url
from support.omnia import OmniaClient, scenario
from support.server import SCRIPT, ServerProcess

RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)")

# -- timestamp on every server frame ---------------------------------------------------


def sent_at(frame: dict[str, Any]) -> float:
    """The frame's `timestamp` as Unix seconds; RFC 3339 in UTC or the test fails."""
    stamp = frame["timestamp"]
    assert RFC3339.fullmatch(stamp), stamp
    parsed = datetime.fromisoformat(stamp)
    assert parsed.utcoffset() == timedelta(0), stamp
    return parsed.timestamp()


async def test_every_server_frame_type_carries_an_rfc3339_timestamp(
    connect_short: Connect,
) -> None:
    started = time.time()
    client = await connect_short("?binary=true")
    session_id = (await client.connected())["session_id"]
    await client.send(
        {
            "type": "upload_request",
            "upload_request": {"filename": "a.png", "mime_type": "image/png", "size_bytes": 3},
        }
    )
    assert (await client.recv())["type"] == "upload_ready"
    await client.send_raw("{")  # a parse error
    assert (await client.recv())["error"]["code"] == "INVALID_MESSAGE"
    for frame in media_frames(
        media_id="a1", mime_type="audio/pcm", payload=b"\x01" * 300, session_id=session_id
    ):
        await client.ws.send_bytes(frame)
    assert (await client.recv())["error"]["code"] == "MEDIA_NOT_ENABLED"
    # A tool call nobody answers ends with the server's own `tool_result`.
    tool_turn = await client.ask("where am I", **scenario("tool"))
    assert [f["type"] for f in tool_turn] == ["tool_call", "tool_result", "chunk", "done"]
    assert (await client.ask("sing", **scenario("media")))[0]["type"] == "media_chunk"
    assert (await client.ask("fail", **scenario("fail")))[-1]["type"] == "error"
    finished = time.time()

    assert {f["type"] for f in client.frames} == {
        "connected",
        "upload_ready",
        "error",
        "tool_call",
        "tool_result",
        "media_chunk",
        "chunk",
        "done",
    }
    moments = [sent_at(frame) for frame in client.frames]
    # Wall-clock time, to the millisecond (hence the slack), in sending order.
    assert started - 0.001 <= moments[0]
    assert moments[-1] <= finished
    assert moments == sorted(moments)


# -- inline attachments as large as Omnia's dashboard sends -----------------------------

DASHBOARD_FILE_LIMIT = 10 * 1024 * 1024  # the largest file the dashboard sends inline


async def test_a_10_mb_inline_image_is_accepted_read_and_archived_with_default_settings(
    connect: Connect, archive_path: Path
) -> None:
    image = random.Random(12).randbytes(DASHBOARD_FILE_LIMIT)
    data = base64.b64encode(image).decode()
    client = await connect()
    session_id = (await client.connected())["session_id"]
    part = {"type": "image", "media": {"data": data, "mime_type": "image/png"}}
    await client.send({"type": "message", "parts": [part], **scenario("media_info")})
    frames = await client.turn(within=60)
    digest = hashlib.sha256(image).hexdigest()[:16]
    assert frames[0].get("content") == f"image image/png {len(image)} bytes sha256:{digest}\n", (
        frames[0]
    )
    assert frames[-1]["type"] == "done"
    user, _reply = await wait_for_messages(archive_path, session_id, 2)
    assert user.parts is not None
    (archived,) = user.parts
    assert archived.media is not None
    assert archived.media.data == data  # readable from the archive, byte for byte


# -- frame limits are inclusive ----------------------------------------------------------


def padded(frame: dict[str, Any], size: int) -> str:
    """`frame` as JSON with trailing spaces: exactly `size` bytes of UTF-8."""
    text = json.dumps(frame, ensure_ascii=False)
    return text + " " * (size - len(text.encode()))


async def closed_with(ws: aiohttp.ClientWebSocketResponse) -> int | None:
    msg = await ws.receive(timeout=10)
    assert msg.type is aiohttp.WSMsgType.CLOSE, msg
    return ws.close_code


async def test_a_ws_frame_of_exactly_max_payload_size_is_accepted(connect_short: Connect) -> None:
    client = await connect_short()
    await client.connected()
    await client.send_raw(padded({"type": "message", "content": "hi"}, SMALL_MAX_PAYLOAD))
    assert (await client.turn())[-1]["type"] == "done"
    await client.send_raw(padded({"type": "message", "content": "hi"}, SMALL_MAX_PAYLOAD + 1))
    assert await closed_with(client.ws) == 1009


async def test_a_binary_ws_frame_of_exactly_max_payload_size_is_accepted(
    connect_short: Connect,
) -> None:
    client = await connect_short("?binary=true")
    await client.connected()
    await client.ws.send_bytes(b"x" * SMALL_MAX_PAYLOAD)  # not OMNI: answered, not closed
    assert (await client.recv())["error"]["code"] == "INVALID_MESSAGE"
    await client.ws.send_bytes(b"x" * (SMALL_MAX_PAYLOAD + 1))
    assert await closed_with(client.ws) == 1009


async def test_session_and_rpc_frames_of_exactly_max_payload_size_are_accepted(
    http: aiohttp.ClientSession, short_server: ServerProcess
) -> None:
    for url, first, answer in (
        (
            f"ws://127.0.0.1:{short_server.port}/v1/session",
            {"type": "hello", "protocol": 1},
            "ready",
        ),
        (rpc_url(short_server), {"type": "connect"}, "connected"),
    ):
        ws = await http.ws_connect(url)
        await ws.send_str(padded(first, SMALL_MAX_PAYLOAD))
        reply = json.loads((await ws.receive(timeout=10)).data)
        assert reply["type"] == answer, (url, reply)
        await ws.send_str(padded({"type": "ping"}, SMALL_MAX_PAYLOAD + 1))
        assert await closed_with(ws) == 1009, url


@pytest.fixture(scope="module")
def compressing_small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("portico-deflate-small"),
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={
            "PORTICO_WS_COMPRESSION": "true",
            "PORTICO_MAX_PAYLOAD_SIZE": str(SMALL_MAX_PAYLOAD),
        },
    ).start()
    yield process
    process.stop()


async def test_compressed_frames_are_limited_by_their_inflated_size_exactly(
    http: aiohttp.ClientSession, compressing_small_server: ServerProcess
) -> None:
    ws = await http.ws_connect(compressing_small_server.ws_url, compress=15)
    assert ws.compress == 15
    client = OmniaClient(ws)
    await client.connected()
    # Two-byte characters: the limit counts UTF-8 bytes, not characters.
    message = {"type": "message", "content": "é" * 1000}
    await client.send_raw(padded(message, SMALL_MAX_PAYLOAD))
    assert (await client.turn())[-1]["type"] == "done"
    await client.send_raw(padded(message, SMALL_MAX_PAYLOAD + 1))
    assert await closed_with(ws) == 1009
