"""The `openai-realtime` duplex runtime against a fake Realtime API on a real socket,
driven at the port: `DuplexRuntime.start()` and the call's `send`/`events`."""

from __future__ import annotations

import asyncio
import base64
import socket
from collections.abc import AsyncIterator

import pytest

from portico.runtime.duplex.base import (
    AgentText,
    AudioFormat,
    AudioIn,
    AudioOut,
    DuplexCall,
    DuplexEvent,
    DuplexFailure,
    DuplexRuntime,
    DuplexStart,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)
from portico.runtime.duplex.openai_realtime import build
from support.duplex_runtimes import openai_realtime_runtime
from support.fake_realtime import KEY, KEY_ENV, WITHIN, FakeRealtime

START = DuplexStart(
    session_id="s1",
    agent="default",
    owner="alice",
    format=AudioFormat(sample_rate=16000),
    system_instruction="Be brief.",
)


@pytest.fixture
async def realtime() -> AsyncIterator[tuple[DuplexRuntime, FakeRealtime]]:
    async with openai_realtime_runtime() as pair:
        yield pair


async def next_event(events: AsyncIterator[DuplexEvent]) -> DuplexEvent:
    return await asyncio.wait_for(anext(events), WITHIN)


async def rest(events: AsyncIterator[DuplexEvent]) -> list[DuplexEvent]:
    async def drain() -> list[DuplexEvent]:
        return [event async for event in events]

    return await asyncio.wait_for(drain(), WITHIN)


async def opened(runtime: DuplexRuntime) -> tuple[DuplexCall, AsyncIterator[DuplexEvent]]:
    call = await runtime.start(START)
    events = call.events()
    hello = await next_event(events)
    assert hello == Hello(
        format=AudioFormat(sample_rate=24000), capabilities=("barge_in", "transcripts")
    )
    return call, events


async def test_a_spoken_turn_is_audio_text_transcript_and_done(
    realtime: tuple[DuplexRuntime, FakeRealtime],
) -> None:
    runtime, fake = realtime
    call, events = await opened(runtime)
    (update,) = await fake.received("session.update")
    assert update["session"]["instructions"] == "Be brief."
    assert fake.handshakes[0] == {
        "model": "gpt-realtime-test",
        "authorization": f"Bearer {KEY}",
        "beta": "realtime=v1",
    }
    await call.send(AudioIn(b"\x01\x02" * 10, 0))
    (append,) = await fake.received("input_audio_buffer.append")
    assert base64.b64decode(append["audio"]) == b"\x01\x02" * 10
    await fake.push(
        {"type": "conversation.item.input_audio_transcription.completed", "transcript": "hi"},
        {"type": "response.created"},
        {"type": "response.audio_transcript.delta", "delta": "Hello"},
    )
    await fake.push_audio(b"\x09" * 8)
    await fake.push({"type": "response.output_audio.delta", "delta": "AAA="})
    await fake.push({"type": "response.done", "response": {"status": "completed"}})
    got = [await next_event(events) for _ in range(5)]
    assert got == [
        Transcript("hi"),
        AgentText("Hello"),
        AudioOut(data=b"\x09" * 8, media_id="item_1", sequence=1),
        AudioOut(data=b"\x00\x00", sequence=2),
        SpokenTurnDone(),
    ]
    await call.close()
    assert await rest(events) == []


async def test_barge_in_interrupts_and_cancels_the_response(
    realtime: tuple[DuplexRuntime, FakeRealtime],
) -> None:
    runtime, fake = realtime
    call, events = await opened(runtime)
    await fake.push({"type": "response.created"})
    await fake.push_audio(b"\x01\x01")
    await fake.push({"type": "input_audio_buffer.speech_started"})
    assert isinstance(await next_event(events), AudioOut)
    assert await next_event(events) == Interruption()
    await fake.received("response.cancel")
    await call.close()


async def test_speech_while_nobody_speaks_is_no_interruption(
    realtime: tuple[DuplexRuntime, FakeRealtime],
) -> None:
    runtime, fake = realtime
    call, events = await opened(runtime)
    await fake.push({"type": "input_audio_buffer.speech_started"})
    await fake.push({"type": "response.done"})
    assert await next_event(events) == SpokenTurnDone()
    assert not [e for e in fake.client_events if e["type"] == "response.cancel"]
    await call.close()


async def test_the_last_frame_commits_and_the_call_ends_after_the_reply(
    realtime: tuple[DuplexRuntime, FakeRealtime],
) -> None:
    runtime, fake = realtime
    call, events = await opened(runtime)
    await call.send(AudioIn(b"\x00\x00", 0, is_last=True))
    await fake.received("response.create")
    assert await fake.received("input_audio_buffer.commit")
    await fake.push({"type": "response.done"})
    assert await rest(events) == [SpokenTurnDone()]
    await call.send(AudioIn(b"\x00\x00", 1))  # after the end: ignored


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ({"code": "invalid_api_key"}, "PROVIDER_AUTH_FAILED"),
        ({"code": "rate_limit_exceeded"}, "PROVIDER_RATE_LIMITED"),
        ({"code": "server_error", "message": "sk-secret leaked"}, "PROVIDER_UNAVAILABLE"),
    ],
)
async def test_a_provider_error_event_is_one_failure(
    realtime: tuple[DuplexRuntime, FakeRealtime], error: dict[str, str], code: str
) -> None:
    runtime, fake = realtime
    _call, events = await opened(runtime)
    await fake.push({"type": "error", "error": error}, {"type": "response.done"})
    (failure,) = await rest(events)
    assert isinstance(failure, DuplexFailure)
    assert failure.code == code
    assert "sk-secret" not in failure.message
    assert "gpt-realtime-test" in failure.message


async def test_a_cancel_racing_the_end_of_a_turn_is_no_failure(
    realtime: tuple[DuplexRuntime, FakeRealtime],
) -> None:
    runtime, fake = realtime
    call, events = await opened(runtime)
    await fake.push(
        {"type": "error", "error": {"code": "response_cancel_not_active"}},
        {"type": "response.done"},
    )
    assert await next_event(events) == SpokenTurnDone()
    await call.close()


async def test_a_socket_closed_mid_call_is_one_failure(
    realtime: tuple[DuplexRuntime, FakeRealtime],
) -> None:
    runtime, fake = realtime
    call, events = await opened(runtime)
    await fake.drop()
    assert await rest(events) == [
        DuplexFailure("PROVIDER_UNAVAILABLE", "the model gpt-realtime-test closed the call")
    ]
    await call.send(AudioIn(b"\x00\x00", 0))  # after a failure: ignored


async def failure_of(runtime: DuplexRuntime) -> list[DuplexEvent]:
    call = await runtime.start(START)
    try:
        return await rest(call.events())
    finally:
        await call.close()


async def test_a_wrong_key_is_auth_failed(realtime: tuple[DuplexRuntime, FakeRealtime]) -> None:
    _, fake = realtime
    (failure,) = await failure_of(build(fake.agent(), {KEY_ENV: "sk-wrong"}))
    assert isinstance(failure, DuplexFailure)
    assert failure.code == "PROVIDER_AUTH_FAILED"


async def test_a_refused_handshake_maps_its_status(
    realtime: tuple[DuplexRuntime, FakeRealtime],
) -> None:
    runtime, fake = realtime
    fake.refuse_status = 429
    (failure,) = await failure_of(runtime)
    assert isinstance(failure, DuplexFailure)
    assert failure.code == "PROVIDER_RATE_LIMITED"


async def test_a_refused_connection_is_unavailable(
    realtime: tuple[DuplexRuntime, FakeRealtime],
) -> None:
    _, fake = realtime
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    agent = fake.agent(base_url=f"http://127.0.0.1:{port}/v1")
    (failure,) = await failure_of(build(agent, {KEY_ENV: KEY}))
    assert isinstance(failure, DuplexFailure)
    assert failure.code == "PROVIDER_UNAVAILABLE"


async def test_a_handshake_past_the_deadline_is_a_timeout(
    realtime: tuple[DuplexRuntime, FakeRealtime],
) -> None:
    _, fake = realtime
    fake.stalling = True
    agent = fake.agent(first_token_timeout=0.2)
    (failure,) = await failure_of(build(agent, {KEY_ENV: KEY}))
    assert failure == DuplexFailure(
        "PROVIDER_TIMEOUT", "the model gpt-realtime-test could not be reached (PROVIDER_TIMEOUT)"
    )


async def test_close_ends_a_waiting_reader_without_a_failure(
    realtime: tuple[DuplexRuntime, FakeRealtime],
) -> None:
    runtime, _ = realtime
    call, events = await opened(runtime)
    reader = asyncio.create_task(rest(events))
    await asyncio.sleep(0)  # one loop pass: the reader is now waiting on the socket
    await call.close()
    assert await asyncio.wait_for(reader, WITHIN) == []
    await call.close()  # idempotent
