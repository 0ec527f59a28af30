"""Media streaming, binary frames, rate limits, admission and slow consumers on `/ws`."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from portico.protocols.omnia.binary import media_frames
from support.conformance import Connect
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
            "PORTICO_MEDIA_RATE_BURST": str(LIMITED_MEDIA_BYTES),
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


async def test_text_path_media_stays_json_with_binary_true(connect: Connect) -> None:
    # docs/omnia.md: runtime media on the text path are JSON `media_chunk` frames with
    # base64 data, `binary=true` or not; binary output is for duplex audio only.
    client = await connect("?binary=true")
    connected = await client.connected()
    assert connected["connected"]["capabilities"]["binary_frames"] is True
    # `recv` fails on any binary frame, and checks each text frame against the schema.
    frames = await client.ask("sing", **scenario("media"))
    assert [f["type"] for f in frames] == ["media_chunk"] * 4 + ["done"]
    chunks = [f["media_chunk"] for f in frames[:-1]]
    assert [c["sequence"] for c in chunks] == [0, 1, 2, 3]
    assert {c["mime_type"] for c in chunks} == {"audio/pcm"}
    data = b"".join(base64.b64decode(c["data"]) for c in chunks)
    assert data == bytes(i % 256 for i in range(200000))


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


PACED_CHUNKS = [f"p{n} " for n in range(10)]  # the `paced` scenario: ten chunks 100 ms apart


async def test_slow_consumer_is_disconnected_and_others_are_unaffected(
    http: aiohttp.ClientSession, limited: Connect, limited_server: ServerProcess
) -> None:
    slow_consumers = "portico_slow_consumer_disconnects_total"
    cut_offs_before = await metric(http, limited_server, slow_consumers)
    reader = await limited()
    session_id = (await reader.connected())["session_id"]
    received = reader.frames  # every frame the second client read, `connected` first
    cut_off = asyncio.Event()
    first_frame = asyncio.Event()
    # Per stream of the second client: its frames, and whether the cut-off was seen
    # before it ended.
    streams: list[tuple[list[dict[str, Any]], bool]] = []

    async def read_streams() -> None:
        # Whole paced streams back to back (each takes over a second, so the message
        # rate holds) until the cut-off is seen: there is no await between one
        # stream's end and the next one's start, so one is running when it is seen.
        while not cut_off.is_set():
            await reader.send({"type": "message", "content": "meanwhile", **scenario("paced")})
            frames: list[dict[str, Any]] = []
            while not frames or frames[-1]["type"] not in ("done", "error"):
                frames.append(await reader.recv())
                first_frame.set()
            streams.append((frames, cut_off.is_set()))

    streaming = asyncio.create_task(read_streams())
    await asyncio.wait_for(first_frame.wait(), 10)  # the second client is mid-stream
    stalled = await RawWebSocket.connect(limited_server.port)
    message = {"type": "message", "content": "flood", **scenario("flood")}
    await stalled.send_text(json.dumps(message))
    # The stalled peer reads nothing, so the server's queue for it fills.
    deadline = asyncio.get_running_loop().time() + 30
    while await metric(http, limited_server, slow_consumers) < cut_offs_before + 1:
        assert asyncio.get_running_loop().time() < deadline, "slow consumer never cut off"
        assert not streaming.done(), streaming
        await asyncio.sleep(0.02)
    streamed_before_cut_off = len(received) - 1
    cut_off.set()
    await asyncio.wait_for(streaming, 30)

    # Every stream of the second client ran whole, the one overlapping the cut-off too.
    assert streams
    for frames, _ in streams:
        assert frames == [
            *({"type": "chunk", "content": c, "session_id": session_id} for c in PACED_CHUNKS),
            {"type": "done", "content": "".join(PACED_CHUNKS), "session_id": session_id},
        ]
    assert [seen for _, seen in streams] == [False] * (len(streams) - 1) + [True]
    # It received frames before the cut-off was seen and went on streaming after it.
    assert 0 < streamed_before_cut_off < len(received) - 1
    # Reading again, the stalled peer finds the frames queued before the cut, then the
    # close frame with its code.
    code, texts = await asyncio.wait_for(stalled.read_until_close(), 10)
    stalled.close()
    assert code == 4008
    assert texts > 0


async def test_a_frame_larger_than_the_send_queue_reaches_a_reading_client(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # The send-queue bound is on the backlog, not on one frame (docs/omnia.md): frames
    # several times the bound reach a client that keeps up, and nothing closes it.
    queue = 64 * 1024
    big = 4 * queue
    script = tmp_path / "big.yaml"
    steps = [
        {"chunk": "a"},
        {
            "media_chunk": {
                "mime_type": "application/octet-stream",
                "bytes": big,
                "chunk_bytes": big,
            }
        },
        {"done": {"content": "x" * big}},
    ]
    script.write_text(yaml.safe_dump({"scenarios": {"default": steps}}))
    server = ServerProcess(
        tmp_path / "data",
        args=("--runtime", "scripted", "--script", str(script)),
        env={"PORTICO_MAX_SEND_QUEUE_BYTES": str(queue)},
    ).start()
    try:
        client = OmniaClient(await http.ws_connect(server.ws_url))
        await client.connected()
        for _ in range(2):
            frames = await client.ask("big")
            assert [f["type"] for f in frames] == ["chunk", "media_chunk", "done"]
            assert len(base64.b64decode(frames[1]["media_chunk"]["data"])) == big
            assert frames[2]["content"] == "x" * big
        assert not client.ws.closed
        assert await metric(http, server, "portico_slow_consumer_disconnects_total") == 0
        await client.ws.close()
    finally:
        server.stop()


async def test_a_client_that_stops_reading_is_cut_off_once_the_socket_is_paused(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # Paced output fills the kernel buffers and pauses the transport before the send
    # queue fills: the overflow happens while the socket waits for a drain that never
    # comes, and must still close the client (4008), not wait for the keepalive.
    step = {
        "media_chunk": {
            "mime_type": "application/octet-stream",
            "bytes": 65536,
            "chunk_bytes": 65536,
        }
    }
    steps = [item for _ in range(300) for item in (step, {"sleep_ms": 1})]
    script = tmp_path / "trickle.yaml"
    script.write_text(yaml.safe_dump({"scenarios": {"default": [*steps, {"done": {}}]}}))
    server = ServerProcess(
        tmp_path / "data",
        args=("--runtime", "scripted", "--script", str(script)),
        env={"PORTICO_MAX_SEND_QUEUE_BYTES": str(256 * 1024), "PORTICO_PING_INTERVAL": "30"},
    ).start()
    try:
        stalled = await RawWebSocket.connect(server.port, limit=4096)
        await stalled.send_text(json.dumps({"type": "message", "content": "trickle"}))
        deadline = asyncio.get_running_loop().time() + 15
        while await metric(http, server, "portico_slow_consumer_disconnects_total") < 1:
            assert asyncio.get_running_loop().time() < deadline, "slow consumer never cut off"
            await asyncio.sleep(0.05)
        stalled.close()
        assert "slow consumer protocol=omnia" in server.log_text()
        # The log names the code the client was sent, not the one aiohttp saw last.
        while "connection closed protocol=omnia" not in (log := server.log_text()):
            assert asyncio.get_running_loop().time() < deadline, "close never logged"
            await asyncio.sleep(0.05)
        assert "close_code=4008" in log
    finally:
        server.stop()


# -- metrics ----------------------------------------------------------------------------

METERED_ACK_TIMEOUT = 0.3
METERED_BURST = 20


async def scrape(http: aiohttp.ClientSession, server: ServerProcess) -> dict[str, float]:
    """Every sample of `/metrics`, keyed `name{labels}` as the exposition writes it."""
    async with http.get(server.http_url + "/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


def deltas(before: dict[str, float], after: dict[str, float], *series: str) -> dict[str, float]:
    return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in series}


class Counted:
    """An Omnia client that counts the frames it sent and received."""

    def __init__(self, client: OmniaClient) -> None:
        self.client = client
        self.sent = 0

    async def send(self, frame: dict[str, Any]) -> None:
        self.sent += 1
        await self.client.send(frame)

    async def turn(self, content: str, name: str = "default") -> list[dict[str, Any]]:
        await self.send({"type": "message", "content": content, **scenario(name)})
        return await self.client.turn()

    @property
    def received(self) -> int:
        return len(self.client.frames)


async def test_metrics_count_what_happened_between_two_scrapes(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # A server of its own, so nothing but this test moves its counters.
    server = ServerProcess(
        tmp_path,
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={
            "PORTICO_TOOL_ACK_TIMEOUT": str(METERED_ACK_TIMEOUT),
            "PORTICO_CLIENT_TOOL_TIMEOUT": "30",
            "PORTICO_RATE_LIMIT_MESSAGES": "1",
            "PORTICO_RATE_LIMIT_BURST": str(METERED_BURST),
        },
    ).start()
    try:
        before = await scrape(http, server)
        client = Counted(OmniaClient(await http.ws_connect(server.ws_url)))
        await client.client.connected()

        # Turns: one completed, one failed.
        assert (await client.turn("x"))[-1]["type"] == "done"
        assert (await client.turn("x", "fail"))[-1]["type"] == "error"
        # Tool calls, one per outcome; each of these turns completes.
        replies: dict[str, dict[str, Any] | None] = {
            "completed": {"type": "tool_result", "tool_result": {"result": 1}},
            "failed": {"type": "tool_result", "tool_result": {"error": "GPS off"}},
            "rejected": {"type": "tool_call_nack", "tool_call_nack": {"reason": "no"}},
            "timeout": None,  # never acknowledged: the ack timeout ends it
        }
        for reply in replies.values():
            await client.send({"type": "message", "content": "t", **scenario("tool")})
            call = await client.client.recv()
            assert call["type"] == "tool_call", call
            if reply is not None:
                kind = reply["type"]
                body = {**reply[kind], "call_id": call["tool_call"]["id"]}
                await client.send({"type": kind, kind: body})
            assert (await client.client.turn())[-1]["type"] == "done"

        # Uploads: granted over /ws and over HTTP, one stored, two failed PUTs.
        data = b"metered bytes"
        await client.send(
            {
                "type": "upload_request",
                "upload_request": {
                    "filename": "a.bin",
                    "mime_type": "application/octet-stream",
                    "size_bytes": len(data),
                },
            }
        )
        grant = (await client.client.recv())["upload_ready"]
        url, headers = grant["upload_url"], grant["headers"]
        async with http.put(url, data=data + b"!", headers=headers) as response:
            assert response.status == 413  # longer than declared: failed, URL still usable
        async with http.put(url, data=data, headers=headers) as response:
            assert response.status == 204
        async with http.put(url, data=data, headers=headers) as response:
            assert response.status == 410  # single use: failed
        body = {"session_id": "sess-metered", "filename": "b", "mime_type": "a/b", "size_bytes": 1}
        async with http.post(server.http_url + "/media/request-upload", json=body) as response:
            assert response.status == 200

        # One message over the rate limit, on a connection of its own.
        flooder = Counted(OmniaClient(await http.ws_connect(server.ws_url)))
        await flooder.client.connected()
        for _ in range(METERED_BURST):
            await flooder.send({"type": "hangup"})  # counted, never answered
        await flooder.send({"type": "message", "content": "one too many"})
        assert (await flooder.client.recv())["error"]["code"] == "RATE_LIMITED"

        # A turn's counters move when it is archived, just after its terminal frame.
        turns = ('portico_turns_total{state="completed"}', 'portico_turns_total{state="failed"}')
        deadline = asyncio.get_running_loop().time() + 10
        while sum(deltas(before, after := await scrape(http, server), *turns).values()) < 6:
            assert asyncio.get_running_loop().time() < deadline, deltas(before, after, *turns)
            await asyncio.sleep(0.05)

        expected = {
            'portico_connections_total{protocol="omnia"}': 2,
            'portico_connections_open{protocol="omnia"}': 2,
            'portico_frames_in_total{protocol="omnia"}': client.sent + flooder.sent,
            'portico_frames_out_total{protocol="omnia"}': client.received + flooder.received,
            turns[0]: 5,
            turns[1]: 1,
            "portico_turn_first_chunk_seconds_count": 6,
            "portico_turn_duration_seconds_count": 6,
            **{f'portico_tool_calls_total{{state="{state}"}}': 1 for state in replies},
            'portico_uploads_total{result="granted"}': 2,
            'portico_uploads_total{result="stored"}': 1,
            'portico_uploads_total{result="failed"}': 2,
            'portico_rate_limited_total{limit="messages"}': 1,
            'portico_rate_limited_total{limit="media_bytes"}': 0,
        }
        assert deltas(before, after, *expected) == expected
    finally:
        server.stop()
