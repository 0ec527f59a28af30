"""Fuzz the inbound binary decoder and the voice core together: any sequence of frames,
hangups and runtime events gets a defined answer and never an exception, and every
frame the core queues is one a client can decode."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portico.errors import RateLimited
from portico.protocols.omnia.binary import (
    BinaryFrame,
    BinaryFrameError,
    BinaryMetadata,
    decode_frame,
    encode_frame,
)
from portico.protocols.omnia.connection import ConnectionLimits, LimitHit, OmniaConnection
from portico.protocols.omnia.frames import server_frame_decoder
from portico.protocols.omnia.voice import CallAudio, CallRequested, CallState, VoiceLimits
from portico.protocols.outbox import BinaryData
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

small = st.integers(min_value=0, max_value=5)
metadata = st.builds(
    BinaryMetadata,
    session_id=st.none() | st.text(max_size=5),
    mime_type=st.none() | st.sampled_from(["audio/pcm", "audio/pcm;rate=16000", "x"]),
    total_chunks=st.none() | st.integers(min_value=-1, max_value=4),
    sample_rate=st.none() | st.sampled_from([0, 8000, 16000, 10**9]),
    channels=st.none() | st.integers(min_value=-1, max_value=9),
    codec=st.none() | st.sampled_from(["pcm", "pcm16", "opus", ""]),
)
frames = st.builds(
    BinaryFrame,
    chunked=st.booleans(),
    is_last=st.booleans(),
    sequence=small,
    media_id=st.sampled_from(["", "a", "b"]),
    metadata=metadata,
    payload=st.binary(max_size=300),
).map(encode_frame)
garbage = st.binary(max_size=80) | st.binary(min_size=32, max_size=64).map(
    lambda b: b"OMNI\x01" + b
)
runtime_events = st.sampled_from(
    [
        Hello(format=AudioFormat(sample_rate=24000)),
        AudioOut(data=b"\x00" * 10),
        AudioOut(data=b"\x01" * 10, is_last=True),
        AgentText("hi"),
        Transcript("you", final=True),
        Transcript("yo", final=False),
        Interruption(),
        SpokenTurnDone(),
        DuplexFailure("PROVIDER_UNAVAILABLE", "down"),
    ]
)
steps = st.lists(
    st.tuples(st.just("binary"), frames | garbage)
    | st.tuples(st.just("text"), st.sampled_from(['{"type":"hangup"}', '{"type":"hangup"']))
    | st.tuples(st.just("event"), runtime_events)
    | st.tuples(st.just("ended"), st.none())
    | st.tuples(st.just("refuse"), st.none()),
    max_size=40,
)


def check_output(conn: OmniaConnection) -> int:
    count = 0
    for item in conn.data_to_send():
        count += 1
        if isinstance(item, BinaryData):
            decode_frame(item)  # a client can decode what it is sent
        else:
            server_frame_decoder.decode(item)
    return count


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=steps, binary=st.booleans(), burst=st.sampled_from([100, 600, 10**6]))
def test_any_sequence_gets_defined_answers_and_decodable_frames(
    steps: list[tuple[str, Any]], binary: bool, burst: int
) -> None:
    limits = ConnectionLimits(max_payload_size=2**24, ping_interval=30, pong_timeout=60)
    conn = OmniaConnection(
        session_id="s",
        binary=binary,
        limits=limits,
        now=0.0,
        wall=0.0,
        voice=VoiceLimits(bytes_per_second=burst, burst_bytes=burst),
    )
    check_output(conn)
    assert conn.voice is not None
    now = 0.0
    rate_run = False  # the last audio answer was RATE_LIMITED: its run is answered
    for kind, value in steps:
        now += 0.01
        if kind == "binary":
            state = conn.voice.state
            events = conn.receive_binary(value, now)
            queued = check_output(conn)
            try:
                decode_frame(value)
            except BinaryFrameError:
                assert events == []
                assert queued == 1
                continue
            calls = [e for e in events if isinstance(e, CallRequested | CallAudio)]
            if any(isinstance(e, LimitHit) for e in events):
                rate_run = True
            elif calls:
                rate_run = False
            # A valid frame is taken, refused with one error, part of a transfer still
            # arriving, or dropped in silence only where its call already had its error.
            assert (
                calls
                or queued
                or rate_run
                or state in (CallState.REFUSED, CallState.ENDING)
                or decode_frame(value).chunked
            ), (state, value)
        elif kind == "text":
            conn.receive_text(value, now)
            rate_run = False
        elif kind == "event":
            conn.send_duplex_event(value, now)
        elif kind == "ended":
            conn.call_ended()
            rate_run = False
        else:
            conn.refuse_call(RateLimited("x"), now)
        check_output(conn)
        assert conn.voice.state in CallState
