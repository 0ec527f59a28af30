"""`portico agent serve --voice` in its own process, driven by a raw `RuntimeServiceStub`:
the SDK's side of the contract's duplex half (docs/agents.md, "Voice")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from portico.contract import runtime_pb2 as pb
from portico.contract import runtime_pb2_grpc as pb_grpc
from support.agent_process import AgentProcess

WITHIN = 10.0
Call = grpc.aio.StreamStreamCall


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    log = tmp_path_factory.mktemp("voice-sdk") / "agent.log"
    args = ("--voice", "support.voice_agents:voice")
    process = AgentProcess("support.agents:handler", log, args=args).start()
    yield process
    process.stop()


@pytest.fixture
async def stub(agent: AgentProcess) -> AsyncIterator[pb_grpc.RuntimeServiceStub]:
    async with grpc.aio.insecure_channel(agent.target) as channel:
        yield pb_grpc.RuntimeServiceStub(channel)


async def open_call(
    stub: pb_grpc.RuntimeServiceStub, scenario: str, session_id: str = "v-1", **fmt: object
) -> Call:
    call = stub.Converse()
    start = pb.DuplexStart(system_instruction=scenario, **fmt)  # type: ignore[arg-type]
    await call.write(pb.ClientMessage(session_id=session_id, duplex_start=start))
    return call


async def read_to_end(call: Call) -> list[pb.ServerMessage]:
    """Every message until the agent ends the stream (status OK)."""

    async def everything() -> list[pb.ServerMessage]:
        messages = []
        while (message := await call.read()) is not grpc.aio.EOF:
            assert isinstance(message, pb.ServerMessage)
            messages.append(message)
        return messages

    messages = await asyncio.wait_for(everything(), WITHIN)
    assert await call.code() == grpc.StatusCode.OK
    return messages


def kinds(messages: list[pb.ServerMessage]) -> list[str | None]:
    return [message.WhichOneof("message") for message in messages]


async def test_a_call_hears_the_callers_audio_in_order_and_speaks_it_back(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = await open_call(stub, "echo", codec="pcm16", sample_rate=16000, channels=1)
    frames = [bytes([n]) * 4 for n in range(5)]
    for sequence, data in enumerate(frames):
        chunk = pb.AudioInputChunk(data=data, sequence=sequence, is_last=sequence == 4)
        await call.write(pb.ClientMessage(session_id="v-1", audio_input=chunk))
    await call.done_writing()
    messages = await read_to_end(call)
    assert kinds(messages) == ["runtime_hello"] + ["media_chunk"] * 5 + ["chunk", "done"]
    hello = messages[0].runtime_hello
    assert (hello.media.codec, hello.media.sample_rate, hello.media.channels) == (
        "pcm16",
        16000,
        1,
    )
    assert list(hello.capabilities) == ["audio", "transcripts"]
    audio = [message.media_chunk for message in messages[1:6]]
    assert [chunk.data for chunk in audio] == frames
    assert [chunk.sequence for chunk in audio] == [0, 1, 2, 3, 4]
    assert {chunk.mime_type for chunk in audio} == {"audio/pcm;rate=16000;channels=1"}
    assert messages[6].chunk == pb.Chunk(content="bye")


async def test_the_caller_hanging_up_ends_the_audio_without_an_is_last(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = await open_call(stub, "echo")
    chunk = pb.AudioInputChunk(data=b"\x01\x02", sequence=0)
    await call.write(pb.ClientMessage(audio_input=chunk))
    await call.done_writing()
    assert kinds(await read_to_end(call)) == ["runtime_hello", "media_chunk", "chunk", "done"]


async def test_a_counter_offer_transcripts_interruption_and_a_done_with_content(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    call = await open_call(stub, "offer", sample_rate=16000)
    messages = await read_to_end(call)
    assert kinds(messages) == ["runtime_hello", "chunk", "chunk", "interruption", "done"]
    assert messages[0].runtime_hello.media.sample_rate == 24000
    assert messages[1].chunk == pb.Chunk(content="you spoke", role="user")
    assert messages[2].chunk == pb.Chunk(content="hi")
    assert messages[4].done.final_content == "hi there"


@pytest.mark.parametrize(
    ("scenario", "expected_kinds", "error"),
    [
        (
            "agent_error",
            ["runtime_hello", "chunk", "error"],
            ("PROVIDER_UNAVAILABLE", "the voice model is down"),
        ),
        ("crash", ["runtime_hello", "error"], ("INTERNAL_ERROR", "internal error")),
        ("hang_up", ["runtime_hello"], None),
    ],
)
async def test_the_handlers_end_is_the_calls_end_and_a_hello_always_comes_first(
    stub: pb_grpc.RuntimeServiceStub,
    agent: AgentProcess,
    scenario: str,
    expected_kinds: list[str],
    error: tuple[str, str] | None,
) -> None:
    messages = await read_to_end(await open_call(stub, scenario))
    assert kinds(messages) == expected_kinds
    if error is not None:
        assert (messages[-1].error.code, messages[-1].error.message) == error
    if scenario == "crash":
        assert "agent voice handler raised session=v-1" in agent.log_text()
        assert "a bug in the handler" in agent.log_text()  # the traceback, in the log only


async def test_a_second_accept_is_refused_to_the_handler(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    messages = await read_to_end(await open_call(stub, "twice"))
    assert kinds(messages) == ["runtime_hello", "chunk", "done"]
    assert messages[1].chunk.content == "the call's format was already sent"


async def test_the_facade_cancelling_the_call_cancels_the_handler(
    stub: pb_grpc.RuntimeServiceStub, tmp_path: Path
) -> None:
    mark = tmp_path / "cancelled"
    call = await open_call(stub, "hold", session_id=str(mark))
    assert (await asyncio.wait_for(call.read(), WITHIN)).WhichOneof("message") == "runtime_hello"
    call.cancel()
    for _ in range(100):  # the agent runs in another process: poll for its mark
        if mark.exists():
            break
        await asyncio.sleep(0.05)
    assert mark.read_text() == "cancelled"


async def test_text_turns_work_beside_calls_and_health_names_the_capability(
    stub: pb_grpc.RuntimeServiceStub,
) -> None:
    health = await stub.Health(pb.HealthRequest(), timeout=WITHIN)
    assert "duplex_audio" in health.capabilities
    call = stub.Converse()
    await call.write(pb.ClientMessage(session_id="t-1", content="hi"))
    first = await asyncio.wait_for(call.read(), WITHIN)
    assert first.chunk.content == "one two three"
    # A duplex_start later on a text stream is still not a call.
    start = pb.DuplexStart(codec="pcm16", sample_rate=16000, channels=1)
    await asyncio.wait_for(call.read(), WITHIN)  # the turn's done
    await call.write(pb.ClientMessage(session_id="t-1", duplex_start=start))
    assert (await asyncio.wait_for(call.read(), WITHIN)).error.code == "DUPLEX_ERROR"
    call.cancel()
