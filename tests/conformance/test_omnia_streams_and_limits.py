"""Media streaming, binary frames, rate limits, admission and slow consumers on `/ws`."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from conftest import Connect

from portico.protocols.omnia.binary import media_frames
from support.omnia import OmniaClient, scenario
from support.rawws import RawWebSocket
from support.server import SCRIPT, ServerProcess

LIMITED_RATE = 1.0  # messages per second
LIMITED_BURST = 3
LIMITED_MEDIA_BYTES = 64 * 1024
LIMITED_SEND_QUEUE = 512 * 1024
ALLOWED_ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("portico-limited"),
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={
            "PORTICO_RATE_LIMIT_MESSAGES": str(LIMITED_RATE),
            "PORTICO_RATE_LIMIT_BURST": str(LIMITED_BURST),
            "PORTICO_MEDIA_RATE_BYTES": str(LIMITED_MEDIA_BYTES),
            "PORTICO_MAX_SEND_QUEUE_BYTES": str(LIMITED_SEND_QUEUE),
            "PORTICO_ORIGINS": ALLOWED_ORIGIN,
        },
    ).start()
    yield process
    process.stop()


@pytest.fixture
def limited(http: aiohttp.ClientSession, limited_server: ServerProcess) -> Connect:
    async def connect(**kwargs: object) -> OmniaClient:
        return OmniaClient(await http.ws_connect(limited_server.ws_url, **kwargs))  # type: ignore[arg-type]

    return connect


async def metric(http: aiohttp.ClientSession, server: ServerProcess, name: str) -> float:
    async with http.get(server.http_url + "/metrics") as response:
        text = await response.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- media streaming -------------------------------------------------------------------


async def test_media_chunks_reassemble_byte_exact(connect: Connect) -> None:
    client = await connect()
    session_id = (await client.connected())["session_id"]
    frames = await client.ask("sing", **scenario("media"))
    chunks = [f["media_chunk"] for f in frames if f["type"] == "media_chunk"]
    assert frames[-1]["type"] == "done"
    assert {f["session_id"] for f in frames} == {session_id}
    assert [c["sequence"] for c in chunks] == [0, 1, 2, 3]
    assert [c["is_last"] for c in chunks] == [False, False, False, True]
    assert len({c["media_id"] for c in chunks}) == 1
    assert {c["mime_type"] for c in chunks} == {"audio/pcm"}
    data = [base64.b64decode(c["data"]) for c in sorted(chunks, key=lambda c: c["sequence"])]
    assert [len(d) for d in data] == [65536, 65536, 65536, 200000 - 3 * 65536]
    assert b"".join(data) == bytes(i % 256 for i in range(200000))


# -- binary frames ----------------------------------------------------------------------


def header(
    *,
    magic: bytes = b"OMNI",
    version: int = 1,
    message_type: int = 1,
    metadata_len: int = 2,
    payload_len: int = 0,
) -> bytes:
    return struct.pack(
        ">4sBBHIII12s", magic, version, 0, message_type, metadata_len, payload_len, 0, b"m1"
    )


BAD_FRAMES = {
    "invalid header size": b"OMNI\x01",
    "invalid magic bytes": header(magic=b"NOPE") + b"{}",
    "unsupported binary protocol version": header(version=9) + b"{}",
    "metadata length exceeds frame size": header(metadata_len=100) + b"{}",
    "payload length exceeds frame size": header(payload_len=100) + b"{}",
    "unknown binary message type": header(message_type=7) + b"{}",
}


@pytest.mark.parametrize("reason", sorted(BAD_FRAMES))
async def test_undecodable_binary_frame_is_invalid_with_its_reason(
    connect: Connect, reason: str
) -> None:
    client = await connect()
    await client.connected()
    await client.ws.send_bytes(BAD_FRAMES[reason])
    refused = await client.recv()
    assert refused["error"] == {"code": "INVALID_MESSAGE", "message": reason}
    assert (await client.ask())[-1]["type"] == "done"


async def test_valid_binary_media_gets_one_media_not_enabled(connect: Connect) -> None:
    client = await connect("?binary=true")
    session_id = (await client.connected())["session_id"]
    for frame in (
        media_frames(
            media_id="a1", mime_type="audio/pcm", payload=b"\x01" * 3000, session_id=session_id
        )
        * 3
    ):
        await client.ws.send_bytes(frame)
    refused = await client.recv()
    assert refused["error"]["code"] == "MEDIA_NOT_ENABLED"
    await client.expect_silence()


# -- rate limits ------------------------------------------------------------------------


async def test_message_rate_limit_refuses_and_keeps_the_socket(limited: Connect) -> None:
    client = await limited()
    await client.connected()
    for _ in range(LIMITED_BURST):
        await client.send({"type": "hangup"})  # counted, never answered
    await client.send({"type": "message", "content": "one too many"})
    refused = await client.recv()
    assert refused["error"]["code"] == "RATE_LIMITED"
    await asyncio.sleep(1.2 / LIMITED_RATE)  # the bucket refills with time by definition
    assert (await client.ask())[-1]["type"] == "done"


async def test_media_byte_rate_limit(limited: Connect) -> None:
    client = await limited()
    await client.connected()
    await client.ws.send_bytes(b"x" * (LIMITED_MEDIA_BYTES + 1))
    assert (await client.recv())["error"]["code"] == "RATE_LIMITED"
    assert not client.ws.closed


# -- admission --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        (ALLOWED_ORIGIN, True),
        ("https://evil.example", False),
        (None, True),  # non-browser clients send no Origin
    ],
)
async def test_origin_allowlist(
    http: aiohttp.ClientSession, limited_server: ServerProcess, origin: str | None, allowed: bool
) -> None:
    headers = {"Origin": origin} if origin else {}
    if allowed:
        ws = await http.ws_connect(limited_server.ws_url, headers=headers)
        await ws.close()
    else:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(limited_server.ws_url, headers=headers)
        assert refused.value.status == 403


async def test_same_origin_is_the_default(
    http: aiohttp.ClientSession, short_server: ServerProcess
) -> None:
    own = {"Origin": short_server.http_url}
    ws = await http.ws_connect(short_server.ws_url, headers=own)
    await ws.close()
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await http.ws_connect(short_server.ws_url, headers={"Origin": "https://other.example"})
    assert refused.value.status == 403


async def test_max_connections_refuses_with_503(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = ServerProcess(tmp_path, env={"PORTICO_MAX_CONNECTIONS": "2"}).start()
    try:
        first = await http.ws_connect(server.ws_url)
        second = await http.ws_connect(server.ws_url)
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(server.ws_url)
        assert refused.value.status == 503
        assert await metric(http, server, 'portico_upgrades_refused_total{reason="capacity"}') == 1
        await first.close()
        await asyncio.sleep(0.2)  # the server counts the close when its handler returns
        third = await http.ws_connect(server.ws_url)
        await asyncio.gather(second.close(), third.close())
    finally:
        server.stop()


# -- slow consumers ---------------------------------------------------------------------


async def test_slow_consumer_is_disconnected_and_others_are_unaffected(
    http: aiohttp.ClientSession, limited: Connect, limited_server: ServerProcess
) -> None:
    stalled = await RawWebSocket.connect(limited_server.port)
    message = {"type": "message", "content": "flood", **scenario("flood")}
    await stalled.send_text(json.dumps(message))
    # The stalled peer reads nothing, so the server's queue for it fills, while a
    # second client keeps streaming normally.
    reader = await limited()
    await reader.connected()
    deadline = asyncio.get_running_loop().time() + 30
    while await metric(http, limited_server, "portico_slow_consumer_disconnects_total") < 1:
        assert asyncio.get_running_loop().time() < deadline, "slow consumer never cut off"
        frames = await reader.ask("meanwhile")
        assert frames[-1] == {
            "type": "done",
            "content": "Hello world",
            "session_id": frames[0]["session_id"],
        }
        await asyncio.sleep(1.0 / LIMITED_RATE)  # stay under the message rate
    # Reading again, the stalled peer finds the frames queued before the cut, then the
    # close frame with its code.
    code, texts = await asyncio.wait_for(stalled.read_until_close(), 10)
    stalled.close()
    assert code == 4008
    assert texts > 0


# -- metrics ----------------------------------------------------------------------------


async def test_metrics_count_connections_turns_frames_and_tools(
    http: aiohttp.ClientSession, connect_short: Connect, short_server: ServerProcess
) -> None:
    client = await connect_short()
    await client.connected()
    await client.ask("x")
    await client.send({"type": "message", "content": "t", **scenario("tool")})
    call = await client.recv()
    reject = {"call_id": call["tool_call"]["id"], "reason": "no"}
    await client.send({"type": "tool_call_nack", "tool_call_nack": reject})
    await client.turn()
    async with http.get(short_server.http_url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    for name in (
        r'portico_connections_total\{protocol="omnia"\} [1-9]',
        r'portico_connections_open\{protocol="omnia"\} [1-9]',
        r'portico_turns_total\{state="completed"\} [1-9]',
        r'portico_tool_calls_total\{state="rejected"\} [1-9]',
        r'portico_frames_in_total\{protocol="omnia"\} [1-9]',
        r'portico_frames_out_total\{protocol="omnia"\} [1-9]',
        r"portico_turn_first_chunk_seconds_count [1-9]",
        r"portico_turn_duration_seconds_count [1-9]",
    ):
        assert re.search(name, text), name
    assert json.dumps(text)  # plain text exposition, no HTML error page
