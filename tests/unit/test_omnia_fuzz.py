"""Fuzz the `/ws` decoder: any input gets a defined answer, never an exception."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portico.protocols.omnia.connection import ConnectionLimits, MessageReceived, OmniaConnection
from portico.protocols.omnia.frames import server_frame_decoder

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
frame_types = st.sampled_from(
    ["message", "upload_request", "tool_result", "tool_call_ack", "tool_call_nack", "hangup", "x"]
)
frames = st.builds(
    lambda kind, body: {"type": kind, **body},
    frame_types,
    st.dictionaries(
        st.sampled_from(
            [
                "content",
                "parts",
                "session_id",
                "metadata",
                "declare",
                "tool_result",
                "upload_request",
            ]
        ),
        json_values,
        max_size=4,
    ),
)


def fresh() -> OmniaConnection:
    limits = ConnectionLimits(max_payload_size=1024, ping_interval=30, pong_timeout=60)
    conn = OmniaConnection(session_id="s", binary=False, limits=limits, now=0)
    conn.data_to_send()
    return conn


def check_answer(conn: OmniaConnection, events: list[Any]) -> None:
    """Either events and no error, or exactly one valid error frame and no event."""
    out = conn.data_to_send()
    for frame in out:
        server_frame_decoder.decode(frame)
    if events:
        assert out == []
    else:
        assert len(out) <= 1
        if out:
            assert json.loads(out[0])["error"]["code"] == "INVALID_MESSAGE"


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    conn = fresh()
    check_answer(conn, conn.receive_text(data, now=1.0))


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(frames)
def test_structured_frames_get_an_event_or_one_invalid_message(frame: dict[str, Any]) -> None:
    conn = fresh()
    events = conn.receive_text(json.dumps(frame), now=1.0)
    check_answer(conn, events)
    for event in events:
        if isinstance(event, MessageReceived):
            assert event.content or event.parts
