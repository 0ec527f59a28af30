"""`portico agent serve` in its own process, driven by a raw `RuntimeServiceStub` over a
real grpc.aio channel: the server side of the runtime contract (docs/agents.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from portico.contract import runtime_pb2 as pb
from portico.contract import runtime_pb2_grpc as pb_grpc
from support.agent_process import AgentProcess
from support.agents import MEDIA_BYTES

WITHIN = 10.0
SHORT_TOOL_TIMEOUT = 0.3
Call = grpc.aio.StreamStreamCall


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    process = AgentProcess(
        "support.agents:handler", tmp_path_factory.mktemp("agent") / "agent.log"
    ).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def impatient_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """Tool calls time out fast here (the other agent's never do within a test)."""
    log = tmp_path_factory.mktemp("impatient") / "agent.log"
    args = ("--client-tool-timeout", str(SHORT_TOOL_TIMEOUT))
    process = AgentProcess("support.agents:handler", log, args=args).start()
    yield process
    process.stop()


@pytest.fixture
async def stub(agent: AgentProcess) -> AsyncIterator[pb_grpc.RuntimeServiceStub]:
    async with grpc.aio.insecure_channel(agent.target) as channel:
        yield pb_grpc.RuntimeServiceStub(channel)


async def send(call: Call, content: str = "hi", session_id: str = "s-1", **fields: object) -> None:
    metadata = fields.pop("metadata", {})
    await call.write(
        pb.ClientMessage(session_id=session_id, content=content, metadata=metadata, **fields)
    )


def scenario(name: str, **extra: str) -> dict[str, str]:
    return {"scenario": name, **extra}


async def read(call: Call) -> pb.ServerMessage:
    message = await asyncio.wait_for(call.read(), WITHIN)
    assert message is not grpc.aio.EOF, "the stream ended"
    assert isinstance(message, pb.ServerMessage)
    return message


async def read_turn(call: Call) -> list[pb.ServerMessage]:
    """Messages up to and including the turn's `done` or `error`."""
    messages = [await read(call)]
    while messages[-1].WhichOneof("message") not in ("done", "error"):
        messages.append(await read(call))
    return messages


def kinds(messages: list[pb.ServerMessage]) -> list[str | None]:
    return [message.WhichOneof("message") for message in messages]


def chunks(messages: list[pb.ServerMessage]) -> str:
    return "".join(m.chunk.content for m in messages if m.WhichOneof("message") == "chunk")


async def ask(call: Call, name: str, session_id: str = "s-1") -> list[pb.ServerMessage]:
    await send(call, session_id=session_id, metadata=scenario(name))
    return await read_turn(call)


async def test_text_streams_as_chunks_and_ends_with_one_done(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = stub.Converse()
    turn = await ask(call, "stream")
    # Yielded together, the words leave as one chunk (docs/agents.md).
    assert kinds(turn) == ["chunk", "done"]
    assert chunks(turn) == "one two three"
    assert turn[-1].done.final_content == "one two three"
    call.cancel()


async def test_a_client_tool_result_reaches_the_handler_as_a_value(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = stub.Converse()
    await send(call, metadata=scenario("tool"))
    tool_call = (await read(call)).tool_call
    assert (tool_call.name, tool_call.execution) == ("get_time", pb.TOOL_EXECUTION_CLIENT)
    assert json.loads(tool_call.arguments_json) == {"zone": "UTC"}
    assert tool_call.consent_message == "May I read your clock?"
    assert list(tool_call.categories) == ["time"]
    result = pb.ClientToolResult(call_id=tool_call.id, result_json='{"hour": 12}')
    await call.write(pb.ClientMessage(session_id="s-1", client_tool_result=result))
    turn = await read_turn(call)
    assert kinds(turn) == ["chunk", "done"]
    assert chunks(turn) == 'result:{"hour": 12}'
    call.cancel()


async def test_a_rejection_reaches_the_handler_with_its_reason(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = stub.Converse()
    await send(call, metadata=scenario("tool"))
    tool_call = (await read(call)).tool_call
    rejected = pb.ClientToolResult(
        call_id=tool_call.id, is_rejected=True, rejection_reason="denied by the user"
    )
    await call.write(pb.ClientMessage(session_id="s-1", client_tool_result=rejected))
    assert chunks(await read_turn(call)) == "rejected:denied by the user"
    call.cancel()


async def test_an_unanswered_tool_call_times_out_into_a_rejection(
    impatient_agent: AgentProcess,
) -> None:
    async with grpc.aio.insecure_channel(impatient_agent.target) as channel:
        call = pb_grpc.RuntimeServiceStub(channel).Converse()
        await send(call, metadata=scenario("tool"))
        assert kinds([await read(call)]) == ["tool_call"]
        turn = await read_turn(call)  # nobody answers: --client-tool-timeout
        assert kinds(turn) == ["chunk", "done"]
        assert chunks(turn) == "rejected:timed out"
        call.cancel()


async def test_parts_go_out_with_done(stub: pb_grpc.RuntimeServiceStub) -> None:
    call = stub.Converse()
    done = (await ask(call, "parts"))[-1].done
    assert done.final_content == "see the picture"
    assert [(part.type, part.text, part.media.url) for part in done.parts] == [
        ("image", "", "https://x.test/a.png"),
        ("text", "a caption", ""),
    ]
    assert done.parts[0].media.mime_type == "image/png"
    call.cancel()


async def test_media_streams_in_numbered_pieces(stub: pb_grpc.RuntimeServiceStub) -> None:
    call = stub.Converse()
    turn = await ask(call, "media")
    assert kinds(turn) == ["media_chunk", "media_chunk", "chunk", "done"]
    pieces = [message.media_chunk for message in turn[:2]]
    assert [(p.media_id, p.sequence, p.is_last, p.mime_type) for p in pieces] == [
        ("clip-1", 0, False, "audio/wav"),
        ("clip-1", 1, True, "audio/wav"),
    ]
    assert b"".join(piece.data for piece in pieces) == MEDIA_BYTES
    call.cancel()


async def test_usage_adds_up_into_done(stub: pb_grpc.RuntimeServiceStub) -> None:
    call = stub.Converse()
    usage = (await ask(call, "usage"))[-1].done.usage
    assert (usage.input_tokens, usage.output_tokens) == (4, 5)
    assert usage.cost_usd == pytest.approx(0.25)
    call.cancel()


async def test_an_agent_error_is_one_error_with_its_code(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = stub.Converse()
    turn = await ask(call, "agent_error")
    assert kinds(turn) == ["chunk", "error"]
    assert (turn[-1].error.code, turn[-1].error.message) == (
        "PROVIDER_UNAVAILABLE",
        "the model is down",
    )
    # The stream carries on: the next turn is answered.
    assert kinds(await ask(call, "stream"))[-1] == "done"
    call.cancel()


@pytest.mark.parametrize("name", ["crash", "bad_yield"])
async def test_a_handler_crash_is_one_generic_internal_error(
    stub: pb_grpc.RuntimeServiceStub, agent: AgentProcess, name: str
) -> None:
    call = stub.Converse()
    turn = await ask(call, name)
    assert kinds(turn)[-1] == "error"
    assert kinds(turn).count("error") == 1
    assert "done" not in kinds(turn)
    assert (turn[-1].error.code, turn[-1].error.message) == ("INTERNAL_ERROR", "internal error")
    assert kinds(await ask(call, "stream"))[-1] == "done"
    call.cancel()
    assert "agent handler raised" in agent.log_text()


async def test_health_reports_the_contract_version(stub: pb_grpc.RuntimeServiceStub) -> None:
    health = await stub.Health(pb.HealthRequest(), timeout=WITHIN)
    assert health.healthy is True
    assert health.contract_version == "1.3.0"
    assert "client_tools" in health.capabilities


async def test_has_conversation_knows_the_sessions_it_answered(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    unknown = await stub.HasConversation(
        pb.HasConversationRequest(session_id="s-never"), timeout=WITHIN
    )
    assert unknown.state == pb.RESUME_STATE_NOT_FOUND
    call = stub.Converse()
    await ask(call, "stream", session_id="s-known")
    call.cancel()
    known = await stub.HasConversation(
        pb.HasConversationRequest(session_id="s-known"), timeout=WITHIN
    )
    assert known.state == pb.RESUME_STATE_RESUMABLE


async def test_the_turn_carries_metadata_parts_grants_and_the_streams_history(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = stub.Converse()
    image = pb.ContentPart(type="image", media=pb.MediaContent(mime_type="image/png", url="u"))
    await send(
        call,
        "first",
        session_id="s-hist",
        metadata=scenario("turn", mock_scenario="x"),
        parts=[image],
        consent_grants=["time"],
    )
    first = json.loads(chunks(await read_turn(call)))
    assert first["session_id"] == "s-hist"
    assert (first["text"], first["parts"]) == ("first", ["image"])
    assert first["consent_grants"] == ["time"]
    assert first["metadata"] == {"scenario": "turn", "mock_scenario": "x"}
    assert first["history"] == []
    await send(call, "second", session_id="s-hist", metadata=scenario("turn"))
    second = json.loads(chunks(await read_turn(call)))
    answered = json.dumps(first, sort_keys=True)
    assert second["history"] == [["user", "first"], ["assistant", answered]]
    call.cancel()


async def test_a_tool_result_for_an_unknown_call_is_dropped(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = stub.Converse()
    bogus = pb.ClientToolResult(call_id="call-made-up", result_json="1")
    await call.write(pb.ClientMessage(session_id="s-1", client_tool_result=bogus))  # no turn
    await send(call, metadata=scenario("tool"))
    tool_call = (await read(call)).tool_call
    await call.write(pb.ClientMessage(session_id="s-1", client_tool_result=bogus))  # mid-turn
    real = pb.ClientToolResult(call_id=tool_call.id, result_json='"noon"')
    await call.write(pb.ClientMessage(session_id="s-1", client_tool_result=real))
    turn = await read_turn(call)
    assert kinds(turn) == ["chunk", "done"]
    assert chunks(turn) == 'result:"noon"'
    call.cancel()


async def test_content_while_a_turn_runs_is_answered_after_it(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = stub.Converse()
    await send(call, metadata=scenario("slow", seconds="0.3"))
    await send(call, metadata=scenario("stream"))
    first, second = await read_turn(call), await read_turn(call)
    assert (kinds(first), chunks(first)) == (["chunk", "done"], "slept")
    assert (kinds(second)[-1], chunks(second)) == ("done", "one two three")
    call.cancel()


async def test_duplex_start_is_answered_with_one_duplex_error(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = stub.Converse()
    start = pb.DuplexStart(codec="pcm16", sample_rate=16000, channels=1)
    await call.write(pb.ClientMessage(session_id="s-1", duplex_start=start))
    assert (await read(call)).error.code == "DUPLEX_ERROR"
    call.cancel()


async def test_sigterm_lets_the_running_turn_finish(tmp_path: Path) -> None:
    agent = AgentProcess("support.agents:handler", tmp_path / "agent.log").start()
    try:
        async with grpc.aio.insecure_channel(agent.target) as channel:
            call = pb_grpc.RuntimeServiceStub(channel).Converse()
            await send(call, metadata=scenario("hold", seconds="0.5"))
            assert (await read(call)).chunk.content == "started "  # the turn is under way
            exited = asyncio.ensure_future(asyncio.to_thread(agent.terminated))
            turn = await read_turn(call)
            assert (kinds(turn), chunks(turn)) == (["chunk", "done"], "finished")
            assert await exited == 0
    finally:
        agent.stop()


async def test_a_part_of_an_unknown_type_is_answered_with_one_error(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = stub.Converse()
    await send(call, parts=[pb.ContentPart(type="hologram", text="?")])
    turn = await read_turn(call)
    assert kinds(turn) == ["error"]
    assert turn[0].error.code == "INVALID_MESSAGE"
    assert kinds(await ask(call, "stream"))[-1] == "done"
    call.cancel()


async def test_sigterm_ends_idle_streams_without_waiting_out_the_grace(tmp_path: Path) -> None:
    """Streams stay open between turns; a stopping agent ends them, it does not wait
    for the facade to (the grace is far longer than stop()'s deadline)."""
    agent = AgentProcess(
        "support.agents:handler", tmp_path / "agent.log", args=("--grace", "600")
    ).start()
    try:
        async with grpc.aio.insecure_channel(agent.target) as channel:
            call = pb_grpc.RuntimeServiceStub(channel).Converse()
            assert kinds(await ask(call, "stream"))[-1] == "done"
            exited = asyncio.ensure_future(asyncio.to_thread(agent.terminated))
            assert await asyncio.wait_for(call.read(), WITHIN) is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            assert await exited == 0
    finally:
        agent.stop()


async def test_a_tool_result_that_is_not_json_is_a_rejection(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = stub.Converse()
    await send(call, metadata=scenario("tool"))
    tool_call = (await read(call)).tool_call
    broken = pb.ClientToolResult(call_id=tool_call.id, result_json="{not json")
    await call.write(pb.ClientMessage(session_id="s-1", client_tool_result=broken))
    assert chunks(await read_turn(call)) == "rejected:the client's result is not JSON"
    call.cancel()


async def test_closing_the_facades_side_rejects_the_waiting_tool_call(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = stub.Converse()
    await send(call, metadata=scenario("tool"))
    assert kinds([await read(call)]) == ["tool_call"]
    await call.done_writing()
    turn = await read_turn(call)
    assert (kinds(turn), chunks(turn)) == (["chunk", "done"], "rejected:the stream closed")
    assert await asyncio.wait_for(call.read(), WITHIN) is grpc.aio.EOF
