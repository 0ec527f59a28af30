"""The `/ws` protocol core, sans-I/O: every rule in microseconds, no socket."""

from __future__ import annotations

import json
from typing import Any

import pytest

from portico.core.events import TurnChunk, TurnCompleted, TurnFailed, TurnMediaChunk, TurnToolCall
from portico.core.model import ContentPart, MediaContent
from portico.errors import SessionExpired, TurnInProgress
from portico.protocols.omnia.binary import media_frames
from portico.protocols.omnia.connection import (
    ConnectionLimits,
    Keepalive,
    LimitHit,
    MessageReceived,
    OmniaConnection,
    ToolReply,
    UploadRequested,
)
from portico.runtime.base import MediaChunk, ToolCall

OWN = "sess-own"


def make(now: float = 0.0, *, binary: bool = False, **limits: Any) -> OmniaConnection:
    options: dict[str, Any] = {
        "max_payload_size": 1024,
        "ping_interval": 30.0,
        "pong_timeout": 60.0,
        **limits,
    }
    return OmniaConnection(
        session_id=OWN, binary=binary, limits=ConnectionLimits(**options), now=now
    )


def sent(conn: OmniaConnection) -> list[dict[str, Any]]:
    return [json.loads(frame) for frame in conn.data_to_send()]


def opened() -> OmniaConnection:
    conn = make()
    conn.data_to_send()  # drop `connected`
    return conn


def receive(conn: OmniaConnection, frame: dict[str, Any] | str) -> list[Any]:
    return conn.receive_text(frame if isinstance(frame, str) else json.dumps(frame), now=1.0)


def refusal(conn: OmniaConnection, frame: dict[str, Any] | str) -> dict[str, Any]:
    assert receive(conn, frame) == []
    (error,) = sent(conn)
    assert error["type"] == "error"
    return error


# -- connected -------------------------------------------------------------------------


def test_connected_is_queued_first_and_once() -> None:
    conn = make(binary=True, max_payload_size=77)
    assert sent(conn) == [
        {
            "type": "connected",
            "session_id": OWN,
            "connected": {
                "capabilities": {
                    "binary_frames": True,
                    "max_payload_size": 77,
                    "protocol_version": 1,
                }
            },
        }
    ]
    receive(conn, {"type": "message", "content": "hi"})
    assert sent(conn) == []


# -- messages --------------------------------------------------------------------------


def test_message_without_session_id_joins_the_own_session() -> None:
    (event,) = receive(opened(), {"type": "message", "content": "hi"})
    assert event == MessageReceived(
        session_id=OWN,
        own_session=True,
        content="hi",
        parts=(),
        metadata={},
        directives={},
        declare=None,
    )


@pytest.mark.parametrize("session_id", ["", OWN])
def test_empty_or_own_session_id_is_the_own_session(session_id: str) -> None:
    (event,) = receive(opened(), {"type": "message", "content": "x", "session_id": session_id})
    assert (event.session_id, event.own_session) == (OWN, True)


def test_other_session_id_is_a_resume() -> None:
    (event,) = receive(opened(), {"type": "message", "content": "x", "session_id": "sess-old"})
    assert (event.session_id, event.own_session) == ("sess-old", False)


def test_parts_are_typed_and_validated() -> None:
    frame = {
        "type": "message",
        "parts": [
            {"type": "text", "text": "look"},
            {"type": "image", "media": {"url": "https://x/y.png", "mime_type": "image/png"}},
        ],
    }
    (event,) = receive(opened(), frame)
    assert event.parts == (
        ContentPart(type="text", text="look"),
        ContentPart(type="image", media=MediaContent(mime_type="image/png", url="https://x/y.png")),
    )


@pytest.mark.parametrize(
    "media",
    [
        {"mime_type": "image/png"},
        {"mime_type": "image/png", "url": "u", "data": "ZA=="},
    ],
)
def test_media_needs_exactly_one_source(media: dict[str, Any]) -> None:
    error = refusal(opened(), {"type": "message", "parts": [{"type": "image", "media": media}]})
    assert error["error"]["code"] == "INVALID_MESSAGE"
    assert "exactly one of data, url, storage_ref" in error["error"]["message"]


def test_metadata_splits_reserved_keys_into_directives() -> None:
    metadata = {"user": "u1", "mock_scenario": "echo", "content_type": "x", "omnia.trace": "t"}
    (event,) = receive(opened(), {"type": "message", "content": "x", "metadata": metadata})
    assert event.metadata == {"user": "u1"}
    assert event.directives == {"mock_scenario": "echo", "content_type": "x", "omnia.trace": "t"}


def test_metadata_limits_are_exact_boundaries() -> None:
    at_limit = {f"k{i:02}": "v" for i in range(32)}
    assert receive(opened(), {"type": "message", "content": "x", "metadata": at_limit})
    key64 = {"k" * 64: "x" * 8192}
    assert receive(opened(), {"type": "message", "content": "x", "metadata": key64})
    # 4 values of 8 KiB minus their keys: exactly 32 KiB in all is allowed.
    exact = {f"k{i}": "x" * (8192 - 2) for i in range(4)}
    assert receive(opened(), {"type": "message", "content": "x", "metadata": exact})
    over = {**exact, "k0": "x" * (8192 - 1)}
    assert (
        "32 KiB"
        in refusal(opened(), {"type": "message", "content": "x", "metadata": over})["error"][
            "message"
        ]
    )


def test_refused_message_error_names_the_session_it_was_for() -> None:
    frame = {"type": "message", "content": "x", "session_id": "sess-b", "metadata": {"": "v"}}
    assert refusal(opened(), frame)["session_id"] == "sess-b"


def test_declare_limit_is_16_kib_encoded() -> None:
    # {"a":"xxx..."} is 8 bytes of JSON around the value.
    fits = {"a": "x" * (16 * 1024 - 8)}
    assert receive(opened(), {"type": "message", "content": "x", "declare": fits})
    over = {"a": "x" * (16 * 1024 - 7)}
    error = refusal(opened(), {"type": "message", "content": "x", "declare": over})
    assert "16 KiB" in error["error"]["message"]


def test_malformed_json_is_invalid_message() -> None:
    error = refusal(opened(), "{nope")
    assert error["error"]["code"] == "INVALID_MESSAGE"
    assert error["error"]["message"].startswith("Failed to parse message")


def test_undecodable_binary_frame_is_invalid_with_the_reason() -> None:
    conn = opened()
    assert conn.receive_binary(b"OMNI", now=1.0) == []
    (error,) = sent(conn)
    assert error["error"] == {"code": "INVALID_MESSAGE", "message": "invalid header size"}


def test_valid_binary_media_without_audio_is_refused_once_per_connection() -> None:
    conn = opened()
    frames = media_frames(
        media_id="a1", mime_type="audio/pcm", payload=b"\x00" * 10, session_id=OWN
    )
    for _ in range(3):
        conn.receive_binary(frames[0], now=1.0)
    (error,) = sent(conn)
    assert error["error"]["code"] == "MEDIA_NOT_ENABLED"


def test_deeply_nested_json_is_invalid_not_a_crash() -> None:
    nested = '{"type": "message", "content": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert refusal(opened(), nested)["error"]["code"] == "INVALID_MESSAGE"


# -- other client frames ---------------------------------------------------------------


def test_tool_frames_become_tool_replies_with_their_call_id() -> None:
    conn = opened()
    frames = [
        {"type": "tool_call_ack", "tool_call_ack": {"call_id": "c1"}},
        {"type": "tool_call_nack", "tool_call_nack": {"call_id": "c2", "reason": ""}},
        {"type": "tool_result", "tool_result": {"call_id": "c3", "error": "boom"}},
    ]
    events = [event for frame in frames for event in receive(conn, frame)]
    assert [(type(e), e.call_id) for e in events] == [
        (ToolReply, "c1"),
        (ToolReply, "c2"),
        (ToolReply, "c3"),
    ]


def test_upload_request_resolves_its_session() -> None:
    frame = {
        "type": "upload_request",
        "upload_request": {"filename": "a.png", "mime_type": "image/png", "size_bytes": 3},
    }
    (event,) = receive(opened(), frame)
    assert isinstance(event, UploadRequested)
    assert event.session_id == OWN


@pytest.mark.parametrize(
    "frame",
    [{"type": "hangup"}, {"type": "disclosure_ack"}, {"type": "credential_refresh", "token": "t"}],
)
def test_frames_without_a_reply_produce_nothing(frame: dict[str, Any]) -> None:
    conn = opened()
    assert receive(conn, frame) == []
    assert sent(conn) == []


# -- engine events to frames -----------------------------------------------------------


def test_turn_events_become_frames_with_the_session_id() -> None:
    conn = opened()
    chunk = MediaChunk(
        media_id="m1", mime_type="audio/pcm", data=b"\x00\x01", sequence=0, is_last=True
    )
    call = ToolCall(id="c1", name="where", arguments={"q": 1}, categories=("location",))
    for event in (
        TurnChunk("s1", "t1", "Hel"),
        TurnMediaChunk("s1", "t1", chunk),
        TurnToolCall("s1", "t1", call),
        TurnCompleted("s1", "t1", "Hello"),
        TurnFailed("s1", "t2", "PROVIDER_TIMEOUT", "slow"),
    ):
        conn.send_turn_event(event)
    assert sent(conn) == [
        {"type": "chunk", "content": "Hel", "session_id": "s1"},
        {
            "type": "media_chunk",
            "media_chunk": {
                "media_id": "m1",
                "sequence": 0,
                "is_last": True,
                "data": "AAE=",
                "mime_type": "audio/pcm",
            },
            "session_id": "s1",
        },
        {
            "type": "tool_call",
            "tool_call": {
                "id": "c1",
                "name": "where",
                "arguments": {"q": 1},
                "categories": ["location"],
            },
            "session_id": "s1",
        },
        {"type": "done", "content": "Hello", "session_id": "s1"},
        {
            "type": "error",
            "error": {"code": "PROVIDER_TIMEOUT", "message": "slow"},
            "session_id": "s1",
        },
    ]


def test_errors_carry_their_wire_code() -> None:
    conn = opened()
    conn.send_error(SessionExpired(), "s9")
    conn.send_error(TurnInProgress("s9"))
    expired, busy = sent(conn)
    assert expired == {
        "type": "error",
        "error": {
            "code": "SESSION_EXPIRED",
            "message": "session context has expired; start a new session",
        },
        "session_id": "s9",
    }
    assert busy["error"]["code"] == "TURN_IN_PROGRESS"


# -- keepalive ------------------------------------------------------------------------


def test_ping_is_due_every_interval() -> None:
    conn = make(now=100.0, ping_interval=30.0, pong_timeout=60.0)
    assert conn.keepalive(129.9) is None
    assert conn.keepalive(130.0) is Keepalive.PING
    assert conn.keepalive(130.1) is None
    assert conn.next_deadline() == pytest.approx(160.0)


def test_silence_for_pong_timeout_closes_and_any_frame_resets_it() -> None:
    conn = make(now=0.0, ping_interval=30.0, pong_timeout=60.0)
    conn.receive_control(now=50.0)  # a pong
    assert conn.keepalive(109.0) is not Keepalive.CLOSE
    assert conn.keepalive(110.0) is Keepalive.CLOSE
    conn.receive_text('{"type": "hangup"}', now=110.0)
    assert conn.keepalive(111.0) is not Keepalive.CLOSE


# -- limits ---------------------------------------------------------------------------


def test_message_rate_is_limited_with_burst_and_refill() -> None:
    conn = make(messages_per_second=10, message_burst=3)
    conn.data_to_send()
    frame = json.dumps({"type": "message", "content": "x"})
    accepted = [isinstance(conn.receive_text(frame, now=0.0)[0], MessageReceived) for _ in range(4)]
    assert accepted == [True, True, True, False]
    (refused,) = sent(conn)
    assert refused["error"]["code"] == "RATE_LIMITED"
    # 0.1 s later one token is back.
    assert isinstance(conn.receive_text(frame, now=0.1)[0], MessageReceived)
    assert conn.receive_text(frame, now=0.1) == [LimitHit("messages")]


def test_inline_media_counts_against_the_media_byte_rate() -> None:
    conn = make(media_bytes_per_second=100)
    conn.data_to_send()
    part = {"type": "image", "media": {"data": "A" * 80, "mime_type": "image/png"}}
    frame = json.dumps({"type": "message", "parts": [part]})
    assert isinstance(conn.receive_text(frame, now=0.0)[0], MessageReceived)
    assert conn.receive_text(frame, now=0.0) == [LimitHit("media_bytes")]
    assert sent(conn)[0]["error"]["code"] == "RATE_LIMITED"


def test_binary_frames_count_against_the_media_byte_rate() -> None:
    conn = make(media_bytes_per_second=50)
    conn.data_to_send()
    assert conn.receive_binary(b"x" * 60, now=0.0) == [LimitHit("media_bytes")]


def test_send_queue_overflow_stops_queueing_and_flags_the_connection() -> None:
    conn = make(max_send_queue_bytes=200)
    conn.data_to_send()
    for n in range(10):
        conn.send_turn_event(TurnChunk("s1", "t1", f"chunk {n}"))
    assert conn.overflowed
    queued = []
    while (frame := conn.next_frame()) is not None:
        queued.append(json.loads(frame)["content"])
    assert 0 < len(queued) < 10
    assert queued == [f"chunk {n}" for n in range(len(queued))]  # in order, no gaps


def test_a_reading_client_never_overflows() -> None:
    conn = make(max_send_queue_bytes=200)
    conn.data_to_send()
    for n in range(100):
        conn.send_turn_event(TurnChunk("s1", "t1", f"chunk {n}"))
        assert conn.next_frame() is not None
    assert not conn.overflowed
