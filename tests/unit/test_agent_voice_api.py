"""The voice handler API (portico/agent/voice.py) without a socket: what a `VoiceCall`
sends, in which order, and when its counter-offer goes out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portico.agent import AudioFormat, AudioFrame, VoiceCall, voice_server
from portico.contract import runtime_pb2 as pb

CALLER = AudioFormat(sample_rate=8000, channels=2)


class Recorder:
    """A `VoiceOutput` that records what the call sent. Each write yields to the loop
    midway, as a stream write does, and notes a write that began while one was in flight
    (a gRPC stream takes one write at a time)."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, ...]] = []
        self.writing = False
        self.overlapped = False

    async def _write(self, entry: tuple[object, ...]) -> None:
        self.overlapped |= self.writing
        self.writing = True
        await asyncio.sleep(0)
        self.sent.append(entry)
        self.writing = False

    async def hello(self, fmt: AudioFormat, capabilities: tuple[str, ...]) -> None:
        await self._write(("hello", fmt, capabilities))

    async def audio(self, data: bytes, media_id: str, sequence: int, is_last: bool) -> None:
        await self._write(("audio", data, sequence))

    async def text(self, text: str, *, user: bool) -> None:
        await self._write(("transcript" if user else "text", text))

    async def interruption(self) -> None:
        self.sent.append(("interruption",))

    async def turn_done(self, content: str) -> None:
        self.sent.append(("done", content))


def make_call(*frames: AudioFrame | None) -> tuple[VoiceCall, Recorder]:
    queue: asyncio.Queue[AudioFrame | None] = asyncio.Queue()
    for frame in frames:
        queue.put_nowait(frame)
    output = Recorder()
    call = VoiceCall(
        session_id="s", caller_format=CALLER, system_instruction="", frames=queue, output=output
    )
    return call, output


async def test_the_callers_format_goes_out_first_when_the_handler_does_not_accept() -> None:
    call, output = make_call()
    await call.say("hi")
    await call.say("")  # nothing to say: nothing sent
    await call.transcript("you")
    await call.interrupted()
    await call.turn_done("hi there")
    assert output.sent == [
        ("hello", CALLER, ("audio", "transcripts")),
        ("text", "hi"),
        ("transcript", "you"),
        ("interruption",),
        ("done", "hi there"),
    ]


async def test_accept_sets_the_format_once_and_only_first() -> None:
    call, output = make_call()
    offer = AudioFormat(sample_rate=24000)
    await call.accept(offer, capabilities=("audio",))
    assert call.format == offer
    with pytest.raises(RuntimeError):
        await call.accept()
    late, _ = make_call()
    await late.say("first")
    with pytest.raises(RuntimeError):
        await late.accept(offer)  # the caller's format already went out
    assert output.sent == [("hello", offer, ("audio",))]


async def test_reading_audio_greets_and_ends_at_the_last_frame_or_the_hangup() -> None:
    call, output = make_call(AudioFrame(b"a", 0), AudioFrame(b"b", 1, is_last=True))
    assert [frame.data async for frame in call.audio()] == [b"a", b"b"]
    assert output.sent == [("hello", CALLER, ("audio", "transcripts"))]
    with pytest.raises(RuntimeError):
        [frame async for frame in call.audio()]  # read once
    hung_up, _ = make_call(AudioFrame(b"a", 0), None)
    assert [frame.data async for frame in hung_up.audio()] == [b"a"]


async def test_speech_from_two_tasks_goes_out_whole_and_numbered_in_call_order() -> None:
    call, output = make_call()

    async def speaker(tag: bytes) -> None:
        for _ in range(3):
            await call.speak(tag)

    await asyncio.gather(speaker(b"x"), speaker(b"y"), call.say("words"))
    assert not output.overlapped
    audio = [entry for entry in output.sent if entry[0] == "audio"]
    assert [entry[2] for entry in audio] == [0, 1, 2, 3, 4, 5]
    assert sorted(entry[1] for entry in audio) == [b"x"] * 3 + [b"y"] * 3
    assert output.sent[0][0] == "hello"
    assert [entry[0] for entry in output.sent].count("hello") == 1


# -- the SDK's reading of a call's stream, fuzzed ----------------------------------------

client_messages = st.one_of(
    st.builds(
        lambda data, sequence, last: pb.ClientMessage(
            audio_input=pb.AudioInputChunk(data=data, sequence=sequence, is_last=last)
        ),
        st.binary(max_size=4),
        st.integers(0, 2**32 - 1),
        st.booleans(),
    ),
    st.builds(lambda text: pb.ClientMessage(content=text), st.text(max_size=4)),
    st.just(pb.ClientMessage(duplex_start=pb.DuplexStart(codec="pcm16"))),
    st.just(pb.ClientMessage(client_tool_result=pb.ClientToolResult(call_id="x"))),
    st.just(pb.ClientMessage()),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(client_messages, max_size=10))
def test_a_calls_stream_gives_the_handler_its_audio_up_to_the_last_then_the_end(
    messages: list[pb.ClientMessage],
) -> None:
    async def scenario() -> list[AudioFrame | None]:
        async def stream() -> AsyncIterator[pb.ClientMessage]:
            for message in messages:
                yield message

        frames: asyncio.Queue[AudioFrame | None] = asyncio.Queue()
        await asyncio.wait_for(voice_server._read(stream(), frames, "s"), 5)
        return [frames.get_nowait() for _ in range(frames.qsize())]

    got = asyncio.run(scenario())
    audio = [m.audio_input for m in messages if m.HasField("audio_input")]
    last = next((i for i, chunk in enumerate(audio) if chunk.is_last), len(audio) - 1)
    expected = [AudioFrame(c.data, c.sequence, c.is_last) for c in audio[: last + 1]]
    assert got == [*expected, None]
