"""The duplex runtime port's rules (runtime/duplex/base.py), for every implementation.

Adding a runtime is one entry in `FACTORIES`: an async context manager yielding the
runtime (with whatever fake or process it needs running until the context ends)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pytest

from portico.runtime.duplex.base import (
    AudioFormat,
    AudioIn,
    DuplexEvent,
    DuplexRuntime,
    DuplexStart,
    Hello,
)
from portico.runtime.duplex.scripted import ScriptedDuplexRuntime, VoiceScript
from support.duplex_runtimes import grpc_duplex_runtime, openai_realtime_runtime
from support.duplex_runtimes_embedded import embedded_runtime

WITHIN = 10.0  # seconds any single wait may take before the test fails
CALLER = AudioFormat(sample_rate=16000)
SILENT_FRAME = bytes(640)  # 20 ms of 16 kHz mono silence


@asynccontextmanager
async def scripted() -> AsyncIterator[DuplexRuntime]:
    yield ScriptedDuplexRuntime(VoiceScript(), frame_interval=0)


@asynccontextmanager
async def embedded() -> AsyncIterator[DuplexRuntime]:
    yield await embedded_runtime()


@asynccontextmanager
async def openai_realtime() -> AsyncIterator[DuplexRuntime]:
    async with openai_realtime_runtime() as (runtime, _fake):
        yield runtime


@asynccontextmanager
async def grpc() -> AsyncIterator[DuplexRuntime]:
    """The `grpc` runtime and a `portico agent serve` voice agent in another process."""
    async with grpc_duplex_runtime() as (runtime, _agent):
        yield runtime


FACTORIES: dict[str, Callable[[], AbstractAsyncContextManager[DuplexRuntime]]] = {
    "scripted": scripted,
    "embedded": embedded,
    "openai-realtime": openai_realtime,
    "grpc": grpc,
}


@pytest.fixture(params=sorted(FACTORIES))
async def runtime(request: pytest.FixtureRequest) -> AsyncIterator[DuplexRuntime]:
    async with FACTORIES[request.param]() as made:
        yield made


def start() -> DuplexStart:
    return DuplexStart(session_id="voice-1", agent="default", owner="alice", format=CALLER)


async def first_event(events: AsyncIterator[DuplexEvent]) -> DuplexEvent:
    return await asyncio.wait_for(anext(events), WITHIN)


async def test_the_first_event_is_one_hello_with_an_audio_format(runtime: DuplexRuntime) -> None:
    call = await runtime.start(start())
    events = call.events()
    hello = await first_event(events)
    assert isinstance(hello, Hello)
    assert hello.format.sample_rate > 0
    assert hello.format.channels > 0
    assert not hello.format.is_video
    await call.close()


async def test_close_ends_the_events_promptly_and_twice_is_harmless(
    runtime: DuplexRuntime,
) -> None:
    call = await runtime.start(start())
    events = call.events()
    await first_event(events)
    await call.send(AudioIn(SILENT_FRAME, 0))
    await call.close()
    await call.close()

    async def rest() -> list[DuplexEvent]:
        return [event async for event in events]

    leftover = await asyncio.wait_for(rest(), WITHIN)
    assert not any(isinstance(event, Hello) for event in leftover)


async def test_audio_after_the_call_ended_is_ignored(runtime: DuplexRuntime) -> None:
    call = await runtime.start(start())
    events = call.events()
    await first_event(events)
    await call.close()
    await call.send(AudioIn(SILENT_FRAME, 1))  # the caller may still be talking: no error
    await asyncio.wait_for(_drain(events), WITHIN)


async def test_silence_alone_makes_the_agent_say_nothing(runtime: DuplexRuntime) -> None:
    call = await runtime.start(start())
    events = call.events()
    await first_event(events)
    for sequence in range(10):
        await call.send(AudioIn(SILENT_FRAME, sequence))
    await call.close()
    leftover = await asyncio.wait_for(_drain(events), WITHIN)
    assert [type(event).__name__ for event in leftover] == []


async def _drain(events: AsyncIterator[DuplexEvent]) -> list[DuplexEvent]:
    return [event async for event in events]
