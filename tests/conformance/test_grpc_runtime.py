"""`runtime: grpc` against real processes: `portico serve --runtime grpc` dialling the
scriptable test runtime (tests/support/grpc_runtime.py) in another process, over
`/ws`, `/v1/session` and `/v1/rpc`.

The main server is configured from the environment alone (PORTICO_RUNTIME,
PORTICO_GRPC_TARGET); the short server's default agent has short timeouts, owns its
context (HasConversation) and re-checks Health often.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from support.archive import open_archive
from support.certs import make_certificates
from support.conformance import Connect, connector
from support.frames import frame_kinds, streamed_text
from support.grpc_runtime import RuntimeProcess
from support.omnia import OmniaClient, scenario
from support.rpc import RpcProbe
from support.server import ServerProcess
from support.session import SessionProbe

SHORT = 0.5  # the short agent's first-token and idle timeouts, seconds
TOOL_ACK_TIMEOUT = 0.5
TIMED_OUT = "the client did not answer the tool call in time"
REPLY = "Hello from gRPC"
WAIT = 10.0


def grpc_env(runtime: RuntimeProcess, **extra: str) -> dict[str, str]:
    return {"PORTICO_RUNTIME": "grpc", "PORTICO_GRPC_TARGET": runtime.target, **extra}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeProcess]:
    process = RuntimeProcess(tmp_path_factory.mktemp("grpc-runtime") / "runtime.log").start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def grpc_server(
    tmp_path_factory: pytest.TempPathFactory, runtime: RuntimeProcess
) -> Iterator[ServerProcess]:
    env = grpc_env(
        runtime,
        PORTICO_TOOL_ACK_TIMEOUT=str(TOOL_ACK_TIMEOUT),
        PORTICO_CLIENT_TOOL_TIMEOUT="2.0",
    )
    del env["PORTICO_RUNTIME"]  # the flag instead: `portico serve --runtime grpc`
    data_dir = tmp_path_factory.mktemp("portico-grpc")
    process = ServerProcess(data_dir, args=("--runtime", "grpc"), env=env).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def short_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeProcess]:
    process = RuntimeProcess(tmp_path_factory.mktemp("grpc-short") / "runtime.log").start()
    yield process
    process.stop()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def short_server(
    tmp_path_factory: pytest.TempPathFactory, short_runtime: RuntimeProcess
) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("portico-grpc-short")
    short = {
        "runtime": "grpc",
        "grpc_target": short_runtime.target,
        "first_token_timeout": SHORT,
        "stream_idle_timeout": SHORT,
        "grpc_connect_timeout": SHORT,
        "grpc_health_interval": 0.05,
        "runtime_owns_context": True,
    }
    nowhere = {**short, "grpc_target": f"127.0.0.1:{free_port()}", "grpc_health_required": False}
    config = data_dir / "portico.yaml"
    config.write_text(yaml.safe_dump({"agents": {"default": short, "nowhere": nowhere}}))
    process = ServerProcess(data_dir, args=("--config", str(config))).start()
    yield process
    process.stop()


@pytest.fixture
def connect(http: aiohttp.ClientSession, grpc_server: ServerProcess) -> Connect:
    return connector(http, grpc_server, None)


@pytest.fixture
def connect_short(http: aiohttp.ClientSession, short_server: ServerProcess) -> Connect:
    return connector(http, short_server, None)


def text_of(frames: list[dict[str, Any]]) -> str:
    return "".join(f["content"] for f in frames if f["type"] == "chunk")


def terminal(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [f for f in frames if f["type"] in ("done", "error")]


async def one_failed_turn(client: OmniaClient, name: str) -> dict[str, Any]:
    """The turn ends with exactly one terminal frame, an `error`, and nothing follows."""
    frames = await client.ask("go", **scenario(name))
    (last,) = terminal(frames)
    assert last["type"] == "error", frames
    await client.expect_silence()
    return last


# -- /ws: the mapping --------------------------------------------------------------------


async def test_chunks_stream_and_usage_is_recorded(
    connect: Connect, grpc_server: ServerProcess
) -> None:
    client = await connect()
    session_id = (await client.connected())["session_id"]
    frames = await client.ask("hi", **scenario("stream"))
    assert streamed_text(frames) == "Hello from gRPC"
    assert frame_kinds(frames) == ["chunk", "done"]
    assert frames[-1] == {"type": "done", "session_id": session_id, "content": REPLY}
    async with open_archive(grpc_server.archive_path) as store:
        (turn,) = await store.list_turns(session_id)
    assert (turn.input_tokens, turn.output_tokens) == (3, 5)


async def test_done_final_content_and_parts_are_the_reply(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    done = (await client.ask("hi", **scenario("final")))[-1]
    assert done["content"] == "FINAL"
    assert done["parts"] == [
        {"type": "text", "text": "see"},
        {
            "type": "image",
            "media": {"url": "https://example.com/cat.png", "mime_type": "image/png"},
        },
    ]


async def start_tool(client: OmniaClient) -> dict[str, Any]:
    await client.connected()
    await client.send({"type": "message", "content": "where", **scenario("tool")})
    call = await client.recv()
    assert call["type"] == "tool_call", call
    assert call["tool_call"] == {
        "id": "call-1",
        "name": "get_location",
        "arguments": {"query": "current"},
        "consent_message": "Allow location access?",
        "categories": ["location"],
    }
    return call


def reported(frames: list[dict[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(text_of(frames))
    return result


async def test_client_tool_result_reaches_the_runtime(connect: Connect) -> None:
    client = await connect()
    await start_tool(client)
    await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": "call-1"}})
    await client.send(
        {"type": "tool_result", "tool_result": {"call_id": "call-1", "result": {"city": "Oslo"}}}
    )
    frames = await client.turn()
    assert reported(frames) == {
        "call_id": "call-1",
        "result_json": '{"city":"Oslo"}',
        "is_rejected": False,
        "rejection_reason": "",
    }
    assert frames[-1]["type"] == "done"


async def test_client_tool_nack_reaches_the_runtime_as_a_rejection(connect: Connect) -> None:
    client = await connect()
    await start_tool(client)
    nack = {"call_id": "call-1", "reason": "the user said no"}
    await client.send({"type": "tool_call_nack", "tool_call_nack": nack})
    report = reported(await client.turn())
    assert (report["is_rejected"], report["rejection_reason"]) == (True, "the user said no")


async def test_client_tool_timeout_reaches_the_runtime_as_a_rejection(connect: Connect) -> None:
    client = await connect()
    await start_tool(client)
    frames = await client.turn()
    report = reported(frames)
    assert (report["is_rejected"], report["rejection_reason"]) == (True, TIMED_OUT)


async def test_server_tool_calls_are_never_forwarded(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    frames = await client.ask("hi", **scenario("server_tool"))
    assert [f["type"] for f in frames] == ["chunk", "done"]
    assert frames[-1]["content"] == "after the server tool"


async def test_media_chunks_stream_to_the_client(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    frames = await client.ask("hi", **scenario("media"))
    media = [f["media_chunk"] for f in frames if f["type"] == "media_chunk"]
    assert [(m["media_id"], m["sequence"], m["is_last"]) for m in media] == [
        ("m1", 0, False),
        ("m1", 1, False),
        ("m1", 2, True),
    ]
    assert {m["mime_type"] for m in media} == {"audio/pcm"}
    assert frames[-1] == {
        "type": "done",
        "session_id": frames[-1]["session_id"],
        "content": "listen",
    }


async def test_message_metadata_parts_and_consent_grants_reach_the_runtime(
    connect: Connect,
) -> None:
    client = await connect()
    session_id = (await client.connected())["session_id"]
    metadata = {"mock_scenario": "meta", "ticket": "T-1", "omnia.consent_grants": "location,camera"}
    image = {"url": "https://example.com/a.png", "mime_type": "image/png"}
    parts = [{"type": "text", "text": "look"}, {"type": "image", "media": image}]
    frames = await client.ask("hi", metadata=metadata, parts=parts)
    report = reported(frames)
    assert report["session_id"] == session_id
    assert report["content"] == "hi"
    # Reserved keys (`mock_scenario`, `omnia.*`) reach the runtime with the others, and
    # Portico's offer to answer memory calls (docs/runtime-grpc.md, "Agent memory").
    assert report["metadata"] == {**metadata, "portico.memory": "1"}
    assert report["consent_grants"] == ["location", "camera"]
    assert report["parts"] == [
        {"type": "text", "text": "look", "url": "", "mime_type": ""},
        {"type": "image", "text": "", "url": image["url"], "mime_type": "image/png"},
    ]
    assert report["authorization"] == ""  # no token configured


async def test_a_conversation_keeps_one_stream_across_turns(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    counts = [reported(await client.ask("hi", **scenario("meta")))["turns_on_stream"] for _ in "ab"]
    assert counts == [1, 2]


@pytest.mark.parametrize(
    ("name", "code", "message"),
    [
        ("error_passed", "PROVIDER_UNAVAILABLE", "runtime says no"),
        ("error_masked", "INTERNAL_ERROR", "internal error"),
    ],
)
async def test_runtime_error_codes_pass_or_are_masked(
    connect: Connect, name: str, code: str, message: str
) -> None:
    client = await connect()
    await client.connected()
    error = await one_failed_turn(client, name)
    assert (error["error"]["code"], error["error"]["message"]) == (code, message)


# -- failures: one terminal frame each, and the next turn works ---------------------------


@pytest.mark.parametrize(
    "name",
    ["silent", "stall", "empty", "bad_args", "media_gap", "abort", "end_stream", "undecodable"],
)
async def test_a_failing_runtime_ends_the_turn_once_and_the_next_turn_works(
    connect_short: Connect, short_server: ServerProcess, name: str
) -> None:
    client = await connect_short()
    await client.connected()
    error = await one_failed_turn(client, name)
    assert error["error"] == {"code": "INTERNAL_ERROR", "message": "internal error"}
    frames = await client.ask("again", **scenario("stream"))
    assert frames[-1]["content"] == REPLY
    # A runtime that misbehaves is a WARNING line naming the cause, not a traceback.
    assert "Traceback" not in short_server.log_text()


async def test_a_done_after_an_error_is_ignored(connect_short: Connect) -> None:
    client = await connect_short()
    await client.connected()
    error = await one_failed_turn(client, "error_then_done")
    assert error["error"] == {"code": "PROVIDER_RATE_LIMITED", "message": "slow down"}
    # The stray `done` did not end the next turn: it has its own reply.
    frames = await client.ask("again", **scenario("stream"))
    assert frames[-1]["content"] == REPLY


async def test_an_unreachable_runtime_fails_the_turn_and_logs_the_cause(
    connect_short: Connect, short_server: ServerProcess
) -> None:
    client = await connect_short("?agent=nowhere")
    await client.connected()
    error = await one_failed_turn(client, "stream")
    assert error["error"]["code"] == "INTERNAL_ERROR"
    line = next(
        line for line in short_server.log_text().splitlines() if "runtime unreachable" in line
    )
    assert "agent=nowhere" in line
    assert "connection refused" in line


# -- resume and readiness ------------------------------------------------------------------


async def test_has_conversation_decides_ws_resumes(
    connect_short: Connect, short_runtime: RuntimeProcess
) -> None:
    first = await connect_short()
    session_id = (await first.connected())["session_id"]
    assert (await first.ask("hi", **scenario("stream")))[-1]["content"] == REPLY
    other = await connect_short()
    await other.connected()
    resumed = await other.ask("hi", session_id=session_id, **scenario("stream"))
    assert resumed[-1]["type"] == "done"
    try:
        short_runtime.control(resume="unavailable")
        refused = await other.ask("hi", session_id=session_id)
        assert refused[-1]["error"]["code"] == "INTERNAL_ERROR"
        short_runtime.control(resume="unimplemented")
        passed = await other.ask("hi", session_id=session_id, **scenario("stream"))
        assert passed[-1]["type"] == "done"
        short_runtime.control(resume="normal", forget=True)
        expired = await other.ask("hi", session_id=session_id)
        assert expired[-1]["error"]["code"] == "SESSION_EXPIRED"
    finally:
        short_runtime.control(resume="normal")


async def test_resumes_do_not_ask_a_runtime_that_does_not_own_the_context(
    connect: Connect, runtime: RuntimeProcess
) -> None:
    first = await connect()
    session_id = (await first.connected())["session_id"]
    await first.ask("hi", **scenario("stream"))
    other = await connect()
    await other.connected()
    try:
        runtime.control(resume="unavailable")
        frames = await other.ask("hi", session_id=session_id, **scenario("stream"))
    finally:
        runtime.control(resume="normal")
    assert frames[-1]["content"] == REPLY


async def readyz(http: aiohttp.ClientSession, server: ServerProcess) -> tuple[int, Any]:
    async with http.get(server.http_url + "/readyz") as response:
        return response.status, await response.json()


async def until_ready_status(
    http: aiohttp.ClientSession, server: ServerProcess, status: int
) -> Any:
    async with asyncio.timeout(WAIT):
        while True:
            found, body = await readyz(http, server)
            if found == status:
                return body
            await asyncio.sleep(0.05)


async def test_readyz_reflects_the_runtime_health(
    http: aiohttp.ClientSession, short_server: ServerProcess, short_runtime: RuntimeProcess
) -> None:
    await until_ready_status(http, short_server, 200)
    try:
        short_runtime.control(healthy=False, status="model not loaded")
        body = await until_ready_status(http, short_server, 503)
        # `nowhere` is unreachable too, but readiness does not depend on it.
        assert (body["status"], body["agents"]) == (
            "runtime unhealthy",
            {"default": "model not loaded"},
        )
    finally:
        short_runtime.control(healthy=True, status="ok")
    body = await until_ready_status(http, short_server, 200)
    assert body["status"] == "ready"
    assert "agents" not in body


# -- /v1/session and /v1/rpc ----------------------------------------------------------------


async def test_session_protocol_streams_and_forwards_tool_answers(
    http: aiohttp.ClientSession, grpc_server: ServerProcess
) -> None:
    probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{grpc_server.port}/v1/session")
    assert (await probe.hello(capabilities=["tools"]))["type"] == "ready"
    await probe.message("hi", **scenario("stream"))
    frames = await probe.turn()
    assert streamed_text(frames) == "Hello from gRPC"
    assert frame_kinds(frames) == ["chunk", "done"]
    assert frames[-1]["content"] == REPLY
    await probe.message("where", **scenario("tool"))
    call = await probe.recv_numbered()
    assert (call["type"], call["tool_call"]["id"]) == ("tool_call", "call-1"), call
    await probe.numbered("tool_call_nack", call_id="call-1", reason="not now")
    report = reported(await probe.turn())
    assert (report["is_rejected"], report["rejection_reason"]) == (True, "not now")


async def test_rpc_streams_and_forwards_rtc_results(
    http: aiohttp.ClientSession, grpc_server: ServerProcess
) -> None:
    probe = await RpcProbe.open(http, f"ws://127.0.0.1:{grpc_server.port}/v1/rpc")
    sent = await probe.call(
        "v1.message.send",
        {"content_data": "x", "client_id": "c-grpc-1", "metadata": {"mock_scenario": "tool"}},
    )
    await probe.until(lambda p: any(r["status"] == "sent" for r in p.entities("rtc")))
    rtc = next(r for r in probe.entities("rtc") if r["status"] == "sent")
    assert (rtc["name"], rtc["arguments"]) == ("get_location", {"query": "current"})
    await probe.call(
        "v1.rtc.submit_result", {"rtc_id": rtc["id"], "success": True, "result": {"city": "Rome"}}
    )
    turn = await probe.wait_turn_end(sent["session_id"])
    assert turn["status"] == "completed"
    final = [
        m
        for m in probe.entities("message")
        if m["status"] == "completed" and m["content_type"] == "markdown"
    ]
    report = json.loads(final[-1]["content_data"])
    assert (report["result_json"], report["is_rejected"]) == ('{"city":"Rome"}', False)


PCM = {"codec": "pcm16", "sample_rate": 24000, "channels": 1}


async def open_session(
    http: aiohttp.ClientSession, server: ServerProcess, **hello: Any
) -> SessionProbe:
    probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
    assert (await probe.hello(**hello))["type"] == "ready"
    return probe


async def test_session_protocol_media_parts_metadata_and_errors(
    http: aiohttp.ClientSession, grpc_server: ServerProcess
) -> None:
    probe = await open_session(http, grpc_server, capabilities=["audio"], audio={"output": [PCM]})
    await probe.message("sound", **scenario("media"))
    frames = await probe.turn()
    assert [f["type"] for f in frames] == ["chunk", "audio_start", "audio_end", "done"]
    assert [(b.sequence, b.is_last, b.payload) for b in probe.binary] == [
        (0, False, b"\x00" * 4),
        (1, False, b"\x01" * 4),
        (2, True, b"\x02" * 4),
    ]
    await probe.message("final", **scenario("final"))
    done = (await probe.turn())[-1]
    assert (done["content"], [p["type"] for p in done["parts"]]) == ("FINAL", ["text", "image"])
    metadata = {"mock_scenario": "meta", "omnia.consent_grants": "camera"}
    await probe.message("m", metadata=metadata, parts=[{"type": "text", "text": "t"}])
    report = reported(await probe.turn())
    offered = {**metadata, "portico.memory": "1"}
    assert (report["metadata"], report["consent_grants"]) == (offered, ["camera"])
    assert report["parts"] == [{"type": "text", "text": "t", "url": "", "mime_type": ""}]
    await probe.message("e", **scenario("error_passed"))
    error = (await probe.turn())[-1]
    assert (error["type"], error["error"]["code"]) == ("error", "PROVIDER_UNAVAILABLE")


async def until_streams(runtime: RuntimeProcess, session_id: str, count: int) -> None:
    """Wait until the runtime has `count` streams of the session open."""
    async with asyncio.timeout(WAIT):
        while True:
            state = await asyncio.to_thread(runtime.control)
            if state["open_streams"].get(session_id, 0) == count:
                return
            await asyncio.sleep(0.05)


async def test_a_sessions_stream_closes_when_the_session_ends(
    http: aiohttp.ClientSession, grpc_server: ServerProcess, runtime: RuntimeProcess
) -> None:
    probe = await open_session(http, grpc_server)
    await probe.message("hi", **scenario("stream"))
    await probe.turn()
    session_id = probe.received[0]["session_id"]
    await until_streams(runtime, session_id, 1)  # kept between turns
    await probe.numbered("end")
    await until_streams(runtime, session_id, 0)
    rpc = await RpcProbe.open(http, f"ws://127.0.0.1:{grpc_server.port}/v1/rpc")
    turn, _ = await rpc_turn(rpc, "stream", "c-grpc-close")
    await until_streams(runtime, turn["session_id"], 1)
    await rpc.call("v1.session.close", {"session_id": turn["session_id"]})
    await until_streams(runtime, turn["session_id"], 0)


async def test_an_interrupted_turn_ends_once_and_its_stream_is_dropped(
    http: aiohttp.ClientSession, grpc_server: ServerProcess, runtime: RuntimeProcess
) -> None:
    probe = await open_session(http, grpc_server)
    session_id = probe.received[0]["session_id"]
    await probe.message("go", **scenario("hang_mid"))
    assert (await probe.recv_numbered())["content"] == "working"
    await probe.numbered("interrupt")
    frames = await probe.turn()
    assert [(f["type"], f.get("cancelled")) for f in frames] == [("done", True)]
    # The runtime may still be in that turn: its stream must not carry the next one.
    await until_streams(runtime, session_id, 0)
    await probe.message("again", **scenario("stream"))
    assert (await probe.turn())[-1]["content"] == REPLY


async def rpc_turn(probe: RpcProbe, name: str, client_id: str) -> tuple[dict[str, Any], str]:
    """Send a message playing scenario `name`; its ended turn and its reply's content."""
    sent = await probe.call(
        "v1.message.send",
        {"content_data": "x", "client_id": client_id, "metadata": {"mock_scenario": name}},
    )
    turn = await probe.wait_turn_end(sent["session_id"])
    replies = [
        m
        for m in probe.entities("message")
        if m["session_id"] == sent["session_id"] and m["content_type"] == "markdown"
    ]
    return turn, str(replies[-1]["content_data"]) if replies else ""


async def test_rpc_turns_carry_the_reply_usage_and_error_codes(
    http: aiohttp.ClientSession, grpc_server: ServerProcess
) -> None:
    probe = await RpcProbe.open(http, f"ws://127.0.0.1:{grpc_server.port}/v1/rpc")
    turn, reply = await rpc_turn(probe, "stream", "c-grpc-stream")
    assert (turn["status"], reply) == ("completed", REPLY)
    assert turn["usage"] == {"input_tokens": 3, "output_tokens": 5}
    turn, _ = await rpc_turn(probe, "error_passed", "c-grpc-passed")
    assert (turn["status"], turn["error"]["code"]) == ("failed", "PROVIDER_UNAVAILABLE")
    turn, _ = await rpc_turn(probe, "error_masked", "c-grpc-masked")
    assert turn["error"] == {"code": "INTERNAL_ERROR", "message": "internal error"}


FAILURES = ["silent", "stall", "empty", "abort", "end_stream", "undecodable"]


@pytest.mark.parametrize("name", FAILURES)
async def test_a_failing_runtime_ends_a_session_turn_once_and_the_next_turn_works(
    http: aiohttp.ClientSession, short_server: ServerProcess, name: str
) -> None:
    probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{short_server.port}/v1/session")
    assert (await probe.hello())["type"] == "ready"
    await probe.message("go", **scenario(name))
    frames = await probe.turn()
    assert frames[-1]["type"] == "error", frames
    assert frames[-1]["error"]["code"] == "INTERNAL_ERROR"
    # A second terminal frame of the failed turn would end this read before the reply.
    await probe.message("again", **scenario("stream"))
    frames = await probe.turn()
    assert [f["type"] for f in frames if f["type"] in ("done", "error")] == ["done"], frames
    assert frames[-1]["content"] == REPLY
    await probe.ws.close()


@pytest.mark.parametrize("name", FAILURES)
async def test_a_failing_runtime_ends_an_rpc_turn_once_and_the_next_turn_works(
    http: aiohttp.ClientSession, short_server: ServerProcess, name: str
) -> None:
    probe = await RpcProbe.open(http, f"ws://127.0.0.1:{short_server.port}/v1/rpc")
    turn, _ = await rpc_turn(probe, name, f"c-fail-{name}")
    assert (turn["status"], turn["error"]["code"]) == ("failed", "INTERNAL_ERROR")
    turn, reply = await rpc_turn(probe, "stream", f"c-after-{name}")
    assert (turn["status"], reply) == ("completed", REPLY)
    await probe.ws.close()


# -- the runtime's process dies, TLS, bearer tokens --------------------------------------


@pytest.fixture
async def killable(
    tmp_path: Path, http: aiohttp.ClientSession
) -> AsyncIterator[tuple[RuntimeProcess, ServerProcess]]:
    runtime = RuntimeProcess(tmp_path / "runtime.log").start()
    server = ServerProcess(tmp_path / "portico", env=grpc_env(runtime)).start()
    yield runtime, server
    server.stop()
    runtime.stop()


async def test_killing_the_runtime_mid_turn_fails_the_turn_and_a_restart_serves_the_next(
    killable: tuple[RuntimeProcess, ServerProcess], http: aiohttp.ClientSession
) -> None:
    runtime, server = killable
    client = OmniaClient(await http.ws_connect(server.ws_url))
    await client.connected()
    await client.send({"type": "message", "content": "go", **scenario("hang_mid")})
    assert (await client.recv())["content"] == "working"
    runtime.kill()
    frames = await client.turn()
    assert [f["type"] for f in terminal(frames)] == ["error"]
    await client.expect_silence()
    runtime.start()  # the same port
    assert (await client.ask("again", **scenario("stream")))[-1]["content"] == REPLY


TOKEN = "s3cret-runtime-token"


@pytest.fixture(scope="module")
def tls_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RuntimeProcess, Path]]:
    folder = tmp_path_factory.mktemp("grpc-tls")
    ca, cert, key = make_certificates(folder)
    process = RuntimeProcess(folder / "runtime.log", token=TOKEN, tls=(cert, key)).start()
    yield process, ca
    process.stop()


async def test_tls_with_a_private_ca_and_a_bearer_token_that_is_never_logged(
    tmp_path: Path, http: aiohttp.ClientSession, tls_runtime: tuple[RuntimeProcess, Path]
) -> None:
    runtime, ca = tls_runtime
    env = grpc_env(
        runtime,
        PORTICO_GRPC_TLS="true",
        PORTICO_GRPC_CA_FILE=str(ca),
        PORTICO_GRPC_TOKEN_ENV="RUNTIME_TOKEN",
        RUNTIME_TOKEN=TOKEN,
    )
    server = ServerProcess(tmp_path / "portico", env=env).start()
    try:
        client = OmniaClient(await http.ws_connect(server.ws_url))
        await client.connected()
        report = reported(await client.ask("hi", **scenario("meta")))
        assert report["authorization"] == f"Bearer {TOKEN}"
        assert (await readyz(http, server))[0] == 200
    finally:
        server.stop()
    assert "grpc stream opened" in server.log_text()
    assert TOKEN not in server.log_text()


@pytest.mark.parametrize("with_ca", [False, True])
async def test_a_runtime_the_facade_cannot_trust_or_authenticate_fails_the_turn(
    tmp_path: Path,
    http: aiohttp.ClientSession,
    tls_runtime: tuple[RuntimeProcess, Path],
    with_ca: bool,
) -> None:
    """No CA: the certificate is not trusted. The CA but no token: unauthenticated."""
    runtime, ca = tls_runtime
    agent: dict[str, Any] = {
        "runtime": "grpc",
        "grpc_target": runtime.target,
        "grpc_tls": True,
        "grpc_connect_timeout": SHORT,
    }
    if with_ca:
        agent["grpc_ca_file"] = str(ca)
    config = tmp_path / "portico.yaml"
    config.write_text(yaml.safe_dump({"agents": {"default": agent}}))
    server = ServerProcess(tmp_path / "portico", args=("--config", str(config))).start()
    try:
        client = OmniaClient(await http.ws_connect(server.ws_url))
        await client.connected()
        error = await one_failed_turn(client, "stream")
        assert error["error"]["code"] == "INTERNAL_ERROR"
        status, body = await readyz(http, server)
    finally:
        server.stop()
    expected = "unauthenticated" if with_ca else "TLS handshake failed"
    assert status == 503
    assert expected in body["agents"]["default"], body
    failed = [line for line in server.log_text().splitlines() if "grpc turn failed" in line]
    assert expected in failed[0], failed
