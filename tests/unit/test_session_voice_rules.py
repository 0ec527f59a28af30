"""`/v1/session` voice, sans-I/O: the input format choice, the client's audio items
(every rule and every refusal), the call's events as numbered messages and spoken
turns, and the client's barge-in in the call rules."""

from __future__ import annotations

import itertools

import pytest

from portico.calls.rules import CallRules
from portico.core.events import TurnChunk, TurnCompleted, TurnMediaChunk
from portico.domain.states import TurnState
from portico.protocols.omnia.binary import (
    INVALID_HEADER_SIZE,
    INVALID_MAGIC,
    BinaryFrame,
    BinaryMetadata,
    encode_frame,
)
from portico.protocols.omnia.voice import AUDIO_RATE, VoiceLimits
from portico.protocols.session import frames as f
from portico.protocols.session.media import choose_audio, choose_input
from portico.protocols.session.voice import (
    ITEM_FORMAT,
    ITEM_OPEN,
    ITEM_ORDER,
    NO_ITEM_ID,
    UNKNOWN_ITEM,
    CallerItems,
    SpokenTurns,
    runtime_format,
)
from portico.runtime.duplex.base import (
    AgentText,
    AudioFormat,
    AudioIn,
    AudioOut,
    DuplexFailure,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)

HEARD = f.AudioFormat(codec="pcm16", sample_rate=16000, channels=1)
LIMITS = VoiceLimits(bytes_per_second=1000, burst_bytes=4000)


def frame(
    item: str, sequence: int, payload: bytes = b"ab", *, last: bool = False, **meta: object
) -> bytes:
    return encode_frame(
        BinaryFrame(
            media_id=item,
            sequence=sequence,
            is_last=last,
            metadata=BinaryMetadata(**meta),  # type: ignore[arg-type]
            payload=payload,
        )
    )


# -- negotiation --------------------------------------------------------------------------------


def test_input_is_the_first_pcm16_format_in_range_spelled_out() -> None:
    offer = f.AudioOffer(
        input=(
            f.AudioFormat(codec="opus", sample_rate=48000),  # not heard: no transcoding
            f.AudioFormat(codec="pcm16"),  # no rate
            f.AudioFormat(codec="pcm16", sample_rate=4000),  # out of range
            f.AudioFormat(codec="pcm16", sample_rate=16000, channels=9),
            f.AudioFormat(mime_type="audio/pcm;rate=24000", sample_rate=24000),
        )
    )
    assert choose_input(offer) == f.AudioFormat(codec="pcm16", sample_rate=24000, channels=1)
    assert choose_input(f.AudioOffer(input=(f.AudioFormat(codec="PCM", sample_rate=8000),))) == (
        f.AudioFormat(codec="pcm16", sample_rate=8000, channels=1)
    )
    assert choose_input(None) is None


def test_input_is_chosen_only_for_an_agent_that_takes_calls() -> None:
    offer = f.AudioOffer(input=(HEARD,))
    assert choose_audio(offer, hears=True) == f.AudioChoice(input=HEARD, output=None)
    assert choose_audio(offer, hears=False) is None
    both = f.AudioOffer(input=(HEARD,), output=(f.AudioFormat(codec="pcm16"),))
    assert choose_audio(both, hears=True) == f.AudioChoice(
        input=HEARD, output=f.AudioFormat(codec="pcm16")
    )
    assert runtime_format(HEARD) == AudioFormat(codec="pcm16", sample_rate=16000, channels=1)


# -- the client's audio items -------------------------------------------------------------------


def test_an_item_goes_to_the_call_in_order_and_ends_with_is_last() -> None:
    items = CallerItems(HEARD, LIMITS)
    heard: list[AudioIn] = []
    for data in (
        frame("c1", 0, b"a", codec="pcm16", sample_rate=16000, channels=1),
        frame("c1", 1, b"b"),
        frame("c1", 2, b"c", last=True),
        frame("c2", 0, b"d"),
        frame("c2", 1, b"", last=True),  # an empty last frame ends the item, hears nothing
    ):
        audio, errors = items.receive(data, 0.0)
        assert errors == []
        heard += audio
    assert [a.data for a in heard] == [b"a", b"b", b"c", b"d"]
    assert [a.sequence for a in heard] == [0, 1, 2, 3]  # the call's order, across items
    assert not any(a.is_last for a in heard)  # an item's end is not the call's end
    assert items.open_item is None


@pytest.mark.parametrize(
    ("frames", "code", "message"),
    [
        ([frame("c1", 3)], "INVALID_MESSAGE", UNKNOWN_ITEM),
        ([frame("c1", 0), frame("zz", 1)], "INVALID_MESSAGE", UNKNOWN_ITEM),
        ([frame("c1", 0), frame("c2", 0)], "INVALID_MESSAGE", ITEM_OPEN),
        ([frame("c1", 0), frame("c1", 2)], "INVALID_MESSAGE", ITEM_ORDER),
        ([frame("c1", 0), frame("c1", 0)], "INVALID_MESSAGE", ITEM_ORDER),  # a duplicate
        ([frame("", 0)], "INVALID_MESSAGE", NO_ITEM_ID),
        ([frame("c1", 0, sample_rate=48000)], "UNSATISFIABLE_FORMAT", ITEM_FORMAT),
        ([frame("c1", 0, codec="opus")], "UNSATISFIABLE_FORMAT", ITEM_FORMAT),
        ([frame("c1", 0, channels=2)], "UNSATISFIABLE_FORMAT", ITEM_FORMAT),
        ([b"OMNI" + bytes(10)], "INVALID_MESSAGE", INVALID_HEADER_SIZE),
        ([b"XXXX" + bytes(40)], "INVALID_MESSAGE", INVALID_MAGIC),
    ],
)
def test_every_broken_frame_has_its_error_and_changes_nothing(
    frames: list[bytes], code: str, message: str
) -> None:
    items = CallerItems(HEARD, LIMITS)
    *before, bad = frames
    for data in before:
        assert items.receive(data, 0.0)[1] == []
    state = (items.open_item, items._item and items._item.next_sequence, items._heard)
    audio, errors = items.receive(bad, 0.0)
    assert audio == []
    assert [(e.code, e.message) for e in errors] == [(code, message)]
    assert (items.open_item, items._item and items._item.next_sequence, items._heard) == state
    # The same refusal again says nothing more.
    assert items.receive(bad, 0.0) == ([], [])


def test_a_refusal_is_told_again_once_a_frame_was_accepted() -> None:
    items = CallerItems(HEARD, LIMITS)
    stray = frame("zz", 7)
    assert len(items.receive(stray, 0.0)[1]) == 1
    assert items.receive(stray, 0.0)[1] == []
    assert items.receive(frame("c1", 0), 0.0)[1] == []
    assert [e.message for e in items.receive(stray, 0.0)[1]] == [UNKNOWN_ITEM]


def test_errors_name_the_item_and_what_was_expected() -> None:
    items = CallerItems(HEARD, LIMITS)
    items.receive(frame("c1", 0), 0.0)
    _, (error,) = items.receive(frame("c1", 5), 0.0)
    assert error.details == {"item_id": "c1", "expected_sequence": 1}
    _, (unknown,) = items.receive(frame("c9", 4), 0.0)
    assert unknown.details == {"item_id": "c9"}
    _, (fmt,) = items.receive(frame("c1", 0, sample_rate=8000), 0.0)  # c1 is open
    assert fmt.message == ITEM_ORDER
    items.receive(frame("c1", 1, last=True), 0.0)
    _, (fmt,) = items.receive(frame("c2", 0, sample_rate=8000), 0.0)
    assert fmt.details == {
        "item_id": "c2",
        "input": {"codec": "pcm16", "sample_rate": 16000, "channels": 1},
    }


def test_audio_over_the_byte_rate_is_dropped_with_one_error_per_run() -> None:
    items = CallerItems(HEARD, VoiceLimits(bytes_per_second=100, burst_bytes=300))
    big = b"x" * 200
    assert items.receive(frame("c1", 0, big), 0.0)[0] != []
    audio, errors = items.receive(frame("c1", 1, big), 0.0)
    assert audio == []
    assert [(e.code, e.message) for e in errors] == [("RATE_LIMITED", AUDIO_RATE)]
    assert items.receive(frame("c1", 2, big), 0.0) == ([], [])  # same run: no second error
    # The dropped frames still count in the item's order: the next one is expected.
    audio, errors = items.receive(frame("c1", 3, big), 10.0)
    assert errors == []
    assert [a.data for a in audio] == [big]


def test_a_connection_change_loses_the_open_item() -> None:
    items = CallerItems(HEARD, LIMITS)
    items.receive(frame("c1", 0), 0.0)
    items.connection_changed()
    assert items.open_item is None
    _, errors = items.receive(frame("c1", 1), 0.0)  # the rest of the lost item
    assert [e.message for e in errors] == [UNKNOWN_ITEM]
    audio, errors = items.receive(frame("c2", 0, b"new"), 0.0)  # the next audio: a new item
    assert errors == []
    assert [a.data for a in audio] == [b"new"]


def test_a_refused_items_frames_are_dropped_silently_and_the_next_item_retries() -> None:
    items = CallerItems(HEARD, LIMITS)
    assert items.receive(frame("c1", 0), 0.0)[0] != []
    items.refuse()  # the call could not start
    assert items.receive(frame("c1", 1), 0.0) == ([], [])
    assert items.receive(frame("c1", 2, last=True), 0.0) == ([], [])
    assert [a.data for a in items.receive(frame("c2", 0, b"again"), 0.0)[0]] == [b"again"]


# -- the call's events as messages --------------------------------------------------------------


def turns(transcripts: bool = True) -> SpokenTurns:
    ids = (f"vturn-{n}" for n in itertools.count(1))
    return SpokenTurns("s1", transcripts=transcripts, new_turn_id=lambda: next(ids))


def test_a_spoken_turn_is_chunks_speech_and_one_done_with_its_items_ended() -> None:
    spoken = turns()
    out = []
    for event in (
        Hello(format=AudioFormat(sample_rate=24000)),
        Transcript("hel", final=False),
        Transcript("hello"),
        AgentText("Hi"),
        AudioOut(data=b"1"),
        AudioOut(data=b"2"),
        SpokenTurnDone(),
    ):
        out += spoken.on_event(event)
    partial, final, chunk, first, second, end, done = out
    assert partial == f.Transcript(seq=0, role="user", text="hel", final=False)
    assert final == f.Transcript(seq=0, role="user", text="hello")
    assert chunk == TurnChunk(session_id="s1", turn_id="vturn-1", text="Hi")
    assert isinstance(first, TurnMediaChunk)
    assert isinstance(second, TurnMediaChunk)
    assert first.chunk.mime_type == "audio/pcm;rate=24000;channels=1"
    assert [first.chunk.sequence, second.chunk.sequence] == [0, 1]
    assert isinstance(end, TurnMediaChunk)  # the runtime marked no last frame: an empty one
    assert (end.chunk.data, end.chunk.is_last, end.chunk.sequence) == (b"", True, 2)
    assert done == TurnCompleted(session_id="s1", turn_id="vturn-1", content="Hi")
    # The next spoken turn is a new turn.
    assert spoken.on_event(AgentText("again")) == [
        TurnChunk(session_id="s1", turn_id="vturn-2", text="again")
    ]


def test_transcripts_need_the_capability_and_text() -> None:
    assert turns(transcripts=False).on_event(Transcript("hello")) == []
    assert turns().on_event(Transcript("")) == []


def test_a_barge_in_ends_the_turn_cancelled_with_what_was_said() -> None:
    spoken = turns()
    spoken.on_event(AgentText("Once upon"))
    spoken.on_event(AudioOut(data=b"1"))
    (done,) = spoken.on_event(Interruption())
    assert done == TurnCompleted(
        session_id="s1", turn_id="vturn-1", content="Once upon", cancelled=True
    )
    assert spoken.turn_id is None
    assert spoken.on_event(Interruption()) == []  # nothing in progress: nothing to end
    assert spoken.cut() == []


def test_a_failure_ends_the_open_turn_with_an_error_else_is_a_call_error() -> None:
    spoken = turns()
    spoken.on_event(AgentText("x"))
    (error,) = spoken.on_event(DuplexFailure("PROVIDER_UNAVAILABLE", "down"))
    assert isinstance(error, f.Error)
    assert error.turn_id == "vturn-1"
    assert error.error == f.ErrorInfo(
        code="DUPLEX_ERROR", message="down", details={"reason": "PROVIDER_UNAVAILABLE"}
    )
    (error,) = spoken.on_event(DuplexFailure("SECRET", "a stack trace"))
    assert error == f.Error(seq=0, error=f.ErrorInfo(code="DUPLEX_ERROR", message="internal error"))


def test_a_done_with_nothing_said_is_no_turn_and_a_runtime_content_wins() -> None:
    spoken = turns()
    assert spoken.on_event(SpokenTurnDone()) == []
    (done,) = spoken.on_event(SpokenTurnDone(content="Hello!"))
    assert done == TurnCompleted(session_id="s1", turn_id="vturn-1", content="Hello!")


# -- the client's barge-in in the call rules ----------------------------------------------------


def test_a_client_interrupt_cancels_the_spoken_turn_and_mutes_its_rest() -> None:
    rules = CallRules()
    rules.feed(Hello(format=AudioFormat()))
    rules.feed(Transcript("tell me a story"))
    rules.feed(AgentText("Once "))
    rules.feed(AudioOut(data=b"1"))
    step = rules.interrupt()
    assert step.forward == [Interruption()]
    (record,) = step.records
    assert (record.user_text, record.reply_text, record.state) == (
        "tell me a story",
        "Once ",
        TurnState.CANCELLED,
    )
    # The rest of that turn is not forwarded, its end neither; then all is heard again.
    for event in (AgentText("upon"), AudioOut(data=b"2"), SpokenTurnDone()):
        assert rules.feed(event).forward == []
    assert rules.feed(AgentText("Next")).forward == [AgentText("Next")]


def test_a_client_interrupt_with_nothing_spoken_does_nothing() -> None:
    rules = CallRules()
    assert rules.interrupt().forward == []  # before the runtime's hello
    rules.feed(Hello(format=AudioFormat()))
    rules.feed(Transcript("hi"))
    assert rules.interrupt().forward == []  # the agent has not spoken yet
    assert rules.feed(AgentText("Hello")).forward == [AgentText("Hello")]


def test_a_new_utterance_unmutes_and_a_runtime_barge_in_ends_the_muted_turn() -> None:
    rules = CallRules()
    rules.feed(Hello(format=AudioFormat()))
    rules.feed(AgentText("a"))
    rules.interrupt()
    assert rules.feed(Interruption()).forward == []  # the runtime noticed too: swallowed
    assert rules.feed(AgentText("b")).forward == [AgentText("b")]
    rules.interrupt()
    assert rules.feed(Transcript("again")).forward == [Transcript("again")]
    assert rules.feed(AgentText("c")).forward == [AgentText("c")]
