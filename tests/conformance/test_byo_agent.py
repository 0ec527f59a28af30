"""Bring your own agent: ONE SDK handler (tests/support/byo_agent.py) passing the SAME
tests in both of its placements, against real processes, over `/ws`, `/v1/session` and
`/v1/rpc`:

- `python`: in Portico's process (`runtime: python`, `plugin: support.byo_agent:handler`);
- `grpc`: in its own (`portico agent serve support.byo_agent:handler`), behind
  `portico serve` with `runtime: grpc`.

What only one placement has is tested there alone, with the reason: `HasConversation`
(a `/ws` resume asks the runtime only when it owns the context, which only a gRPC agent
can) and the agent process dying (in process there is no second process to kill).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import yaml

from support import byo_agent
from support.agent_process import REPO, TESTS, AgentProcess
from support.archive import open_archive
from support.frames import frame_kinds, streamed_text
from support.omnia import OmniaClient
from support.rpc import RpcProbe
from support.server import ServerProcess
from support.session import SessionProbe

HANDLER = "support.byo_agent:handler"
PLACEMENTS = ("python", "grpc")
TOOL_ACK_TIMEOUT = 0.5
CLIENT_TOOL_TIMEOUT = 2.0
TIMED_OUT = "the client did not answer the tool call in time"
STREAMED = "".join(byo_agent.WORDS)
WAIT = 10.0
PCM = {"codec": "pcm16", "sample_rate": 24000, "channels": 1}


class Placement:
    """One `portico serve` whose default agent is the handler, hosted one way."""

    def __init__(self, name: str, server: ServerProcess, agent: AgentProcess | None) -> None:
        self.name = name
        self.server = server
        self.agent = agent

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.server.port}"


def start_placement(name: str, data_dir: Any, **agent_settings: Any) -> Placement:
    agent: AgentProcess | None = None
    settings: dict[str, Any] = {"runtime": name, **agent_settings}
    if name == "python":
        settings["plugin"] = HANDLER
    else:
        agent = AgentProcess(HANDLER, data_dir / "agent.log").start()
        settings["grpc_target"] = agent.target
    config = data_dir / "portico.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "tool_ack_timeout": TOOL_ACK_TIMEOUT,
                "client_tool_timeout": CLIENT_TOOL_TIMEOUT,
                "agents": {"default": settings},
            }
        )
    )
    env = {"PYTHONPATH": f"{TESTS}:{REPO}"}  # the plugin is importable in process too
    server = ServerProcess(data_dir, args=("--config", str(config)), env=env).start()
    return Placement(name, server, agent)


def stop_placement(placement: Placement) -> None:
    placement.server.stop()
    if placement.agent is not None:
        placement.agent.stop()


@pytest.fixture(scope="module", params=PLACEMENTS)
def placement(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Placement]:
    started = start_placement(request.param, tmp_path_factory.mktemp(f"byo-{request.param}"))
    yield started
    stop_placement(started)


# -- clients ---------------------------------------------------------------------------------


async def omnia(http: aiohttp.ClientSession, placement: Placement) -> OmniaClient:
    client = OmniaClient(await http.ws_connect(placement.url + "/ws"))
    await client.connected()
    return client


async def session(http: aiohttp.ClientSession, placement: Placement, **hello: Any) -> SessionProbe:
    probe = await SessionProbe.connect(http, placement.url + "/v1/session")
    hello.setdefault("capabilities", ["tools"])
    ready = await probe.hello(**hello)
    assert ready["type"] == "ready", ready
    return probe


async def rpc(http: aiohttp.ClientSession, placement: Placement) -> RpcProbe:
    return await RpcProbe.open(http, placement.url + "/v1/rpc")


def terminals(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [f for f in frames if f["type"] in ("done", "error")]


async def ws_tool_call(client: OmniaClient, text: str) -> dict[str, Any]:
    """Send `text` (a tool turn); the client tool call that comes back."""
    await client.send({"type": "message", "content": text})
    call = await client.recv()
    assert call["type"] == "tool_call", call
    tool_call: dict[str, Any] = call["tool_call"]
    return tool_call


# -- /ws -------------------------------------------------------------------------------------


async def test_ws_streams_the_chunks_and_records_the_usage(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    client = await omnia(http, placement)
    frames = await client.ask("stream")
    assert streamed_text(frames) == "".join(byo_agent.WORDS)
    assert frame_kinds(frames) == ["chunk", "done"]
    (done,) = terminals(frames)
    assert (done["type"], done["content"]) == ("done", STREAMED)
    async with open_archive(placement.server.archive_path) as store:
        (turn,) = await store.list_turns(done["session_id"])
    # Yielded usages add up; cost is not kept (the Runtime port has no place for it).
    assert (turn.input_tokens, turn.output_tokens) == (3, 4)


async def test_ws_client_tool_call_and_its_result_reach_the_handler(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    client = await omnia(http, placement)
    call = await ws_tool_call(client, "tool street")
    assert (call["name"], call["arguments"]) == ("get_location", {"precision": "street"})
    assert (call["consent_message"], call["categories"]) == (
        "May I read your location?",
        ["location"],
    )
    await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call["id"]}})
    result = {"call_id": call["id"], "result": {"city": "Oslo"}}
    await client.send({"type": "tool_result", "tool_result": result})
    (done,) = terminals(await client.turn())
    assert done["content"] == 'result:{"city": "Oslo"}'


async def ws_refused(client: OmniaClient, how: str, reason: str) -> str:
    """A tool turn whose call the client nacks or fails with `reason`; the reply."""
    call = await ws_tool_call(client, "tool")
    if how == "nack":
        nack = {"call_id": call["id"], "reason": reason}
        await client.send({"type": "tool_call_nack", "tool_call_nack": nack})
    else:
        await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call["id"]}})
        error = {"call_id": call["id"], "error": reason}
        await client.send({"type": "tool_result", "tool_result": error})
    content: str = terminals(await client.turn())[0]["content"]
    return content


async def test_ws_client_tool_nack_error_and_timeout_reach_the_handler_as_rejections(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    client = await omnia(http, placement)
    assert await ws_refused(client, "nack", "the user said no") == "rejected:the user said no"
    assert await ws_refused(client, "error", "no GPS") == "rejected:no GPS"
    await ws_tool_call(client, "tool")  # never acked: the broker's ack timeout answers
    (done,) = terminals(await client.turn())
    assert done["content"] == f"rejected:{TIMED_OUT}"


async def test_ws_a_nack_or_error_without_a_reason_is_a_rejection_without_one(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    client = await omnia(http, placement)
    assert await ws_refused(client, "nack", "") == "rejected:"
    assert await ws_refused(client, "error", "") == "rejected:"


async def test_ws_a_result_that_reads_as_a_client_error_is_a_rejection_in_both_places(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    # Over gRPC the facade encodes a client's error as this very result (the contract has
    # no error answer), so the SDK cannot tell them apart; in process it must not either.
    client = await omnia(http, placement)
    call = await ws_tool_call(client, "tool")
    await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call["id"]}})
    result = {"call_id": call["id"], "result": {"error": "out of range"}}
    await client.send({"type": "tool_result", "tool_result": result})
    assert terminals(await client.turn())[0]["content"] == "rejected:out of range"


async def test_ws_media_streams_in_numbered_pieces(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    client = await omnia(http, placement)
    frames = await client.ask("media")
    media = [f["media_chunk"] for f in frames if f["type"] == "media_chunk"]
    assert [(m["media_id"], m["sequence"], m["is_last"]) for m in media] == [
        ("clip-1", 0, False),
        ("clip-1", 1, True),
    ]
    assert {m["mime_type"] for m in media} == {"audio/pcm"}
    assert b"".join(base64.b64decode(m["data"]) for m in media) == byo_agent.MEDIA_BYTES
    (done,) = terminals(frames)
    assert done["content"] == "listen"


async def test_ws_parts_are_the_replys_after_its_text(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    client = await omnia(http, placement)
    (done,) = terminals(await client.ask("parts"))
    assert done["content"] == "see the picture"
    assert done["parts"] == [
        {"type": "text", "text": "a caption"},
        {"type": "image", "media": {"url": byo_agent.IMAGE_URL, "mime_type": "image/png"}},
    ]


async def test_ws_the_handler_gets_text_parts_metadata_consent_and_history(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    client = await omnia(http, placement)
    await client.ask("stream")
    metadata = {"ticket": "T-1", "omnia.consent_grants": "location, camera"}
    image = {"url": "https://example.com/a.png", "mime_type": "image/png"}
    parts = [{"type": "text", "text": "report"}, {"type": "image", "media": image}]
    frames = await client.ask("report", metadata=metadata, parts=parts)
    seen = json.loads(streamed_text(frames))
    assert seen == {
        "session_id": frames[-1]["session_id"],
        "text": "report",
        "parts": [["text", "report", None], ["image", None, image["url"]]],
        "metadata": metadata,  # reserved keys (`omnia.*`) included
        "consent_grants": ["location", "camera"],
        "history": [["user", "stream"], ["assistant", STREAMED]],
    }


@pytest.mark.parametrize(
    ("text", "code", "message"),
    [
        ("fail PROVIDER_UNAVAILABLE", "PROVIDER_UNAVAILABLE", "the agent failed on purpose"),
        ("fail MY_OWN_CODE", "INTERNAL_ERROR", "internal error"),
        ("crash", "INTERNAL_ERROR", "internal error"),
    ],
)
async def test_ws_errors_pass_through_or_are_masked_once(
    http: aiohttp.ClientSession, placement: Placement, text: str, code: str, message: str
) -> None:
    client = await omnia(http, placement)
    frames = await client.ask(text)
    assert streamed_text(frames) == "partial "
    (error,) = terminals(frames)
    assert (error["type"], error["error"]["code"], error["error"]["message"]) == (
        "error",
        code,
        message,
    )
    await client.expect_silence()
    assert terminals(await client.ask("stream"))[0]["content"] == STREAMED


async def test_ws_a_failed_turn_is_in_the_history_with_the_text_it_streamed(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    client = await omnia(http, placement)
    await client.ask("fail PROVIDER_UNAVAILABLE")
    await client.ask("crash")
    frames = await client.ask("report")
    # In process the history is the archive's; the gRPC agent keeps its own the same way.
    assert json.loads(streamed_text(frames))["history"] == [
        ["user", "fail PROVIDER_UNAVAILABLE"],
        ["assistant", "partial "],
        ["user", "crash"],
        ["assistant", "partial "],
    ]


# -- /v1/session -----------------------------------------------------------------------------


async def test_session_streams_and_answers_tools_with_result_nack_and_error(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    probe = await session(http, placement)
    await probe.message("stream")
    frames = await probe.turn()
    assert streamed_text(frames) == "".join(byo_agent.WORDS)
    assert frame_kinds(frames) == ["chunk", "done"]
    assert (frames[-1]["type"], frames[-1]["content"]) == ("done", STREAMED)
    answers = [
        ("tool_result", {"result": "Rome"}, 'result:"Rome"'),
        ("tool_call_nack", {"reason": "not now"}, "rejected:not now"),
        ("tool_result", {"error": "no GPS"}, "rejected:no GPS"),
    ]
    for kind, fields, expected in answers:
        await probe.message("tool")
        call = await probe.recv_numbered()
        assert call["type"] == "tool_call", call
        assert call["tool_call"]["name"] == "get_location"
        await probe.numbered(kind, call_id=call["tool_call"]["id"], **fields)
        done = (await probe.turn())[-1]
        assert (done["type"], done["content"]) == ("done", expected)


async def test_session_media_parts_and_errors(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    probe = await session(http, placement, capabilities=["audio"], audio={"output": [PCM]})
    await probe.message("media")
    frames = await probe.turn()
    assert [f["type"] for f in frames] == ["chunk", "audio_start", "audio_end", "done"]
    assert [(b.sequence, b.is_last) for b in probe.binary] == [(0, False), (1, True)]
    assert b"".join(b.payload for b in probe.binary) == byo_agent.MEDIA_BYTES
    await probe.message("parts")
    done = (await probe.turn())[-1]
    assert (done["content"], [p["type"] for p in done["parts"]]) == (
        "see the picture",
        ["text", "image"],
    )
    await probe.message("fail PROVIDER_RATE_LIMITED")
    frames = await probe.turn()
    assert [f["type"] for f in frames] == ["chunk", "error"]
    assert frames[-1]["error"]["code"] == "PROVIDER_RATE_LIMITED"
    await probe.message("stream")
    assert (await probe.turn())[-1]["content"] == STREAMED


# -- /v1/rpc ---------------------------------------------------------------------------------


async def rpc_send(probe: RpcProbe, text: str, client_id: str) -> str:
    sent = await probe.call("v1.message.send", {"content_data": text, "client_id": client_id})
    return str(sent["session_id"])


def rpc_replies(probe: RpcProbe, session_id: str) -> list[dict[str, Any]]:
    return [
        m
        for m in probe.entities("message")
        if m["session_id"] == session_id
        and m["status"] == "completed"
        and m["content_type"] == "markdown"
    ]


async def test_rpc_turns_carry_the_reply_usage_and_error_codes(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    probe = await rpc(http, placement)
    session_id = await rpc_send(probe, "stream", f"c-{placement.name}-stream")
    turn = await probe.wait_turn_end(session_id)
    assert (turn["status"], turn["usage"]) == (
        "completed",
        {"input_tokens": 3, "output_tokens": 4},
    )
    assert rpc_replies(probe, session_id)[-1]["content_data"] == STREAMED
    session_id = await rpc_send(probe, "fail PROVIDER_UNAVAILABLE", f"c-{placement.name}-pass")
    turn = await probe.wait_turn_end(session_id)
    assert (turn["status"], turn["error"]["code"]) == ("failed", "PROVIDER_UNAVAILABLE")
    session_id = await rpc_send(probe, "crash", f"c-{placement.name}-crash")
    turn = await probe.wait_turn_end(session_id)
    assert turn["error"] == {"code": "INTERNAL_ERROR", "message": "internal error"}


async def test_rpc_the_reply_carries_its_parts_and_the_handler_its_metadata(
    http: aiohttp.ClientSession, placement: Placement
) -> None:
    probe = await rpc(http, placement)
    session_id = await rpc_send(probe, "parts", f"c-{placement.name}-parts")
    assert (await probe.wait_turn_end(session_id))["status"] == "completed"
    (reply,) = rpc_replies(probe, session_id)
    assert reply["content_data"] == "see the picture"
    assert reply["parts"] == [
        {"type": "text", "text": "a caption"},
        {"type": "image", "media": {"url": byo_agent.IMAGE_URL, "mime_type": "image/png"}},
    ]
    params = {
        "content_data": "report",
        "client_id": f"c-{placement.name}-report",
        "metadata": {"ticket": "T-2"},
        "agent_prompt": "be brief",
    }
    session_id = (await probe.call("v1.message.send", params))["session_id"]
    assert (await probe.wait_turn_end(session_id))["status"] == "completed"
    seen = json.loads(rpc_replies(probe, session_id)[-1]["content_data"])
    assert seen["metadata"] == {"ticket": "T-2", "portico.agent_prompt": "be brief"}


async def rpc_tool_turn(probe: RpcProbe, client_id: str) -> tuple[str, dict[str, Any]]:
    session_id = await rpc_send(probe, "tool", client_id)

    def sent(p: RpcProbe) -> bool:
        return any(
            r["status"] == "sent" and r["session_id"] == session_id for r in p.entities("rtc")
        )

    await probe.until(sent)
    rtc = next(r for r in probe.entities("rtc") if r["session_id"] == session_id)
    return session_id, rtc


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({"success": True, "result": {"city": "Rome"}}, 'result:{"city": "Rome"}'),
        ({"success": False, "error": "no GPS"}, "rejected:no GPS"),
        (None, "rejected:rejected by the user"),
    ],
)
async def test_rpc_an_rtc_result_failure_or_rejection_reaches_the_handler(
    http: aiohttp.ClientSession,
    placement: Placement,
    answer: dict[str, Any] | None,
    expected: str,
) -> None:
    probe = await rpc(http, placement)
    session_id, rtc = await rpc_tool_turn(probe, f"c-{placement.name}-rtc-{expected[:12]}")
    assert (rtc["name"], rtc["arguments"], rtc["categories"]) == (
        "get_location",
        {"precision": "city"},
        ["location"],
    )
    if answer is None:
        await probe.call("v1.rtc.update_status", {"rtc_id": rtc["id"], "status": "rejected"})
    else:
        await probe.call("v1.rtc.submit_result", {"rtc_id": rtc["id"], **answer})
    turn = await probe.wait_turn_end(session_id)
    assert turn["status"] == "completed"
    assert rpc_replies(probe, session_id)[-1]["content_data"] == expected


# -- gRPC only: HasConversation and the agent's process dying ----------------------------------
#
# In process the handler shares Portico's life and Portico owns the context, so neither a
# resume question nor a dead agent exists there.


@pytest.fixture(scope="module")
def killable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Placement]:
    """A gRPC placement of its own (its agent is killed), owning the context."""
    started = start_placement(
        "grpc", tmp_path_factory.mktemp("byo-killable"), runtime_owns_context=True
    )
    yield started
    stop_placement(started)


async def test_has_conversation_of_the_sdk_agent_decides_ws_resumes(
    http: aiohttp.ClientSession, killable: Placement
) -> None:
    first = await omnia(http, killable)
    assert terminals(await first.ask("stream"))[0]["type"] == "done"
    session_id = first.frames[-1]["session_id"]
    other = await omnia(http, killable)
    # The agent answered a turn of it: RESUMABLE, and its memory is the history.
    frames = await other.ask("report", session_id=session_id)
    assert json.loads(streamed_text(frames))["history"] == [
        ["user", "stream"],
        ["assistant", STREAMED],
    ]
    assert killable.agent is not None
    killable.agent.stop()
    killable.agent.start()  # the same port; a fresh process remembers nothing
    late = await omnia(http, killable)
    (refused,) = terminals(await late.ask("stream", session_id=session_id))
    assert refused["error"]["code"] == "SESSION_EXPIRED"


async def until_live_chunk(probe: RpcProbe, delta: str) -> None:
    await probe.until(lambda p: any(live["delta"] == delta for live in p.live), WAIT)


async def test_killing_the_agent_mid_turn_ends_each_protocols_turn_once_and_a_restart_serves(
    http: aiohttp.ClientSession, killable: Placement
) -> None:
    assert killable.agent is not None
    agent = killable.agent
    # /ws
    client = await omnia(http, killable)
    await client.send({"type": "message", "content": "hold"})
    assert (await client.recv())["content"] == "working"
    agent.stop(9)
    (cut,) = terminals(await client.turn())
    assert (cut["type"], cut["error"]["code"]) == ("error", "INTERNAL_ERROR")
    await client.expect_silence()
    agent.start()
    assert terminals(await client.ask("stream"))[0]["content"] == STREAMED
    # /v1/session
    probe = await session(http, killable)
    await probe.message("hold")
    assert (await probe.recv_numbered())["content"] == "working"
    agent.stop(9)
    frames = await probe.turn()
    assert [f["type"] for f in frames] == ["error"]
    assert frames[0]["error"]["code"] == "INTERNAL_ERROR"
    agent.start()
    await probe.message("stream")
    after = await probe.turn()  # nothing more of the cut turn came before it
    assert frame_kinds(after) == ["chunk", "done"]
    assert streamed_text(after) == "".join(byo_agent.WORDS)
    assert after[-1]["content"] == STREAMED
    # /v1/rpc
    rpc_probe = await rpc(http, killable)
    session_id = await rpc_send(rpc_probe, "hold", "c-killed")
    await until_live_chunk(rpc_probe, "working")
    agent.stop(9)
    cut = await rpc_probe.wait_turn_end(session_id)
    assert (cut["status"], cut["error"]["code"]) == ("failed", "INTERNAL_ERROR")
    agent.start()
    next_session = await rpc_send(rpc_probe, "stream", "c-after-restart")
    assert (await rpc_probe.wait_turn_end(next_session))["status"] == "completed"
    # By then every update of the cut turn has arrived: it ended once.
    ends = [
        t["status"]
        for t in rpc_probe.entities("turn")
        if t["id"] == cut["id"]
        and t["status"] in ("completed", "failed", "cancelled", "interrupted")
    ]
    assert ends == ["failed"]
