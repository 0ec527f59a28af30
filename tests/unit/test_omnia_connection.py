"""The `/ws` protocol core, sans-I/O: every rule in microseconds, no socket."""

from __future__ import annotations

import base64
import json
import re
from datetime import datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portico.core.events import (
    TurnChunk,
    TurnCompleted,
    TurnFailed,
    TurnMediaChunk,
    TurnToolCall,
    TurnToolCallTimedOut,
)
from portico.domain.model import ContentPart, MediaContent
from portico.domain.validation import base64_decoded_size
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
from portico.protocols.omnia.frames import UploadReady
from portico.protocols.timestamps import Timestamps
from portico.runtime.base import MediaChunk, ToolCall

OWN = "sess-own"
WALL = 1_736_424_000.0  # 2025-01-09T12:00:00Z, the wall-clock time at now=0
RFC3339_MILLIS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def make(now: float = 0.0, *, binary: bool = False, **limits: Any) -> OmniaConnection:
    options: dict[str, Any] = {
        "max_payload_size": 1024,
        "ping_interval": 30.0,
        "pong_timeout": 60.0,
        **limits,
    }
    return OmniaConnection(
        session_id=OWN,
        binary=binary,
        limits=ConnectionLimits(**options),
        now=now,
        wall=WALL + now,
    )


def sent(conn: OmniaConnection) -> list[dict[str, Any]]:
    """The queued frames, each checked for its `timestamp` and shown without it."""
    frames = [json.loads(frame) for frame in conn.data_to_send()]
    for frame in frames:
        stamp = frame.pop("timestamp")
        assert RFC3339_MILLIS.fullmatch(stamp), frame
    return frames


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


def invalid(message: str) -> dict[str, Any]:
    """The whole error frame for an `INVALID_MESSAGE` on the connection's own session."""
    return {"type": "error", "error": {"code": "INVALID_MESSAGE", "message": message}}


def accepted(metadata: dict[str, str]) -> MessageReceived:
    """The one event a message with this metadata produces; nothing is sent back."""
    conn = opened()
    (event,) = receive(conn, {"type": "message", "content": "x", "metadata": metadata})
    assert isinstance(event, MessageReceived)
    assert sent(conn) == []
    return event


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


# Each refusal is the whole frame and nothing else: `refusal` asserts no event, so
# no turn can start.
TOO_MANY_KEYS = "metadata has more than 32 keys"
BAD_KEY = "metadata key must be 1 to 64 characters of letters, digits, '_', '.' or '-'"
TOTAL_TOO_BIG = "metadata exceeds 32 KiB in total"
# The allowed key characters, cycled to the length wanted.
KEY_CHARS = "AZaz09_.-"


def key_of(length: int) -> str:
    return (KEY_CHARS * length)[:length]


def message_with(metadata: dict[str, str]) -> dict[str, Any]:
    return {"type": "message", "content": "x", "metadata": metadata}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"type": "launch_missiles"},
            "Failed to parse message: Invalid value 'launch_missiles' - at `$.type`",
        ),
        (
            {"type": "message", "content": 5},
            "Failed to parse message: Expected `str | null`, got `int` - at `$.content`",
        ),
        (
            {"type": "message", "content": "x", "metadata": {"k": 1}},
            "Failed to parse message: Expected `str`, got `int` - at `$.metadata[...]`",
        ),
        (
            {"type": "message", "content": "x", "declare": []},
            "Failed to parse message: Expected `object | null`, got `array` - at `$.declare`",
        ),
        ({"type": "message"}, "a message needs `content` or `parts`"),
        ({"type": "message", "content": "", "parts": []}, "a message needs `content` or `parts`"),
    ],
    ids=[
        "unknown-type",
        "content-wrong-type",
        "metadata-wrong-type",
        "declare-wrong-type",
        "no-content-or-parts",
        "empty-content-and-parts",
    ],
)
def test_invalid_frames_are_refused_with_the_exact_error(raw: dict[str, Any], message: str) -> None:
    assert refusal(opened(), raw) == invalid(message)


def test_33_metadata_keys_are_refused() -> None:
    metadata = {f"k{i:02}": "v" for i in range(33)}
    assert refusal(opened(), message_with(metadata)) == invalid(TOO_MANY_KEYS)


@pytest.mark.parametrize(
    "key",
    ["bad key", "k!", "k/v", "clé", "", key_of(65)],
    ids=["space", "bang", "slash", "non-ascii", "empty", "65-chars"],
)
def test_metadata_key_outside_the_charset_or_length_is_refused(key: str) -> None:
    assert refusal(opened(), message_with({key: "v"})) == invalid(BAD_KEY)


def test_metadata_key_of_64_allowed_characters_is_accepted() -> None:
    key = key_of(64)
    assert set(key) == set(KEY_CHARS)
    assert accepted({key: "v"}).metadata == {key: "v"}


@pytest.mark.parametrize(
    "value",
    [
        "x" * (8 * 1024 + 1),
        "é" * (4 * 1024) + "x",  # 4097 characters, 8193 bytes
        "€" * 2731,  # 2731 characters, 8193 bytes
    ],
    ids=["ascii", "two-byte", "three-byte"],
)
def test_metadata_value_over_8_kib_in_utf8_bytes_is_refused(value: str) -> None:
    assert len(value.encode()) == 8 * 1024 + 1
    error = refusal(opened(), message_with({"big": value}))
    assert error == invalid("metadata value of 'big' exceeds 8 KiB")


@pytest.mark.parametrize(
    "value",
    ["é" * (4 * 1024), "€" * 2730 + "xx"],
    ids=["two-byte", "three-byte"],
)
def test_metadata_value_of_exactly_8_kib_in_utf8_bytes_is_accepted(value: str) -> None:
    assert len(value.encode()) == 8 * 1024
    assert accepted({"big": value}).metadata == {"big": value}


def four_keys_of(value_bytes: int) -> dict[str, str]:
    """Keys `k0`..`k3` (2 bytes each) with two-byte-character values of `value_bytes`."""
    return {f"k{i}": "é" * (value_bytes // 2) + "x" * (value_bytes % 2) for i in range(4)}


def test_metadata_of_exactly_32_kib_in_utf8_bytes_is_accepted() -> None:
    metadata = four_keys_of(8 * 1024 - 2)  # 4 x (2 + 8190) = 32768 bytes
    assert sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items()) == 32 * 1024
    assert accepted(metadata).metadata == metadata


def test_metadata_over_32_kib_in_utf8_bytes_is_refused() -> None:
    metadata = {**four_keys_of(8 * 1024 - 2), "k0": "é" * 4095 + "x"}  # one byte more
    assert sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items()) == 32 * 1024 + 1
    assert refusal(opened(), message_with(metadata)) == invalid(TOTAL_TOO_BIG)


def test_reserved_keys_do_not_count_toward_32_keys() -> None:
    metadata = {f"k{i:02}": "v" for i in range(32)}
    reserved = {"mock_scenario": "echo", "content_type": "text", "omnia.trace": "t"}
    event = accepted({**metadata, **reserved})
    assert (event.metadata, event.directives) == (metadata, reserved)


def test_reserved_values_are_exempt_from_the_value_and_total_limits() -> None:
    metadata = four_keys_of(8 * 1024 - 2)  # the 32 KiB total, reached by forwarded keys
    reserved = {"omnia.big": "x" * 9000, "mock_scenario": "é" * 5000, "content_type": "t" * 9000}
    event = accepted({**metadata, **reserved})
    assert (event.metadata, event.directives) == (metadata, reserved)


def test_refused_message_error_names_the_session_it_was_for() -> None:
    frame = {"type": "message", "content": "x", "session_id": "sess-b", "metadata": {"": "v"}}
    assert refusal(opened(), frame)["session_id"] == "sess-b"


def test_empty_declare_is_accepted() -> None:
    conn = opened()
    (event,) = receive(conn, {"type": "message", "content": "x", "declare": {}})
    assert (event.declare, event.declare_too_large) == ({}, False)
    assert sent(conn) == []


def test_declare_over_16_kib_encoded_is_flagged_for_the_adapter() -> None:
    """Only the archive knows whether this message opens its session (and so whether
    the declaration is read and refused, or ignored): the core flags it, refuses nothing."""
    # {"a":"xxx..."} is 8 bytes of JSON around the value.
    fits = {"a": "x" * (16 * 1024 - 8)}
    over = {"a": "x" * (16 * 1024 - 7)}
    for declare, too_large in ((fits, False), (over, True)):
        conn = opened()
        (event,) = receive(conn, {"type": "message", "content": "x", "declare": declare})
        assert (event.declare, event.declare_too_large) == (declare, too_large)
        assert sent(conn) == []


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


# `credential_refresh` has no reply either, but is an event for the adapter to verify
# (tests/unit/test_credential_rules.py); `disclosure_ack` one for the trace.
@pytest.mark.parametrize("frame", [{"type": "hangup"}])
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
        conn.send_turn_event(event, now=1.0)
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
    conn.send_error(SessionExpired(), "s9", now=1.0)
    conn.send_error(TurnInProgress("s9"), now=1.0)
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
    conn = make(media_bytes_per_second=100, media_burst_bytes=100)
    conn.data_to_send()
    part = {"type": "image", "media": {"data": "A" * 80, "mime_type": "image/png"}}
    frame = json.dumps({"type": "message", "parts": [part]})
    assert isinstance(conn.receive_text(frame, now=0.0)[0], MessageReceived)
    assert conn.receive_text(frame, now=0.0) == [LimitHit("media_bytes")]
    assert sent(conn)[0]["error"]["code"] == "RATE_LIMITED"


def test_inline_media_counts_its_decoded_bytes_not_its_base64_text() -> None:
    conn = make(media_bytes_per_second=100, media_burst_bytes=100)
    conn.data_to_send()
    data = base64.b64encode(b"x" * 90).decode()  # 120 characters, 90 bytes
    part = {"type": "image", "media": {"data": data, "mime_type": "image/png"}}
    frame = json.dumps({"type": "message", "parts": [part]})
    assert isinstance(conn.receive_text(frame, now=0.0)[0], MessageReceived)


def test_the_default_media_burst_takes_an_inline_part_as_large_as_a_frame_carries() -> None:
    conn = make()  # the default media rate and burst
    conn.data_to_send()
    data = base64.b64encode(bytes(12 * 1024 * 1024)).decode()  # a 16 MiB frame's worth
    part = {"type": "image", "media": {"data": data, "mime_type": "image/png"}}
    (event,) = conn.receive_text(json.dumps({"type": "message", "parts": [part]}), now=0.0)
    assert isinstance(event, MessageReceived)
    assert sent(conn) == []


def test_the_media_burst_is_its_own_limit_and_the_rate_refills_it() -> None:
    conn = make(media_bytes_per_second=100, media_burst_bytes=1000)
    conn.data_to_send()
    assert conn.receive_binary(b"x" * 1000, now=0.0) == []  # the burst, at once
    assert conn.receive_binary(b"x" * 200, now=1.0) == [LimitHit("media_bytes")]
    assert conn.receive_binary(b"x" * 200, now=2.0) == []  # 100 bytes a second came back


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 89, 90, 91])
def test_base64_decoded_size_is_exact_for_well_formed_text(size: int) -> None:
    assert base64_decoded_size(base64.b64encode(b"x" * size).decode()) == size


def test_binary_frames_count_against_the_media_byte_rate() -> None:
    conn = make(media_bytes_per_second=50, media_burst_bytes=50)
    conn.data_to_send()
    assert conn.receive_binary(b"x" * 60, now=0.0) == [LimitHit("media_bytes")]


def test_send_queue_overflow_stops_queueing_and_flags_the_connection() -> None:
    conn = make(max_send_queue_bytes=200)
    conn.data_to_send()
    for n in range(10):
        conn.send_turn_event(TurnChunk("s1", "t1", f"chunk {n}"), now=1.0)
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
        conn.send_turn_event(TurnChunk("s1", "t1", f"chunk {n}"), now=1.0)
        assert conn.next_frame() is not None
    assert not conn.overflowed


def test_a_frame_larger_than_the_send_queue_reaches_a_client_that_keeps_up() -> None:
    # The bound is on the backlog: a `done` larger than it, queued right after a chunk
    # in the same step, is not a slow consumer.
    conn = make(max_send_queue_bytes=200)
    conn.data_to_send()
    conn.send_turn_event(TurnChunk("s1", "t1", "a chunk"), now=1.0)
    conn.send_turn_event(TurnCompleted("s1", "t1", "x" * 2000), now=1.0)
    assert not conn.overflowed
    assert [frame["type"] for frame in sent(conn)] == ["chunk", "done"]
    media = MediaChunk(
        media_id="m1", mime_type="audio/pcm", data=b"\x00" * 5000, sequence=0, is_last=True
    )
    conn.send_turn_event(TurnMediaChunk("s1", "t1", media), now=1.0)
    assert not conn.overflowed
    assert [frame["type"] for frame in sent(conn)] == ["media_chunk"]


# -- timestamps --------------------------------------------------------------------------


def stamps(conn: OmniaConnection) -> list[tuple[str, str]]:
    return [(frame["type"], frame["timestamp"]) for frame in map(json.loads, conn.data_to_send())]


def test_every_frame_is_stamped_with_the_wall_clock_time_of_its_now() -> None:
    conn = make(now=0.0, media_bytes_per_second=10, media_burst_bytes=10)
    assert stamps(conn) == [("connected", "2025-01-09T12:00:00.000Z")]
    conn.receive_text("{", now=1.5)  # a parse error
    conn.receive_binary(b"x" * 20, now=2.25)  # over the media byte rate
    conn.send_error(SessionExpired(), "s9", now=61.0625)
    ready = UploadReady(upload_id="u", upload_url="http://x/u", storage_ref="r", expires_at="e")
    conn.send_upload_ready("s9", ready, now=3600.9995)
    media = MediaChunk(media_id="m", mime_type="audio/pcm", data=b"\x00", sequence=0, is_last=True)
    call = ToolCall(id="c1", name="where", arguments={})
    for offset, event in enumerate(
        (
            TurnChunk("s1", "t1", "Hel"),
            TurnMediaChunk("s1", "t1", media),
            TurnToolCall("s1", "t1", call),
            TurnToolCallTimedOut("s1", "t1", "c1", "late"),
            TurnCompleted("s1", "t1", "Hello"),
            TurnFailed("s1", "t2", "PROVIDER_TIMEOUT", "slow"),
        )
    ):
        conn.send_turn_event(event, now=86400.0005 + offset / 1000)  # mid-millisecond
    assert stamps(conn) == [
        ("error", "2025-01-09T12:00:01.500Z"),
        ("error", "2025-01-09T12:00:02.250Z"),
        ("error", "2025-01-09T12:01:01.062Z"),
        ("upload_ready", "2025-01-09T13:00:00.999Z"),
        ("chunk", "2025-01-10T12:00:00.000Z"),
        ("media_chunk", "2025-01-10T12:00:00.001Z"),
        ("tool_call", "2025-01-10T12:00:00.002Z"),
        ("tool_result", "2025-01-10T12:00:00.003Z"),
        ("done", "2025-01-10T12:00:00.004Z"),
        ("error", "2025-01-10T12:00:00.005Z"),
    ]


@settings(max_examples=200)
@given(st.lists(st.floats(min_value=0, max_value=10 * 86400), min_size=1, max_size=50))
def test_stamps_follow_the_clock_and_never_go_back(nows: list[float]) -> None:
    clock = Timestamps(now=0.0, wall=WALL)
    stamped = [datetime.fromisoformat(clock.at(now)).timestamp() for now in sorted(nows)]
    assert stamped == sorted(stamped)
    for now, moment in zip(sorted(nows), stamped, strict=True):
        assert WALL + now - 0.0011 < moment <= WALL + now + 1e-6  # truncated to the ms


def test_consecutive_stamps_in_one_millisecond_are_one_text() -> None:
    clock = Timestamps(now=100.0, wall=WALL)
    first = clock.at(100.0001)
    assert clock.at(100.0009) is first
    assert clock.at(101.0) == "2025-01-09T12:00:01.000Z"
    assert clock.at(99.0) == "2025-01-09T11:59:59.000Z"  # a later `now` is not assumed


def test_a_forgotten_stamp_is_formatted_again_the_same() -> None:
    clock = Timestamps(now=100.0, wall=WALL)
    first = clock.at(100.5)
    clock.forget()  # an idle connection keeps no formatted text
    assert clock.text == ""
    assert clock.until == 0.0
    assert clock.at(100.5) == first == "2025-01-09T12:00:00.500Z"


def test_an_idle_connection_holds_no_token_bucket_until_its_first_frame() -> None:
    conn = make(messages_per_second=1.0, message_burst=2)
    assert conn._messages is None
    assert conn._media_bytes is None
    conn.receive_text('{"type":"message","content":"a"}', 5.0)
    conn.receive_text('{"type":"message","content":"b"}', 5.0)
    conn.data_to_send()
    # Made full at the first frame, as one made at connect would be by now: the third
    # message within the burst's second is refused.
    assert conn.receive_text('{"type":"message","content":"c"}', 5.0) == [LimitHit("messages")]
