"""The scripted duplex runtime's rules, on its sans-I/O core and through its call."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from portico.errors import ScriptError
from portico.runtime.duplex.base import (
    AgentText,
    AudioFormat,
    AudioIn,
    AudioOut,
    DuplexEvent,
    DuplexFailure,
    DuplexStart,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)
from portico.runtime.duplex.scripted import (
    FailStep,
    ScriptedCall,
    ScriptedDuplexRuntime,
    VoiceScript,
    VoiceTurn,
    load_voice_script,
    peak,
    tone,
)

CALLER = AudioFormat(sample_rate=16000)
LOUD = struct.pack("<320h", *([9000] * 320))
QUIET = bytes(640)


def frame(data: bytes, sequence: int = 0, *, last: bool = False) -> AudioIn:
    return AudioIn(data, sequence, last)


def test_the_counter_offer_is_the_scripts_format_else_the_callers() -> None:
    offered = AudioFormat(sample_rate=24000)
    assert ScriptedCall(VoiceScript(format=offered), CALLER).opening() == [
        Hello(format=offered, capabilities=("audio", "transcripts"))
    ]
    (hello,) = ScriptedCall(VoiceScript(), AudioFormat(sample_rate=8000, channels=2)).opening()
    assert isinstance(hello, Hello)
    assert (hello.format.sample_rate, hello.format.channels) == (8000, 2)


def test_n_loud_frames_start_a_spoken_turn_with_transcript_reply_and_tone() -> None:
    script = VoiceScript(
        turns=(VoiceTurn(hear_frames=3, transcript="hi", reply="hello", tone_ms=100),)
    )
    core = ScriptedCall(script, CALLER)
    assert core.hear(frame(LOUD)) == []
    assert core.hear(frame(LOUD)) == []
    assert core.hear(frame(LOUD)) == [Transcript("hi"), AgentText("hello")]
    assert core.take_turn_started()
    assert not core.take_turn_started()
    speech = []
    while (out := core.next_speech()) is not None:
        speech.append(out)
    assert len(speech) == 5  # 100 ms in 20 ms frames
    assert all(len(out.data) == 640 for out in speech)


def test_silence_does_not_count_as_hearing() -> None:
    core = ScriptedCall(VoiceScript(turns=(VoiceTurn(hear_frames=1),)), CALLER)
    assert all(core.hear(frame(QUIET)) == [] for _ in range(50))
    assert core.next_speech() is None


def test_a_silence_gap_after_speech_ends_the_callers_utterance() -> None:
    turn = VoiceTurn(after_silence_frames=2, transcript="done talking")
    core = ScriptedCall(VoiceScript(turns=(turn,)), CALLER)
    assert core.hear(frame(QUIET)) == []
    assert core.hear(frame(QUIET)) == []
    assert core.hear(frame(LOUD)) == []
    assert core.hear(frame(QUIET)) == []
    assert core.hear(frame(QUIET)) == [Transcript("done talking")]


def test_loud_audio_over_the_agents_speech_is_barge_in() -> None:
    core = ScriptedCall(VoiceScript(turns=(VoiceTurn(hear_frames=1, tone_ms=200),)), CALLER)
    core.hear(frame(LOUD))
    assert core.next_speech() is not None
    assert core.hear(frame(LOUD)) == [Interruption()]
    assert core.next_speech() is None  # the rest of the speech is dropped
    assert core.hear(frame(QUIET)) == []  # silence while speaking is no barge-in


def test_a_turn_speaks_until_its_done_and_talking_before_it_is_barge_in() -> None:
    core = ScriptedCall(VoiceScript(turns=(VoiceTurn(hear_frames=1, tone_ms=20),)), CALLER)
    core.hear(frame(LOUD))
    assert core.end_of_speech() is None  # speech left
    assert core.next_speech() is not None
    assert core.next_speech() is None
    assert core.hear(frame(LOUD)) == [Interruption()]  # all taken, the done not yet
    assert core.end_of_speech() is None  # a barged-in turn has no done


def test_a_fail_cue_is_one_failure_and_then_nothing() -> None:
    turn = VoiceTurn(hear_frames=1, fail=FailStep("PROVIDER_UNAVAILABLE", "cue"))
    core = ScriptedCall(VoiceScript(turns=(turn,)), CALLER)
    assert core.hear(frame(LOUD)) == [DuplexFailure("PROVIDER_UNAVAILABLE", "cue")]
    assert core.hear(frame(LOUD)) == []


def test_echo_sends_each_frame_back() -> None:
    core = ScriptedCall(VoiceScript(echo=True), CALLER)
    assert core.hear(frame(b"\x01\x02", 7)) == [AudioOut(data=b"\x01\x02", sequence=7)]


def test_turns_go_in_order_and_the_last_repeats() -> None:
    turns = (VoiceTurn(hear_frames=1, transcript="one"), VoiceTurn(hear_frames=1, transcript="two"))
    core = ScriptedCall(VoiceScript(turns=turns), CALLER)
    said = []
    for _ in range(3):
        said.append(core.hear(frame(LOUD))[0])
        while core.next_speech() is not None:  # the agent finishes speaking...
            pass
        assert core.end_of_speech() == SpokenTurnDone()  # ...and its turn
    assert said == [Transcript("one"), Transcript("two"), Transcript("two")]


@given(st.binary(max_size=4000))
def test_any_bytes_are_a_frame_with_a_peak(data: bytes) -> None:
    assert 0 <= peak(data) <= 32768
    core = ScriptedCall(VoiceScript(), CALLER)
    core.hear(frame(data))  # never raises


def test_the_tone_fills_the_format() -> None:
    frames = tone(AudioFormat(sample_rate=48000, channels=2), 30, 440.0)
    assert [len(f) for f in frames] == [48 * 20 * 4, 48 * 10 * 4]
    assert peak(b"".join(frames)) > 7000


async def test_a_call_speaks_a_turn_then_ends_at_the_last_frame() -> None:
    runtime = ScriptedDuplexRuntime(
        VoiceScript(turns=(VoiceTurn(hear_frames=2, reply="ok", tone_ms=60),)), frame_interval=0
    )
    call = await runtime.start(DuplexStart(session_id="s", agent="a", owner="o", format=CALLER))
    await call.send(frame(LOUD, 0))
    await call.send(frame(LOUD, 1, last=True))
    events = await asyncio.wait_for(_all(call.events()), 5)
    kinds = [type(event).__name__ for event in events]
    assert kinds == ["Hello", "AgentText", "AudioOut", "AudioOut", "AudioOut", "SpokenTurnDone"]


async def test_barge_in_during_a_call_interrupts_and_skips_the_turns_done() -> None:
    runtime = ScriptedDuplexRuntime(
        VoiceScript(turns=(VoiceTurn(hear_frames=1, tone_ms=2000),)), frame_interval=0.01
    )
    call = await runtime.start(DuplexStart(session_id="s", agent="a", owner="o", format=CALLER))
    events = call.events()
    assert isinstance(await anext(events), Hello)
    await call.send(frame(LOUD, 0))
    assert isinstance(await asyncio.wait_for(anext(events), 5), AudioOut)
    await call.send(frame(LOUD, 1))
    seen: list[DuplexEvent] = []
    while not isinstance(event := await asyncio.wait_for(anext(events), 5), Interruption):
        seen.append(event)
    await call.close()
    rest = await asyncio.wait_for(_all(events), 5)
    assert not any(isinstance(event, SpokenTurnDone) for event in seen + rest)


async def test_talking_after_the_last_frame_before_the_done_is_barge_in_not_a_merged_turn() -> None:
    """The agent's turn lasts until its `SpokenTurnDone`, its last frame's 20 ms
    included: a loud frame in between is barge-in. (It used to count towards the next
    utterance, and an utterance completed then was spoken by the same speaker as the
    rest of the old turn: the old turn never got its done, the new one's transcript
    landed inside it.)"""
    turns = (
        VoiceTurn(hear_frames=1, transcript="one", tone_ms=20),
        VoiceTurn(hear_frames=1, transcript="two", tone_ms=20),
    )
    runtime = ScriptedDuplexRuntime(VoiceScript(turns=turns), frame_interval=0)
    call = await runtime.start(DuplexStart(session_id="s", agent="a", owner="o", format=CALLER))
    events = call.events()
    await call.send(frame(LOUD, 0))
    seen = [await anext(events) for _ in range(3)]
    assert [type(event) for event in seen] == [Hello, Transcript, AudioOut]
    # The reader is woken for the turn's only frame before its speaker's pause ends
    # (asyncio runs ready callbacks in order): the speaker still owes the done.
    await call.send(frame(LOUD, 1))
    await call.send(frame(LOUD, 2))  # the next utterance, heard after the barge-in
    await call.send(frame(QUIET, 3, last=True))
    seen += await asyncio.wait_for(_all(events), 5)
    assert [type(event).__name__ for event in seen] == [
        "Hello",
        "Transcript",
        "AudioOut",
        "Interruption",
        "Transcript",
        "AudioOut",
        "SpokenTurnDone",
    ]
    assert seen[4] == Transcript("two")


async def test_events_a_waiting_reader_would_wake_for_go_to_the_taker_first() -> None:
    """`hand_over` (runtime/duplex/base.py): offered only while the reader waits with
    nothing unread, so the events keep their order; a declined one is read as usual."""
    runtime = ScriptedDuplexRuntime(VoiceScript(echo=True))
    call = await runtime.start(DuplexStart(session_id="s", agent="a", owner="o", format=CALLER))
    taken: list[DuplexEvent] = []
    accepting = [True]

    def taker(event: DuplexEvent) -> bool:
        if accepting[0]:
            taken.append(event)
        return accepting[0]

    call.hand_over(taker)  # type: ignore[attr-defined]  # the scripted call has it
    await call.send(frame(QUIET, 0))  # nobody reads yet: queued behind the Hello
    events = call.events()
    assert isinstance(await anext(events), Hello)
    assert await anext(events) == AudioOut(data=QUIET, sequence=0)
    reading = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0)  # the reader now waits, nothing unread
    await call.send(frame(QUIET, 1))
    assert taken == [AudioOut(data=QUIET, sequence=1)]
    accepting[0] = False
    await call.send(frame(QUIET, 2))
    assert await asyncio.wait_for(reading, 5) == AudioOut(data=QUIET, sequence=2)
    assert taken == [AudioOut(data=QUIET, sequence=1)]


def test_a_script_file_loads_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    good = tmp_path / "voice.yaml"
    good.write_text("echo: true\nturns:\n  - hear_frames: 2\n    transcript: hi\n")
    assert load_voice_script(str(good)).echo
    bad = tmp_path / "bad.yaml"
    bad.write_text("turns:\n  - hear_frame: 2\n")
    with pytest.raises(ScriptError, match="voice script"):
        load_voice_script(str(bad))


async def _all(events: object) -> list[DuplexEvent]:
    return [event async for event in events]  # type: ignore[attr-defined]
