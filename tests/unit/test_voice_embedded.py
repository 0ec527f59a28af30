"""The embedded voice agent: its speech pieces, and the agent end to end at the port."""

from __future__ import annotations

import array
import asyncio
import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portico.config import Settings
from portico.runtime.duplex.base import (
    AgentText,
    AudioIn,
    AudioOut,
    DuplexCall,
    DuplexEvent,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)
from portico.runtime.duplex.embedded import HEARD_FORMAT, demo_reply
from portico.voice import FRAME_BYTES, SAMPLE_RATE, VoiceUnavailable
from portico.voice.phrases import DEMO_PHRASES
from portico.voice.recognizer import PocketSphinxRecognizer
from portico.voice.vad import Segmenter, SpeechStarted, Utterance, WebRtcVad
from support.duplex_runtimes_embedded import embedded_runtime, frames, spoken, start_of

DEADLINE = 60.0


def tone(ms: int, frequency: float = 300.0) -> bytes:
    count = SAMPLE_RATE * ms // 1000
    samples = array.array(
        "h", (int(9000 * math.sin(2 * math.pi * frequency * n / SAMPLE_RATE)) for n in range(count))
    )
    return samples.tobytes()


def energy(pcm: bytes) -> float:
    samples = array.array("h", pcm)
    return math.sqrt(sum(s * s for s in samples) / max(1, len(samples)))


# -- the pieces ---------------------------------------------------------------------------------


def test_vad_hears_speech_not_silence() -> None:
    vad = WebRtcVad()
    assert not vad.is_speech(bytes(FRAME_BYTES))
    assert any(vad.is_speech(f) for f in frames(spoken("hello")))


def test_segmenter_cuts_one_utterance_after_a_silence_gap() -> None:
    segmenter = Segmenter(WebRtcVad())
    events = segmenter.feed(
        bytes(FRAME_BYTES * 20) + spoken("where am i") + bytes(FRAME_BYTES * 40)
    )
    assert [type(e) for e in events] == [SpeechStarted, Utterance]
    assert segmenter.feed(bytes(FRAME_BYTES * 50)) == []


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=3000), max_size=40), noise=st.binary())
def test_segmenter_regroups_frames_of_any_size(cuts: list[int], noise: bytes) -> None:
    """Caller frames of any size (and any bytes) cut the same utterances as whole frames."""
    audio = noise + bytes(FRAME_BYTES * 10) + spoken("beep") + bytes(FRAME_BYTES * 30)
    whole = Segmenter(WebRtcVad()).feed(audio)
    segmenter, pieces, offset = Segmenter(WebRtcVad()), [], 0
    for cut in cuts:
        pieces += segmenter.feed(audio[offset : offset + cut])
        offset += cut
    pieces += segmenter.feed(audio[offset:])
    assert pieces == whole


def test_segmenter_ignores_silence() -> None:
    assert Segmenter(WebRtcVad()).feed(bytes(FRAME_BYTES * 100)) == []


@pytest.mark.parametrize("phrase", ["hello", "where am i", "draw a picture", "history"])
def test_recognizer_hears_demo_phrases(phrase: str) -> None:
    assert PocketSphinxRecognizer(DEMO_PHRASES).recognize(spoken(phrase)) == phrase


def test_recognizer_hears_nothing_in_silence() -> None:
    assert PocketSphinxRecognizer(DEMO_PHRASES).recognize(bytes(SAMPLE_RATE * 2)) == ""


def test_build_names_the_extra_when_the_speech_packages_are_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from portico.runtime.duplex import embedded

    monkeypatch.setitem(sys.modules, "pocketsphinx", None)  # import raises ImportError
    with pytest.raises(VoiceUnavailable, match=r"pip install 'portico\[voice\]'"):
        embedded.build(Settings())


# -- the agent at the port ---------------------------------------------------------------------


async def collect(call: DuplexCall, until: type | None = None) -> list[DuplexEvent]:
    """Events until the call ends, or until one of type `until`."""
    got: list[DuplexEvent] = []

    async def read() -> None:
        async for event in call.events():
            got.append(event)
            if until is not None and isinstance(event, until):
                return

    await asyncio.wait_for(read(), DEADLINE)
    return got


async def say(call: DuplexCall, pcm: bytes, *, last: bool = False) -> None:
    chunks = frames(pcm)
    for index, chunk in enumerate(chunks):
        await call.send(AudioIn(chunk, index, is_last=last and index == len(chunks) - 1))


async def test_a_spoken_phrase_is_heard_and_answered_aloud() -> None:
    runtime = await embedded_runtime()
    call = await runtime.start(start_of())
    await say(call, spoken("beep") + bytes(FRAME_BYTES * 40), last=True)
    events = await collect(call)
    assert events[0] == Hello(format=HEARD_FORMAT, capabilities=("audio",))
    assert Transcript("beep", final=True) in events
    texts = [e.text for e in events if isinstance(e, AgentText)]
    assert texts == [await demo_reply("beep", start_of())]
    assert "sound" in texts[0]
    audio = b"".join(e.data for e in events if isinstance(e, AudioOut))
    assert len(audio) > SAMPLE_RATE
    assert energy(audio) > 500
    assert isinstance(events[-1], SpokenTurnDone)


async def test_silence_produces_nothing() -> None:
    runtime = await embedded_runtime()
    call = await runtime.start(start_of())
    await say(call, bytes(FRAME_BYTES * 150), last=True)
    events = await collect(call)
    assert [type(e) for e in events] == [Hello]


async def test_caller_speech_while_the_agent_speaks_interrupts_it() -> None:
    runtime = await embedded_runtime(frame_interval=0.02)
    call = await runtime.start(start_of())
    await say(call, spoken("hello") + bytes(FRAME_BYTES * 40))  # the greeting is ~15 s long
    before = await collect(call, until=AudioOut)
    assert any(isinstance(e, AgentText) for e in before)
    await say(call, spoken("history"))
    after = await collect(call, until=Interruption)
    assert not any(isinstance(e, SpokenTurnDone) for e in before + after)
    await call.close()


async def test_close_mid_utterance_ends_the_call_promptly() -> None:
    runtime = await embedded_runtime()
    call = await runtime.start(start_of())
    await say(call, spoken("what time is it")[: FRAME_BYTES * 30])
    await call.close()
    await call.close()  # idempotent
    events = await collect(call)
    assert [type(e) for e in events] == [Hello]
    await call.send(AudioIn(bytes(FRAME_BYTES), 999))  # ignored after the end
