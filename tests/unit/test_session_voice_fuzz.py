"""Fuzz the `/v1/session` voice cores: any sequence of binary frames (well formed or
not), connection changes and call refusals gets a defined answer, never an exception,
and a refused frame changes nothing; any sequence of runtime events makes turns that
each end exactly once, with nothing after their end."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from portico.core.events import TurnChunk, TurnCompleted, TurnMediaChunk
from portico.protocols.omnia.binary import BinaryFrame, BinaryMetadata, encode_frame
from portico.protocols.omnia.voice import VoiceLimits
from portico.protocols.session import frames as f
from portico.protocols.session.voice import CallerItems, SpokenTurns
from portico.runtime.duplex.base import (
    AgentText,
    AudioFormat,
    AudioOut,
    DuplexFailure,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)

HEARD = f.AudioFormat(codec="pcm16", sample_rate=16000, channels=1)
CODES = {"INVALID_MESSAGE", "UNSATISFIABLE_FORMAT", "RATE_LIMITED"}

metadata = st.builds(
    BinaryMetadata,
    mime_type=st.none() | st.sampled_from(["audio/pcm", "x"]),
    sample_rate=st.none() | st.sampled_from([0, 16000, 48000]),
    channels=st.none() | st.integers(min_value=-1, max_value=3),
    codec=st.none() | st.sampled_from(["pcm", "pcm16", "opus", ""]),
)
frames = st.builds(
    BinaryFrame,
    chunked=st.booleans(),
    is_last=st.booleans(),
    sequence=st.integers(min_value=0, max_value=4),
    media_id=st.sampled_from(["", "a", "b"]),
    metadata=metadata,
    payload=st.binary(max_size=300),
).map(encode_frame)
garbage = st.binary(max_size=80) | st.binary(min_size=28, max_size=64).map(
    lambda b: b"OMNI\x01" + b
)
inbound = st.lists(
    st.tuples(st.just("frame"), frames | garbage, st.floats(min_value=0, max_value=0.5))
    | st.tuples(st.just("changed"), st.none(), st.just(0.0))
    | st.tuples(st.just("refuse"), st.none(), st.just(0.0)),
    max_size=50,
)


def snapshot(items: CallerItems) -> tuple[Any, ...]:
    item = items._item
    return (items.open_item, item and item.next_sequence, item and item.refused, items._heard)


@settings(max_examples=200, deadline=None)
@given(inbound)
def test_caller_items_answer_every_input_and_refusals_change_nothing(
    steps: list[tuple[str, bytes | None, float]],
) -> None:
    items = CallerItems(HEARD, VoiceLimits(bytes_per_second=2000, burst_bytes=1000))
    now = 0.0
    heard = 0
    for kind, data, later in steps:
        now += later
        if kind == "changed":
            items.connection_changed()
            assert items.open_item is None
            continue
        if kind == "refuse":
            items.refuse()
            continue
        assert data is not None
        before = snapshot(items)
        audio, errors = items.receive(data, now)
        assert len(errors) <= 1
        for error in errors:
            assert error.code in CODES
            if error.code != "RATE_LIMITED":
                assert audio == []
                assert snapshot(items) == before  # a refused frame changes nothing
        for frame in audio:
            assert frame.data  # empty frames end items; they are never heard
            assert frame.sequence == heard  # the call hears in order, without gaps
            assert not frame.is_last
            heard += 1


events = st.sampled_from(
    [
        Hello(format=AudioFormat(sample_rate=24000)),
        AudioOut(data=b"\x00" * 10),
        AudioOut(data=b"\x01" * 10, media_id="x", is_last=True),
        AgentText("hi"),
        Transcript("you"),
        Transcript("yo", final=False),
        Transcript(""),
        Interruption(),
        SpokenTurnDone(),
        SpokenTurnDone(content="said"),
        DuplexFailure("PROVIDER_UNAVAILABLE", "down"),
        None,  # the call ended
    ]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(events, max_size=40), st.booleans())
def test_spoken_turns_each_end_once_and_nothing_follows_their_end(
    stream: list[Any], transcripts: bool
) -> None:
    spoken = SpokenTurns("s", transcripts=transcripts)
    ended: set[str] = set()
    open_items: dict[tuple[str, str], int] = {}  # (turn, media id) -> next sequence
    for event in stream:
        for out in spoken.cut() if event is None else spoken.on_event(event):
            if isinstance(out, f.Transcript):
                assert transcripts
                assert out.text
                f.server_frame_decoder.decode(f.encode(out))
                continue
            turn = out.turn_id
            if isinstance(out, f.Error):
                f.server_frame_decoder.decode(f.encode(out))
                if turn is None:
                    continue
            assert turn is not None
            assert turn not in ended
            if isinstance(out, TurnCompleted | f.Error):
                ended.add(turn)
                assert spoken.turn_id is None
                if isinstance(out, TurnCompleted) and not out.cancelled:
                    # A finished turn's speech ended whole: every stream got its last frame.
                    assert not [key for key in open_items if key[0] == turn]
            elif isinstance(out, TurnMediaChunk):
                key = (turn, out.chunk.media_id)
                assert out.chunk.sequence == open_items.get(key, 0)
                open_items[key] = out.chunk.sequence + 1
                if out.chunk.is_last:
                    del open_items[key]
            else:
                assert isinstance(out, TurnChunk)
