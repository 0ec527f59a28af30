"""The `grpc` duplex runtime over real sockets: against the example voice agent served by
`portico agent serve --voice` in another process, and against a raw servicer
(tests/support/grpc_runtime.py) that misbehaves on purpose (docs/runtime-grpc.md,
"The voice half")."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from portico.domain.model import Message
from portico.runtime.base import Chunk, TurnInput
from portico.runtime.duplex.base import (
    AgentText,
    AudioFormat,
    AudioIn,
    AudioOut,
    DuplexCall,
    DuplexEvent,
    DuplexFailure,
    DuplexStart,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)
from portico.runtime.duplex.grpc import GrpcDuplexRuntime
from portico.runtime.duplex.grpc_mapping import (
    BROKEN,
    DUPLEX_ERROR,
    MALFORMED,
    NO_CLIENT_TOOLS,
    SILENT,
    UNREACHABLE,
)
from portico.runtime.grpc.runtime import GrpcRuntime
from support.agent_process import AgentProcess
from support.certs import make_certificates
from support.duplex_runtimes import grpc_agent, voice_agent_process
from support.grpc_runtime import RuntimeProcess

WITHIN = 10.0
CALLER = AudioFormat(sample_rate=16000, channels=1)
SILENT_FRAME = bytes(640)
LOUD_FRAME = struct.pack("<320h", *([6000, -6000] * 160))
TOKEN = "duplex-secret"
TOKEN_ENV = "DUPLEX_TEST_TOKEN"


def start(scenario: str = "", session_id: str = "call-1") -> DuplexStart:
    return DuplexStart(
        session_id=session_id,
        agent="default",
        owner="alice",
        format=CALLER,
        system_instruction=scenario,
    )


async def drain(call: DuplexCall) -> list[DuplexEvent]:
    async def everything() -> list[DuplexEvent]:
        return [event async for event in call.events()]

    return await asyncio.wait_for(everything(), WITHIN)


def kinds(events: list[DuplexEvent]) -> list[str]:
    """Event kinds with runs of one kind collapsed (audio comes in many frames)."""
    names: list[str] = []
    for event in events:
        name = type(event).__name__
        if not names or names[-1] != name:
            names.append(name)
    return names


async def utterance(call: DuplexCall, *, first: int = 0, loud: int = 10, quiet: int = 12) -> int:
    sequence = first
    for frame in [LOUD_FRAME] * loud + [SILENT_FRAME] * quiet:
        await call.send(AudioIn(frame, sequence))
        sequence += 1
    return sequence


# -- against the SDK's example voice agent ------------------------------------------------


@pytest.fixture(scope="module")
def voice_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    process = voice_agent_process(tmp_path_factory.mktemp("voice") / "agent.log").start()
    yield process
    process.stop()


@pytest.fixture
async def to_agent(voice_agent: AgentProcess) -> AsyncIterator[GrpcDuplexRuntime]:
    runtime = GrpcDuplexRuntime("default", grpc_agent(voice_agent.target), env={})
    yield runtime
    await runtime.close()


async def test_an_utterance_is_answered_with_a_transcript_text_speech_and_a_done(
    to_agent: GrpcDuplexRuntime,
) -> None:
    call = await to_agent.start(start())
    sequence = await utterance(call)
    events = call.events()
    hello = await asyncio.wait_for(anext(events), WITHIN)
    assert hello == Hello(format=CALLER, capabilities=("audio", "transcripts"))
    answer: list[DuplexEvent] = []
    while not answer or not isinstance(answer[-1], SpokenTurnDone):
        answer.append(await asyncio.wait_for(anext(events), WITHIN))
    assert kinds(answer) == ["Transcript", "AgentText", "AudioOut", "SpokenTurnDone"]
    assert answer[0] == Transcript("200 ms of speech")
    assert answer[1] == AgentText("I heard you.")
    speech = [event for event in answer if isinstance(event, AudioOut)]
    assert [frame.sequence for frame in speech] == list(range(len(speech)))
    assert sum(len(frame.data) for frame in speech) == 2 * 16000 * 200 // 1000
    # The caller's last frame: the agent has nothing more to say and hangs up.
    await call.send(AudioIn(SILENT_FRAME, sequence, is_last=True))
    rest = await asyncio.wait_for(_rest(events), WITHIN)
    assert rest == []
    await call.close()


async def _rest(events: AsyncIterator[DuplexEvent]) -> list[DuplexEvent]:
    return [event async for event in events]


async def test_talking_over_the_agent_interrupts_it(to_agent: GrpcDuplexRuntime) -> None:
    call = await to_agent.start(start())
    sequence = await utterance(call, loud=40)  # 800 ms of speech: 800 ms of tone
    events = call.events()
    seen: list[DuplexEvent] = []
    while not any(isinstance(event, AudioOut) for event in seen):
        seen.append(await asyncio.wait_for(anext(events), WITHIN))
    await call.send(AudioIn(LOUD_FRAME, sequence))  # barge-in
    while not isinstance(seen[-1], Interruption):
        seen.append(await asyncio.wait_for(anext(events), WITHIN))
    assert "SpokenTurnDone" not in kinds(seen)  # the cut turn ends without one
    await call.close()
    assert not any(isinstance(event, DuplexFailure) for event in await drain(call))


async def test_handed_over_speech_keeps_its_order_and_restarts_the_silence_deadline(
    voice_agent: AgentProcess,
) -> None:
    """`hand_over` (runtime/duplex/base.py): agent audio arriving while the reader waits
    with nothing unread goes to the taker. Each frame handed over is one the reader
    would have read, so it restarts the silence deadline: 800 ms of speech at its pace
    outlasts a 0.5 s `stream_idle_timeout`, one frame at a time."""
    settings = grpc_agent(voice_agent.target, stream_idle_timeout=0.5)
    runtime = GrpcDuplexRuntime("default", settings, env={})
    call = await runtime.start(start())
    arrived: list[DuplexEvent] = []
    taken: list[AudioOut] = []

    def taker(event: DuplexEvent) -> bool:
        if not isinstance(event, AudioOut):
            return False
        arrived.append(event)
        taken.append(event)
        return True

    call.hand_over(taker)  # type: ignore[attr-defined]  # the grpc call has it
    await utterance(call, loud=40)
    events = call.events()
    while not arrived or not isinstance(arrived[-1], SpokenTurnDone | DuplexFailure):
        arrived.append(await asyncio.wait_for(anext(events), WITHIN))
    await call.close()
    await runtime.close()
    assert kinds(arrived) == ["Hello", "Transcript", "AgentText", "AudioOut", "SpokenTurnDone"]
    speech = [event for event in arrived if isinstance(event, AudioOut)]
    assert [frame.sequence for frame in speech] == list(range(40))
    assert taken  # the reader waited while the agent spoke


async def test_the_same_agent_process_answers_text_turns_on_the_same_port(
    voice_agent: AgentProcess,
) -> None:
    text = GrpcRuntime("default", grpc_agent(voice_agent.target), env={})
    message = Message(
        id="m1", session_id="typed-1", role="user", content="hello", created_at=0, updated_at=0
    )
    turn = TurnInput(
        session_id="typed-1", turn_id="t1", agent="default", owner="alice", message=message
    )
    events = [event async for event in text.run(turn)]
    await text.close()
    assert [event.text for event in events if isinstance(event, Chunk)] == [
        "I am a voice agent: call me. You typed 5 characters."
    ]


async def test_an_agent_killed_mid_call_fails_it_once(tmp_path: Path) -> None:
    agent = voice_agent_process(tmp_path / "agent.log").start()
    runtime = GrpcDuplexRuntime("default", grpc_agent(agent.target), env={})
    try:
        call = await runtime.start(start())
        await utterance(call, loud=40)
        events = call.events()
        while not isinstance(await asyncio.wait_for(anext(events), WITHIN), AudioOut):
            pass
        agent.stop(9)  # SIGKILL: mid-speech, no goodbye on the stream
        rest = await asyncio.wait_for(_rest(events), WITHIN)
        failures = [event for event in rest if isinstance(event, DuplexFailure)]
        assert failures == [DuplexFailure(DUPLEX_ERROR, BROKEN)]
        assert rest[-1] == failures[0]
        await call.send(AudioIn(SILENT_FRAME, 99))  # ignored, no error
    finally:
        await runtime.close()
        agent.stop()


async def test_an_agent_without_a_voice_handler_refuses_the_call_once(tmp_path: Path) -> None:
    agent = AgentProcess("support.agents:handler", tmp_path / "agent.log").start()
    runtime = GrpcDuplexRuntime("default", grpc_agent(agent.target), env={})
    try:
        call = await runtime.start(start())
        await call.send(AudioIn(SILENT_FRAME, 0))
        failure = DuplexFailure(DUPLEX_ERROR, "this agent does not take duplex audio")
        assert await drain(call) == [failure]
    finally:
        await runtime.close()
        agent.stop()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_unreachable_agent_fails_the_call_once_and_the_log_names_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = grpc_agent(f"127.0.0.1:{closed_port()}", grpc_connect_timeout=0.5)
    runtime = GrpcDuplexRuntime("default", settings, env={})
    with caplog.at_level(logging.WARNING, "portico.runtime.grpc"):
        call = await runtime.start(start())
        assert await drain(call) == [DuplexFailure(DUPLEX_ERROR, UNREACHABLE)]
    await call.send(AudioIn(SILENT_FRAME, 0))
    await call.close()
    await runtime.close()
    assert "runtime unreachable: connection refused" in caplog.text


# -- against a raw servicer that misbehaves -------------------------------------------------


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeProcess]:
    process = RuntimeProcess(tmp_path_factory.mktemp("raw") / "runtime.log", token=TOKEN).start()
    yield process
    process.stop()


@pytest.fixture
async def to_raw(raw: RuntimeProcess) -> AsyncIterator[GrpcDuplexRuntime]:
    settings = grpc_agent(
        raw.target,
        grpc_token_env=TOKEN_ENV,
        first_token_timeout=0.5,
        stream_idle_timeout=0.5,
    )
    runtime = GrpcDuplexRuntime("default", settings, env={TOKEN_ENV: TOKEN})
    yield runtime
    await runtime.close()


async def test_the_start_the_audio_and_the_token_reach_the_runtime(
    to_raw: GrpcDuplexRuntime,
) -> None:
    call = await to_raw.start(start("meta", session_id="call-meta"))
    for sequence, data in enumerate([b"\x01\x00", b"\x02\x00"]):
        await call.send(AudioIn(data, sequence))
    await call.send(AudioIn(b"\x03\x00", 2, is_last=True))
    await call.send(AudioIn(b"\x04\x00", 3))  # after the last: ignored
    events = await drain(call)
    assert events[0] == Hello(format=AudioFormat(sample_rate=24000), capabilities=("audio",))
    assert isinstance(events[1], AgentText)
    report = json.loads(events[1].text)
    assert report == {
        "session_id": "call-meta",
        "codec": "pcm16",
        "sample_rate": 16000,
        "channels": 1,
        "system_instruction": "meta",
        "authorization": f"Bearer {TOKEN}",
        "frames": [[0, "0100"], [1, "0200"], [2, "0300"]],
    }
    assert events[2:] == [SpokenTurnDone()]  # then the runtime ended the call: a hangup


@pytest.mark.parametrize(
    ("scenario", "failure"),
    [
        ("hello_then_empty", DuplexFailure(DUPLEX_ERROR, MALFORMED)),
        ("error_then_done", DuplexFailure("PROVIDER_UNAVAILABLE", "the voice model is down")),
        ("error_masked", DuplexFailure(DUPLEX_ERROR, "the agent's runtime failed the call")),
        ("stall_mid_turn", DuplexFailure(DUPLEX_ERROR, SILENT)),
        ("abort", DuplexFailure(DUPLEX_ERROR, BROKEN)),
    ],
)
async def test_a_misbehaving_runtime_ends_the_call_with_exactly_one_failure(
    to_raw: GrpcDuplexRuntime, scenario: str, failure: DuplexFailure
) -> None:
    call = await to_raw.start(start(scenario))
    events = await drain(call)
    assert isinstance(events[0], Hello)
    assert [event for event in events if isinstance(event, DuplexFailure)] == [failure]
    assert events[-1] == failure  # nothing after it: the late done is dropped


async def test_a_runtime_that_never_says_hello_fails_after_the_first_token_timeout(
    to_raw: GrpcDuplexRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "portico.runtime.grpc"):
        call = await to_raw.start(start("silent"))
        assert await drain(call) == [DuplexFailure(DUPLEX_ERROR, SILENT)]
    assert "no runtime_hello from the runtime within 0.5s" in caplog.text


async def test_a_client_tool_call_is_answered_with_a_rejection(to_raw: GrpcDuplexRuntime) -> None:
    call = await to_raw.start(start("tool"))
    events = await drain(call)
    assert events[1:] == [
        AgentText(f"rejected=True reason={NO_CLIENT_TOOLS}"),
        SpokenTurnDone(),
    ]


async def test_a_video_counter_offer_reaches_the_server_as_video(
    to_raw: GrpcDuplexRuntime,
) -> None:
    call = await to_raw.start(start("video"))
    hello = await asyncio.wait_for(anext(call.events()), WITHIN)
    assert isinstance(hello, Hello)
    assert hello.format.is_video  # the server answers UNSATISFIABLE_FORMAT
    await call.close()


async def test_close_mid_call_is_prompt_and_fails_nothing(to_raw: GrpcDuplexRuntime) -> None:
    call = await to_raw.start(start("stall_mid_turn"))
    events = call.events()
    assert isinstance(await asyncio.wait_for(anext(events), WITHIN), Hello)
    await call.close()
    await call.close()
    assert await drain_iterator(events) == []


async def drain_iterator(events: AsyncIterator[DuplexEvent]) -> list[DuplexEvent]:
    return await asyncio.wait_for(_rest(events), WITHIN)


async def test_a_refused_token_fails_the_call_once_and_the_log_says_unauthenticated(
    raw: RuntimeProcess, caplog: pytest.LogCaptureFixture
) -> None:
    settings = grpc_agent(raw.target, grpc_token_env=TOKEN_ENV)
    runtime = GrpcDuplexRuntime("default", settings, env={TOKEN_ENV: "not-the-token"})
    with caplog.at_level(logging.WARNING, "portico.runtime.grpc"):
        call = await runtime.start(start("hang_up"))
        assert await drain(call) == [DuplexFailure(DUPLEX_ERROR, BROKEN)]
    await runtime.close()
    assert "stream broken: unauthenticated" in caplog.text
    assert "not-the-token" not in caplog.text


async def test_closing_the_runtime_ends_its_live_calls_without_a_failure(
    to_raw: GrpcDuplexRuntime,
) -> None:
    calls = [await to_raw.start(start("video", session_id=f"c{n}")) for n in range(3)]
    streams = [call.events() for call in calls]
    for events in streams:
        assert isinstance(await asyncio.wait_for(anext(events), WITHIN), Hello)
    await to_raw.close()
    for events in streams:
        assert await drain_iterator(events) == []


@pytest.fixture(scope="module")
def tls_raw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RuntimeProcess, Path]]:
    folder = tmp_path_factory.mktemp("duplex-tls")
    ca, cert, key = make_certificates(folder)
    process = RuntimeProcess(folder / "runtime.log", token=TOKEN, tls=(cert, key)).start()
    yield process, ca
    process.stop()


@pytest.mark.parametrize("with_ca", [True, False])
async def test_tls_with_a_private_ca_as_the_text_runtime_dials_it(
    tls_raw: tuple[RuntimeProcess, Path], with_ca: bool, caplog: pytest.LogCaptureFixture
) -> None:
    process, ca = tls_raw
    settings = grpc_agent(
        process.target,
        grpc_tls=True,
        grpc_ca_file=str(ca) if with_ca else None,
        grpc_token_env=TOKEN_ENV,
        grpc_connect_timeout=1.0,
    )
    runtime = GrpcDuplexRuntime("default", settings, env={TOKEN_ENV: TOKEN})
    with caplog.at_level(logging.WARNING, "portico.runtime.grpc"):
        call = await runtime.start(start("meta", session_id="call-tls"))
        await call.send(AudioIn(b"\x01\x00", 0, is_last=True))
        events = await drain(call)
    await runtime.close()
    if with_ca:
        assert isinstance(events[1], AgentText)
        assert json.loads(events[1].text)["authorization"] == f"Bearer {TOKEN}"
    else:
        assert events == [DuplexFailure(DUPLEX_ERROR, UNREACHABLE)]
        assert "runtime unreachable: TLS handshake failed" in caplog.text
    assert TOKEN not in caplog.text
