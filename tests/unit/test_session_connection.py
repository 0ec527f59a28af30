"""The connection-scoped half of `/v1/session`, sans-I/O, both roles (spec §3, §6, §8, §9, §10).

No socket, no sleep: frames go in as text, time goes in as `now`.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from portico.errors import BufferOverflow, ProtocolViolation, ResumeFailed
from portico.protocols.session import frames as f
from portico.protocols.session.channel import Channel
from portico.protocols.session.connection import (
    CLOSE_IDLE,
    CLOSE_REPLACED,
    CLOSE_SLOW_CONSUMER,
    HelloReceived,
    PeerDead,
    ReadyReceived,
    Received,
    Role,
    SessionConnection,
    State,
    Timing,
)

TIMING = Timing(
    ack_delay=0.1,
    ack_every=4,
    heartbeat_interval=15.0,
    dead_after=2.5,
    idle_timeout=45.0,
    max_send_queue_bytes=1_000_000,
)
PROTOCOL_ERROR = (4400, "PROTOCOL_ERROR")


def channel(max_messages: int = 1000, max_bytes: int = 8 * 1024 * 1024) -> Channel:
    return Channel(max_messages=max_messages, max_bytes=max_bytes)


def text(frame: Any) -> str:
    return f.encode(frame).decode()


def out(conn: SessionConnection) -> list[dict[str, Any]]:
    return [json.loads(data) for data in conn.data_to_send()]


def ready(last_seq: int = 0, *, resumed: bool = False) -> f.Ready:
    return f.Ready(
        session_id="s-1",
        resumed=resumed,
        last_seq=last_seq,
        capabilities=("resume",),
        heartbeat_ms=15000,
        resume_window_ms=30000,
    )


def message(seq: int, content: str = "hi") -> str:
    return text(f.Message(seq=seq, content=content))


def chunk(seq: int, content: str = "hi") -> str:
    return text(f.Chunk(seq=seq, turn_id="t-1", content=content))


def ack(seq: int) -> str:
    return text(f.Ack(seq=seq))


def assert_failed(
    conn: SessionConnection, close: tuple[int, str] = PROTOCOL_ERROR
) -> dict[str, Any]:
    """Exactly one unnumbered `error` was written, and a close was requested."""
    frames = out(conn)
    assert len(frames) == 1, frames
    error = frames[0]
    assert error["type"] == "error"
    assert "seq" not in error
    assert error["error"]["code"] == close[1]
    assert conn.close_request == close
    assert conn.state is State.CLOSED
    return error


# -- server role ---------------------------------------------------------------------------


def server(now: float = 0.0, timing: Timing = TIMING) -> SessionConnection:
    return SessionConnection(role=Role.SERVER, timing=timing, now=now)


def open_server(
    now: float = 0.0,
    chan: Channel | None = None,
    peer_last_seq: int = 0,
    timing: Timing = TIMING,
) -> tuple[SessionConnection, Channel]:
    conn = server(now, timing)
    chan = chan or channel()
    [event] = conn.receive_text(text(f.Hello()), now)
    assert isinstance(event, HelloReceived)
    conn.accept(chan, ready(chan.handled), peer_last_seq)
    assert conn.state is State.OPEN
    conn.data_to_send()
    return conn, chan


class TestServerHandshake:
    def test_a_new_connection_waits_for_hello_and_writes_nothing(self) -> None:
        conn = server()
        assert conn.state is State.AWAIT_HELLO
        assert conn.channel is None
        assert conn.close_request is None
        assert conn.next_frame() is None

    def test_hello_is_surfaced_and_nothing_is_written(self) -> None:
        conn = server()
        hello = f.Hello(
            session_id="s-1",
            last_seq=17,
            credential="tok",
            agent="support",
            tools=(f.ToolSpec(name="get_location", parameters={"type": "object"}),),
            context={"open_document": "a"},
            capabilities=("tools", "context"),
        )
        assert conn.receive_text(text(hello), 1.0) == [HelloReceived(hello)]
        assert conn.data_to_send() == []
        assert conn.close_request is None

    def test_hello_with_unknown_fields_is_accepted(self) -> None:
        conn = server()
        events = conn.receive_text('{"type": "hello", "future_field": [1, 2]}', 0.0)
        assert events == [HelloReceived(f.Hello())]

    def test_hello_may_arrive_as_bytes(self) -> None:
        conn = server()
        assert conn.receive_text(f.encode(f.Hello()), 0.0) == [HelloReceived(f.Hello())]

    @pytest.mark.parametrize(
        "first",
        [
            message(1),
            ack(0),
            text(f.Ping()),
            text(f.Pong()),
            text(f.End(seq=1)),
            text(f.Interrupt(seq=1)),
        ],
    )
    def test_a_first_frame_other_than_hello_is_a_protocol_error(self, first: str) -> None:
        conn = server()
        assert conn.receive_text(first, 0.0) == []
        assert_failed(conn)

    def test_a_second_hello_after_accept_is_a_protocol_error(self) -> None:
        conn, chan = open_server()
        assert conn.receive_text(text(f.Hello()), 1.0) == []
        assert_failed(conn)
        assert chan.handled == 0

    def test_a_second_hello_before_accept_is_a_protocol_error(self) -> None:
        conn = server()
        conn.receive_text(text(f.Hello()), 0.0)
        assert conn.receive_text(text(f.Hello(session_id="s-other")), 0.1) == []
        assert_failed(conn)

    def test_accept_on_a_new_session_writes_only_ready(self) -> None:
        conn = server()
        conn.receive_text(text(f.Hello()), 0.0)
        chan = channel()
        conn.accept(chan, ready(0), 0)
        assert out(conn) == [json.loads(text(ready(0)))]
        assert conn.state is State.OPEN
        assert conn.channel is chan

    def test_accept_writes_ready_then_the_backlog_above_the_clients_last_seq(self) -> None:
        chan = channel()
        for i in range(1, 6):
            chan.send(f.Chunk(seq=0, turn_id="t-1", content=f"c{i}"))
        chan.receive(1)
        chan.receive(2)
        conn = server(10.0)
        conn.receive_text(text(f.Hello(session_id="s-1", last_seq=2)), 10.0)
        conn.accept(chan, ready(chan.handled, resumed=True), 2)
        frames = out(conn)
        assert frames[0] == {**json.loads(text(ready(2, resumed=True)))}
        assert [(fr["type"], fr["seq"], fr["content"]) for fr in frames[1:]] == [
            ("chunk", 3, "c3"),
            ("chunk", 4, "c4"),
            ("chunk", 5, "c5"),
        ]
        assert chan.peer_acked == 2
        assert chan.buffered[0] == 3

    def test_accept_with_last_seq_zero_resends_everything(self) -> None:
        chan = channel()
        for _ in range(3):
            chan.send(f.Chunk(seq=0, turn_id="t", content="x"))
        conn = server()
        conn.receive_text(text(f.Hello(session_id="s-1")), 0.0)
        conn.accept(chan, ready(0, resumed=True), 0)
        assert [fr.get("seq") for fr in out(conn)] == [None, 1, 2, 3]

    def test_accept_with_a_last_seq_beyond_what_was_sent_fails_with_4400(self) -> None:
        chan = channel()
        data = [chan.send(f.Chunk(seq=0, turn_id="t", content="x")) for _ in range(2)]
        conn = server()
        conn.receive_text(text(f.Hello(session_id="s-1", last_seq=3)), 0.0)
        conn.accept(chan, ready(0, resumed=True), 3)
        assert_failed(conn)  # an error, no ready, no backlog
        # The session stays resumable: nothing was acknowledged or dropped.
        assert chan.peer_acked == 0
        assert chan.unacknowledged() == data

    def test_a_server_frame_from_the_client_is_a_protocol_error(self) -> None:
        conn, _ = open_server()
        conn.receive_text(text(ready(0)), 1.0)
        assert_failed(conn)


class TestServerMalformedInput:
    @pytest.mark.parametrize(
        "data",
        [
            "",
            "{",
            "not json",
            "null",
            "[]",
            "42",
            '"hello"',
            "{}",
            '{"type": "nope"}',
            '{"type": 1}',
            '{"seq": 1}',
            '{"type": "message"}',
            '{"type": "message", "seq": "1"}',
            '{"type": "message", "seq": true}',
            '{"type": "ack"}',
            '{"type": "ack", "seq": 1.5}',
            '{"type": "hello", "last_seq": 1e400}',
            '{"type": "hello", "tools": [{}]}',
            b"\xff\xfe\x00",
            b'{"type": "hello", "agent": "\xc3"}',
        ],
    )
    @pytest.mark.parametrize("opened", [False, True], ids=["await_hello", "open"])
    def test_malformed_input_is_a_protocol_error_not_an_exception(
        self, data: str | bytes, opened: bool
    ) -> None:
        conn = open_server()[0] if opened else server()
        assert conn.receive_text(data, 1.0) == []
        assert_failed(conn)

    @pytest.mark.parametrize(
        "data",
        [
            "[" * 100_000 + "]" * 100_000,
            '{"a":' * 50_000 + "1" + "}" * 50_000,
            '{"type": "hello", "context": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}",
            '{"type": "tool_result", "seq": 1, "call_id": "c", "result": '
            + "[" * 100_000
            + "]" * 100_000
            + "}",
        ],
        ids=["array", "object", "hello_context", "tool_result"],
    )
    @pytest.mark.parametrize("opened", [False, True], ids=["await_hello", "open"])
    def test_deeply_nested_json_is_a_protocol_error_not_an_exception(
        self, data: str, opened: bool
    ) -> None:
        conn = open_server()[0] if opened else server()
        assert conn.receive_text(data, 1.0) == []
        assert_failed(conn)

    def test_a_str_with_a_lone_surrogate_is_a_protocol_error(self) -> None:
        conn = server()
        assert conn.receive_text('{"type": "hello", "agent": "\ud800"}', 0.0) == []
        assert_failed(conn)


class TestServerNumbered:
    def test_numbered_messages_in_order_are_received_exactly_once(self) -> None:
        conn, chan = open_server()
        frames = [f.Message(seq=n, content=f"m{n}") for n in (1, 2, 3)]
        events = [conn.receive_text(text(frame), 1.0) for frame in frames]
        assert events == [[Received(frame)] for frame in frames]
        assert chan.handled == 3

    @pytest.mark.parametrize(
        "frame",
        [
            f.Message(seq=1, content="hi", metadata={"k": "v"}),
            f.ToolCallAck(seq=1, call_id="c"),
            f.ToolCallNack(seq=1, call_id="c", reason="no"),
            f.ClientToolResult(seq=1, call_id="c", result={"x": [1, 2]}),
            f.ClientToolResult(seq=1, call_id="c", error="boom"),
            f.Context(seq=1, context={"doc": "a"}),
            f.Interrupt(seq=1),
            f.End(seq=1),
        ],
        ids=lambda frame: type(frame).__name__,
    )
    def test_every_client_numbered_type_is_received(self, frame: Any) -> None:
        conn, _ = open_server()
        assert conn.receive_text(text(frame), 1.0) == [Received(frame)]

    def test_a_duplicate_gives_no_event_but_is_still_acknowledged(self) -> None:
        conn, chan = open_server()
        conn.receive_text(message(1), 1.0)
        conn.receive_text(message(2), 1.0)
        conn.on_timer(1.1)
        assert out(conn) == [{"type": "ack", "seq": 2}]
        assert conn.receive_text(message(1), 5.0) == []
        assert conn.receive_text(message(2), 5.0) == []
        assert conn.close_request is None
        assert chan.handled == 2
        assert conn.next_deadline() == pytest.approx(5.1)
        conn.on_timer(5.1)
        assert out(conn) == [{"type": "ack", "seq": 2}]

    def test_a_duplicate_resent_after_resume_gives_no_event(self) -> None:
        chan = channel()
        first, _ = open_server(chan=chan)
        first.receive_text(message(1, "a"), 1.0)
        first.receive_text(message(2, "b"), 1.0)
        second, _ = open_server(2.0, chan=chan)
        # The client did not see the ack and resends 1 and 2, then 3.
        assert second.receive_text(message(1, "a"), 2.0) == []
        assert second.receive_text(message(2, "b"), 2.0) == []
        assert second.receive_text(message(3, "c"), 2.0) == [
            Received(f.Message(seq=3, content="c"))
        ]

    def test_a_gap_is_a_protocol_error_and_the_session_stays_resumable(self) -> None:
        conn, chan = open_server()
        conn.receive_text(message(1), 1.0)
        assert conn.receive_text(message(3), 1.0) == []
        assert_failed(conn)
        assert chan.handled == 1
        again, _ = open_server(2.0, chan=chan)
        assert again.receive_text(message(2), 2.0) == [Received(f.Message(seq=2, content="hi"))]


class TestAckCadence:
    def test_an_ack_is_written_at_the_latest_ack_delay_after_handling(self) -> None:
        conn, _ = open_server()
        conn.receive_text(message(1), 1.0)
        assert conn.data_to_send() == []
        assert conn.next_deadline() == pytest.approx(1.1)
        conn.on_timer(1.05)
        assert conn.data_to_send() == []
        conn.on_timer(1.1)
        assert out(conn) == [{"type": "ack", "seq": 1}]
        assert conn.next_deadline() == pytest.approx(1.0 + TIMING.idle_timeout)

    def test_an_owed_ack_goes_out_right_behind_the_next_numbered_message(self) -> None:
        conn, _ = open_server()
        conn.receive_text(message(1), 1.0)
        conn.send(f.Chunk(seq=0, turn_id="t-1", content="c"))
        assert out(conn) == [
            {"type": "chunk", "seq": 1, "turn_id": "t-1", "content": "c"},
            {"type": "ack", "seq": 1},
        ]
        assert conn.next_deadline() == pytest.approx(1.0 + TIMING.idle_timeout)
        conn.send(f.Chunk(seq=0, turn_id="t-1", content="d"))
        assert [frame["type"] for frame in out(conn)] == ["chunk"]  # nothing owed: no ack

    def test_later_messages_do_not_push_the_ack_deadline_back(self) -> None:
        conn, _ = open_server()
        conn.receive_text(message(1), 1.0)
        conn.receive_text(message(2), 1.08)
        assert conn.next_deadline() == pytest.approx(1.1)
        conn.on_timer(1.1)
        assert out(conn) == [{"type": "ack", "seq": 2}]

    def test_acks_are_cumulative_one_ack_for_several_messages(self) -> None:
        conn, chan = open_server()
        for seq in (1, 2, 3):
            conn.receive_text(message(seq), 1.0)
        conn.on_timer(2.0)
        assert out(conn) == [{"type": "ack", "seq": chan.handled}]
        assert chan.handled == 3

    def test_an_ack_is_written_immediately_after_ack_every_messages(self) -> None:
        conn, _ = open_server()
        for seq in range(1, TIMING.ack_every):
            conn.receive_text(message(seq), 1.0)
        assert conn.data_to_send() == []
        conn.receive_text(message(TIMING.ack_every), 1.0)
        assert out(conn) == [{"type": "ack", "seq": TIMING.ack_every}]
        # Nothing is pending any more: the next deadline is the idle one.
        assert conn.next_deadline() == pytest.approx(1.0 + TIMING.idle_timeout)
        conn.on_timer(1.2)
        assert conn.data_to_send() == []

    def test_ack_every_counts_again_after_an_ack(self) -> None:
        conn, _ = open_server()
        for seq in range(1, 2 * TIMING.ack_every + 1):
            conn.receive_text(message(seq), 1.0)
        assert out(conn) == [
            {"type": "ack", "seq": TIMING.ack_every},
            {"type": "ack", "seq": 2 * TIMING.ack_every},
        ]

    def test_ack_every_one_acknowledges_each_message(self) -> None:
        conn, _ = open_server(timing=msgspec.structs.replace(TIMING, ack_every=1))
        for seq in (1, 2):
            conn.receive_text(message(seq), 1.0)
        assert out(conn) == [{"type": "ack", "seq": 1}, {"type": "ack", "seq": 2}]

    def test_duplicates_count_toward_ack_every(self) -> None:
        conn, _ = open_server()
        conn.receive_text(message(1), 1.0)
        for _ in range(TIMING.ack_every - 1):
            conn.receive_text(message(1), 1.0)
        assert out(conn) == [{"type": "ack", "seq": 1}]

    def test_no_ack_is_written_when_nothing_was_handled(self) -> None:
        conn, _ = open_server()
        conn.receive_text(text(f.Ping()), 1.0)
        conn.data_to_send()
        conn.on_timer(2.0)
        conn.on_timer(30.0)
        assert conn.data_to_send() == []

    def test_unnumbered_frames_do_not_schedule_an_ack(self) -> None:
        conn, chan = open_server()
        chan.send(f.Chunk(seq=0, turn_id="t", content="x"))
        conn.receive_text(ack(1), 1.0)
        assert conn.next_deadline() == pytest.approx(1.0 + TIMING.idle_timeout)

    def test_a_peer_ack_frees_the_resend_buffer(self) -> None:
        conn, chan = open_server()
        for _ in range(3):
            conn.send(f.Chunk(seq=0, turn_id="t", content="x"))
        conn.data_to_send()
        assert conn.receive_text(ack(2), 1.0) == []
        assert chan.buffered[0] == 1
        assert conn.receive_text(ack(1), 1.0) == []  # regressing: ignored
        assert chan.peer_acked == 2
        assert conn.close_request is None
        assert conn.data_to_send() == []

    def test_a_peer_ack_beyond_the_highest_seq_sent_is_a_protocol_error(self) -> None:
        conn, chan = open_server()
        conn.send(f.Chunk(seq=0, turn_id="t", content="x"))
        conn.data_to_send()
        assert conn.receive_text(ack(2), 1.0) == []
        assert_failed(conn)
        assert chan.buffered[0] == 1  # still resumable


class TestServerHeartbeat:
    def test_ping_is_answered_with_an_unnumbered_pong(self) -> None:
        conn, chan = open_server()
        assert conn.receive_text(text(f.Ping()), 1.0) == []
        assert out(conn) == [{"type": "pong"}]
        assert chan.next_seq == 1
        assert chan.handled == 0

    def test_pong_is_accepted_silently(self) -> None:
        conn, _ = open_server()
        assert conn.receive_text(text(f.Pong()), 1.0) == []
        assert conn.data_to_send() == []
        assert conn.close_request is None

    def test_the_server_never_pings(self) -> None:
        conn, _ = open_server()
        for now in (15.0, 30.0, 44.0):
            conn.receive_text(text(f.Pong()), now)
            conn.on_timer(now)
        assert conn.data_to_send() == []

    def test_silence_for_idle_timeout_closes_with_4000(self) -> None:
        conn, _ = open_server(now=0.0)
        assert conn.next_deadline() == pytest.approx(45.0)
        conn.on_timer(44.99)
        assert conn.close_request is None
        assert conn.on_timer(45.0) == []
        assert conn.close_request is not None
        assert conn.close_request[0] == CLOSE_IDLE == 4000
        assert conn.state is State.CLOSED
        assert conn.data_to_send() == []  # a plain close, no error frame

    def test_a_connection_that_never_sends_hello_is_closed_idle(self) -> None:
        conn = server(0.0)
        conn.on_timer(45.0)
        assert conn.close_request is not None
        assert conn.close_request[0] == 4000

    @pytest.mark.parametrize(
        "frame",
        [text(f.Ping()), text(f.Pong()), message(1), ack(0)],
        ids=["ping", "pong", "message", "ack"],
    )
    def test_any_frame_resets_the_idle_timer(self, frame: str) -> None:
        conn, _ = open_server(now=0.0)
        conn.receive_text(frame, 30.0)
        conn.on_timer(44.0)
        conn.on_timer(74.99)
        assert conn.close_request is None
        assert conn.next_deadline() == pytest.approx(75.0)
        conn.on_timer(75.0)
        assert conn.close_request is not None
        assert conn.close_request[0] == 4000

    def test_a_duplicate_resets_the_idle_timer_too(self) -> None:
        conn, _ = open_server(now=0.0)
        conn.receive_text(message(1), 1.0)
        conn.receive_text(message(1), 40.0)
        conn.on_timer(84.99)
        assert conn.close_request is None


class TestAfterClose:
    @pytest.mark.parametrize("frame", [message(1), text(f.Ping()), ack(0), text(f.Hello()), "{"])
    def test_a_frame_after_a_close_is_ignored(self, frame: str) -> None:
        conn, chan = open_server()
        conn.close(CLOSE_REPLACED, "replaced by a newer connection")
        assert conn.receive_text(frame, 1.0) == []
        assert conn.data_to_send() == []
        assert conn.close_request == (4409, "replaced by a newer connection")
        assert chan.handled == 0

    def test_a_frame_after_a_failure_is_ignored(self) -> None:
        conn, chan = open_server()
        conn.receive_text(message(2), 1.0)
        assert_failed(conn)
        assert conn.receive_text(message(1), 1.0) == []
        assert conn.receive_text("garbage", 1.0) == []
        assert conn.data_to_send() == []
        assert chan.handled == 0

    def test_timers_after_a_close_do_nothing(self) -> None:
        conn, _ = open_server()
        conn.receive_text(message(1), 1.0)
        conn.close(1000, "session ended")
        assert conn.on_timer(1.1) == []
        assert conn.on_timer(1000.0) == []
        assert conn.data_to_send() == []
        assert conn.close_request == (1000, "session ended")

    def test_the_first_close_reason_wins(self) -> None:
        conn, _ = open_server()
        conn.close(CLOSE_REPLACED, "replaced")
        conn.fail(ProtocolViolation("late"))
        conn.close(1000, "late")
        assert conn.close_request == (4409, "replaced")
        assert conn.data_to_send() == []

    def test_fail_writes_the_errors_code_message_and_details(self) -> None:
        conn, _ = open_server()
        conn.fail(ResumeFailed())
        [frame] = out(conn)
        assert frame == {
            "type": "error",
            "error": {"code": "RESUME_FAILED", "message": "the session cannot be resumed"},
        }
        assert conn.close_request == (4404, "RESUME_FAILED")


class TestSending:
    def test_send_numbers_the_frame_on_the_channel_and_writes_it(self) -> None:
        conn, chan = open_server()
        conn.send(f.Chunk(seq=0, turn_id="t", content="a"))
        conn.send(f.Done(seq=0, turn_id="t", content="a"))
        frames = out(conn)
        assert [(fr["type"], fr["seq"]) for fr in frames] == [("chunk", 1), ("done", 2)]
        assert chan.buffered[0] == 2

    def test_send_before_a_channel_is_attached_raises(self) -> None:
        conn = server()
        with pytest.raises(ProtocolViolation):
            conn.send(f.Chunk(seq=0, turn_id="t", content="a"))

    def test_write_numbered_before_open_writes_nothing_and_it_is_resent_on_accept(self) -> None:
        chan = channel()
        conn = server()
        data = chan.send(f.Chunk(seq=0, turn_id="t", content="early"))
        conn.write_numbered(data)
        assert conn.data_to_send() == []
        conn.receive_text(text(f.Hello()), 0.0)
        conn.write_numbered(data)  # hello received, not accepted yet: still not live
        assert conn.data_to_send() == []
        conn.accept(chan, ready(0), 0)
        assert [fr["type"] for fr in out(conn)] == ["ready", "chunk"]

    def test_write_numbered_after_a_close_writes_nothing(self) -> None:
        conn, chan = open_server()
        conn.close(4409, "replaced")
        conn.write_numbered(chan.send(f.Chunk(seq=0, turn_id="t", content="x")))
        assert conn.data_to_send() == []
        assert chan.buffered[0] == 1

    def test_a_full_resend_buffer_raises_and_fail_ends_with_resume_failed(self) -> None:
        conn, chan = open_server(chan=channel(max_messages=2))
        conn.send(f.Chunk(seq=0, turn_id="t", content="a"))
        conn.send(f.Chunk(seq=0, turn_id="t", content="b"))
        conn.data_to_send()
        with pytest.raises(BufferOverflow) as caught:
            conn.send(f.Chunk(seq=0, turn_id="t", content="c"))
        assert conn.data_to_send() == []
        assert chan.next_seq == 3
        conn.fail(caught.value)
        error = assert_failed(conn, (4404, "RESUME_FAILED"))
        assert error["error"]["details"] == {"reason": "buffer_overflow"}

    def test_the_send_queue_bound_closes_with_4408(self) -> None:
        frame = f.Chunk(seq=0, turn_id="t", content="x" * 50)
        size = len(channel().send(frame))
        timing = msgspec.structs.replace(TIMING, max_send_queue_bytes=2 * size)
        conn, chan = open_server(timing=timing)
        conn.send(frame)
        conn.send(frame)  # exactly at the bound: still queued
        assert conn.overflowed is False
        conn.send(frame)
        assert conn.overflowed is True
        assert conn.close_request is not None
        assert conn.close_request[0] == CLOSE_SLOW_CONSUMER == 4408
        assert conn.state is State.CLOSED
        # The queued frames still go out; the refused one waits in the channel for the resume.
        assert [fr["seq"] for fr in out(conn)] == [1, 2]
        assert chan.buffered[0] == 3

    def test_after_an_overflow_nothing_more_is_queued(self) -> None:
        timing = msgspec.structs.replace(TIMING, max_send_queue_bytes=60)
        conn, chan = open_server(timing=timing)
        conn.send(f.Chunk(seq=0, turn_id="t", content="x" * 100))  # an empty queue takes it
        assert not conn.overflowed
        conn.send(f.Chunk(seq=0, turn_id="t", content="x" * 100))  # 100 waiting: refused
        assert conn.overflowed
        conn.send(f.Chunk(seq=0, turn_id="t", content=""))
        conn.fail(ProtocolViolation("late"))
        conn.receive_text(text(f.Ping()), 1.0)
        # Only what was queued before the overflow; everything sent is kept for resume.
        assert [msgspec.json.decode(frame)["seq"] for frame in conn.data_to_send()] == [1]
        assert chan.buffered[0] == 3
        assert conn.close_request is not None
        assert conn.close_request[0] == 4408

    def test_draining_the_queue_makes_room(self) -> None:
        frame = f.Chunk(seq=0, turn_id="t", content="x" * 500)  # larger than ready
        size = len(channel().send(frame))
        conn, _ = open_server(timing=msgspec.structs.replace(TIMING, max_send_queue_bytes=size))
        conn.send(frame)
        assert conn.next_frame() is not None
        assert conn.next_frame() is None
        conn.send(frame)
        assert conn.overflowed is False

    def test_a_backlog_within_the_resend_buffer_bound_can_be_resumed(self) -> None:
        chan = channel()  # the spec's default bound: 1,000 messages, 8 MiB
        for _ in range(50):  # about 5 MiB
            chan.send(f.Chunk(seq=0, turn_id="t", content="x" * 100_000))
        for attempt in range(3):  # the client resumes after each 4408
            conn = server(float(attempt))
            conn.receive_text(text(f.Hello(session_id="s-1")), float(attempt))
            conn.accept(chan, ready(0, resumed=True), 0)
            frames = []
            while (data := conn.next_frame()) is not None:
                frames.append(data)
            if not conn.overflowed:
                break
        assert not conn.overflowed
        assert len(frames) == 51


# -- client role ---------------------------------------------------------------------------


def client(now: float = 0.0, timing: Timing = TIMING) -> SessionConnection:
    return SessionConnection(role=Role.CLIENT, timing=timing, now=now)


def started(
    now: float = 0.0, chan: Channel | None = None, hello: f.Hello | None = None
) -> tuple[SessionConnection, Channel]:
    conn = client(now)
    chan = chan or channel()
    conn.start(hello or f.Hello(), chan)
    conn.data_to_send()
    return conn, chan


def open_client(
    now: float = 0.0, chan: Channel | None = None, last_seq: int = 0
) -> tuple[SessionConnection, Channel]:
    conn, chan = started(now, chan)
    [event] = conn.receive_text(text(ready(last_seq)), now)
    assert isinstance(event, ReadyReceived)
    conn.data_to_send()
    return conn, chan


class TestClientHandshake:
    def test_start_writes_hello(self) -> None:
        conn = client()
        chan = channel()
        hello = f.Hello(session_id="s-1", last_seq=4, credential="tok")
        conn.start(hello, chan)
        assert conn.data_to_send() == [f.encode(hello)]
        assert conn.state is State.AWAIT_READY
        assert conn.channel is chan

    def test_nothing_is_written_before_start(self) -> None:
        conn = client()
        assert conn.data_to_send() == []
        conn.on_timer(15.0)
        assert conn.data_to_send() == []

    def test_ready_is_surfaced_and_opens_the_connection(self) -> None:
        conn, _ = started()
        frame = ready(0)
        assert conn.receive_text(text(frame), 1.0) == [ReadyReceived(frame)]
        assert conn.state is State.OPEN
        assert conn.data_to_send() == []

    def test_ready_acknowledges_its_last_seq_and_resends_the_rest_in_order(self) -> None:
        chan = channel()
        for i in range(1, 6):
            chan.send(f.Message(seq=0, content=f"m{i}"))
        conn, _ = started(chan=chan, hello=f.Hello(session_id="s-1"))
        events = conn.receive_text(text(ready(2, resumed=True)), 1.0)
        assert events == [ReadyReceived(ready(2, resumed=True))]
        assert chan.peer_acked == 2
        assert [(fr["seq"], fr["content"]) for fr in out(conn)] == [
            (3, "m3"),
            (4, "m4"),
            (5, "m5"),
        ]

    def test_ready_below_an_earlier_ack_resends_only_what_is_unacknowledged(self) -> None:
        chan = channel()
        for _ in range(4):
            chan.send(f.Message(seq=0, content="m"))
        chan.acknowledge(3)
        conn, _ = started(chan=chan)
        conn.receive_text(text(ready(1, resumed=True)), 1.0)
        assert [fr["seq"] for fr in out(conn)] == [4]
        assert chan.peer_acked == 3

    def test_ready_with_a_last_seq_beyond_what_was_sent_is_a_protocol_error(self) -> None:
        chan = channel()
        chan.send(f.Message(seq=0, content="m"))
        conn, _ = started(chan=chan)
        assert conn.receive_text(text(ready(2, resumed=True)), 1.0) == []
        assert_failed(conn)
        assert chan.buffered[0] == 1

    @pytest.mark.parametrize(
        "frame",
        [chunk(1), text(f.Done(seq=1, turn_id="t")), ack(0), text(f.Ping()), text(f.Pong())],
        ids=["chunk", "done", "ack", "ping", "pong"],
    )
    def test_a_frame_before_ready_is_a_protocol_error(self, frame: str) -> None:
        conn, chan = started()
        assert conn.receive_text(frame, 1.0) == []
        assert_failed(conn)
        assert chan.handled == 0

    @pytest.mark.parametrize(
        ("code", "details"),
        [
            ("RESUME_FAILED", None),
            ("RESUME_FAILED", {"reason": "buffer_overflow"}),
            ("UNAUTHENTICATED", None),
            ("PROTOCOL_ERROR", None),
        ],
    )
    def test_an_unnumbered_server_error_before_ready_is_surfaced(
        self, code: str, details: dict[str, Any] | None
    ) -> None:
        conn, chan = started(hello=f.Hello(session_id="s-1", last_seq=3))
        error = f.Error(error=f.ErrorInfo(code=code, message="no", details=details))
        assert conn.receive_text(text(error), 1.0) == [Received(error)]
        # The server closes next; the client writes nothing and numbers nothing.
        assert conn.data_to_send() == []
        assert conn.close_request is None
        assert chan.handled == 0

    def test_a_second_ready_is_a_protocol_error(self) -> None:
        conn, _ = open_client()
        assert conn.receive_text(text(ready(0)), 2.0) == []
        assert_failed(conn)

    def test_a_client_frame_from_the_server_is_a_protocol_error(self) -> None:
        conn, _ = open_client()
        conn.receive_text(text(f.Hello()), 2.0)
        assert_failed(conn)


class TestClientOpen:
    @pytest.mark.parametrize(
        "frame",
        [
            f.Chunk(seq=1, turn_id="t", content="a"),
            f.Done(seq=1, turn_id="t", content="a", cancelled=True),
            f.ToolCall(
                seq=1,
                turn_id="t",
                tool_call=f.ToolCallInfo(
                    id="c", name="get_location", arguments={}, consent_message="ok?"
                ),
            ),
            f.ServerToolResult(seq=1, call_id="c", error="timeout"),
            f.Transcript(seq=1, role="user", text="hi"),
            f.Error(seq=1, turn_id="t", ref_seq=3, error=f.ErrorInfo(code="X", message="m")),
        ],
        ids=lambda frame: type(frame).__name__,
    )
    def test_every_server_numbered_type_is_received(self, frame: Any) -> None:
        conn, chan = open_client()
        assert conn.receive_text(text(frame), 1.0) == [Received(frame)]
        assert chan.handled == 1

    def test_server_messages_are_received_once_and_acknowledged(self) -> None:
        conn, chan = open_client()
        assert conn.receive_text(chunk(1, "a"), 1.0) == [
            Received(f.Chunk(seq=1, turn_id="t-1", content="a"))
        ]
        assert conn.receive_text(chunk(1, "a"), 1.0) == []
        assert conn.receive_text(chunk(2, "b"), 1.0) == [
            Received(f.Chunk(seq=2, turn_id="t-1", content="b"))
        ]
        conn.on_timer(1.1)
        assert out(conn) == [{"type": "ack", "seq": 2}]
        assert chan.handled == 2

    def test_a_gap_from_the_server_is_a_protocol_error(self) -> None:
        conn, chan = open_client()
        conn.receive_text(chunk(2), 1.0)
        assert_failed(conn)
        assert chan.handled == 0

    def test_an_unnumbered_error_while_open_is_surfaced(self) -> None:
        conn, chan = open_client()
        error = f.Error(error=f.ErrorInfo(code="PROTOCOL_ERROR", message="gap"))
        assert conn.receive_text(text(error), 1.0) == [Received(error)]
        assert chan.handled == 0

    def test_client_messages_are_live_once_open(self) -> None:
        conn, chan = open_client()
        conn.send(f.Message(seq=0, content="hi"))
        assert out(conn) == [{"type": "message", "seq": 1, "content": "hi"}]
        conn.receive_text(ack(1), 2.0)
        assert chan.buffered == (0, 0)

    def test_messages_sent_before_ready_wait_and_go_out_after_ready(self) -> None:
        conn, chan = started()
        conn.send(f.Message(seq=0, content="early"))
        assert conn.data_to_send() == []
        conn.receive_text(text(ready(0)), 1.0)
        assert out(conn) == [{"type": "message", "seq": 1, "content": "early"}]
        assert chan.buffered[0] == 1

    def test_the_client_answers_a_server_ping(self) -> None:
        conn, _ = open_client()
        conn.receive_text(text(f.Ping()), 1.0)
        assert out(conn) == [{"type": "pong"}]


class TestClientHeartbeat:
    def test_the_client_pings_every_heartbeat_interval_once_open(self) -> None:
        conn, chan = open_client(0.0)
        assert conn.next_deadline() == pytest.approx(15.0)
        conn.on_timer(14.99)
        assert conn.data_to_send() == []
        conn.on_timer(15.0)
        assert out(conn) == [{"type": "ping"}]
        conn.receive_text(text(f.Pong()), 15.2)
        assert conn.next_deadline() == pytest.approx(30.0)
        conn.on_timer(30.0)
        assert out(conn) == [{"type": "ping"}]
        assert chan.next_seq == 1  # pings are not numbered

    def test_a_shorter_heartbeat_in_ready_sets_the_ping_interval_and_the_dead_timer(
        self,
    ) -> None:
        conn, _ = started(0.0)
        announced = msgspec.structs.replace(ready(), heartbeat_ms=2000)
        conn.receive_text(text(announced), 1.0)
        assert conn.next_deadline() == pytest.approx(3.0)
        conn.on_timer(2.99)
        assert conn.data_to_send() == []
        conn.on_timer(3.0)
        assert out(conn) == [{"type": "ping"}]
        conn.on_timer(5.0)
        assert out(conn) == [{"type": "ping"}]
        # Dead after 2.5 of the intervals in effect: 5 s of silence since `ready`.
        assert conn.on_timer(5.99) == []
        assert conn.on_timer(6.0) == [PeerDead()]

    def test_a_longer_heartbeat_in_ready_keeps_the_clients_own_interval(self) -> None:
        conn, _ = started(0.0)
        conn.receive_text(text(msgspec.structs.replace(ready(), heartbeat_ms=60000)), 0.0)
        assert conn.next_deadline() == pytest.approx(15.0)
        conn.on_timer(15.0)
        assert out(conn) == [{"type": "ping"}]
        assert conn.on_timer(37.5) == [PeerDead()]

    def test_no_ping_before_ready(self) -> None:
        conn, _ = started(0.0)
        conn.on_timer(15.0)
        conn.on_timer(30.0)
        assert conn.data_to_send() == []
        assert conn.state is State.AWAIT_READY

    def test_the_peer_is_dead_after_dead_after_intervals_of_silence(self) -> None:
        conn, _ = open_client(0.0)  # ready arrived at 0
        for now in (15.0, 30.0):
            assert conn.on_timer(now) == []
        assert conn.on_timer(37.49) == []
        assert conn.next_deadline() == pytest.approx(37.5)
        assert conn.on_timer(37.5) == [PeerDead()]
        assert conn.state is State.CLOSED
        assert conn.on_timer(40.0) == []  # reported once

    def test_a_server_that_never_answers_hello_is_dead_too(self) -> None:
        conn, _ = started(0.0)
        assert conn.on_timer(37.49) == []
        assert conn.on_timer(37.5) == [PeerDead()]

    @pytest.mark.parametrize(
        "frame",
        [text(f.Pong()), text(f.Ping()), chunk(1), ack(0)],
        ids=["pong", "ping", "chunk", "ack"],
    )
    def test_any_frame_resets_the_dead_timer(self, frame: str) -> None:
        conn, _ = open_client(0.0)
        conn.on_timer(15.0)
        conn.receive_text(frame, 20.0)
        assert conn.on_timer(57.49) == []
        assert conn.state is State.OPEN
        assert conn.on_timer(57.5) == [PeerDead()]

    def test_next_deadline_is_in_the_future_while_awaiting_ready(self) -> None:
        conn, _ = started(0.0)
        conn.on_timer(15.0)
        assert conn.next_deadline() > 15.0


# -- hello.continue: a new numbering on an archived conversation ------------------------


def test_continue_decodes_from_its_wire_name() -> None:
    hello = f.client_frame_decoder.decode(b'{"type":"hello","continue":"s-1"}')
    assert isinstance(hello, f.Hello)
    assert (hello.continue_session, hello.session_id) == ("s-1", None)
    assert json.loads(text(hello))["continue"] == "s-1"


@pytest.mark.parametrize(
    "fields",
    [{"session_id": "s-1", "continue": "s-1"}, {"continue": "s-1", "last_seq": 3}],
    ids=["with session_id", "with last_seq"],
)
def test_server_refuses_a_continue_that_also_resumes(fields: dict[str, Any]) -> None:
    conn = SessionConnection(role=Role.SERVER, timing=TIMING, now=0.0)
    assert conn.receive_text(json.dumps({"type": "hello", **fields}), 0.0) == []
    assert out(conn)[0]["error"]["code"] == "PROTOCOL_ERROR"
    assert conn.close_request == PROTOCOL_ERROR


def test_server_hands_a_continue_to_the_adapter_and_numbers_from_1() -> None:
    conn = SessionConnection(role=Role.SERVER, timing=TIMING, now=0.0)
    events = conn.receive_text('{"type":"hello","continue":"s-1"}', 0.0)
    assert [type(e) for e in events] == [HelloReceived]
    fresh = channel()
    conn.accept(fresh, ready(), 0)
    conn.send(f.Chunk(seq=0, turn_id="t", content="x"))
    assert [frame.get("seq") for frame in out(conn)] == [None, 1]


def test_client_continues_only_on_a_fresh_channel() -> None:
    used = channel()
    used.receive(1)
    conn = SessionConnection(role=Role.CLIENT, timing=TIMING, now=0.0)
    with pytest.raises(ProtocolViolation):
        conn.start(f.Hello(continue_session="s-1"), used)


@pytest.mark.parametrize(
    "answer", [ready(resumed=True), msgspec.structs.replace(ready(), session_id="s-2")]
)
def test_client_refuses_a_ready_that_does_not_continue_the_conversation(answer: f.Ready) -> None:
    conn = SessionConnection(role=Role.CLIENT, timing=TIMING, now=0.0)
    conn.start(f.Hello(continue_session="s-1"), channel())
    conn.data_to_send()
    assert conn.receive_text(text(answer), 0.0) == []
    assert conn.close_request == PROTOCOL_ERROR


def test_client_opens_a_continued_conversation_and_resends_its_new_messages() -> None:
    fresh = channel()
    fresh.send(f.Message(seq=0, content="typed while away"))
    conn = SessionConnection(role=Role.CLIENT, timing=TIMING, now=0.0)
    conn.start(f.Hello(continue_session="s-1"), fresh)
    assert json.loads(conn.data_to_send()[0])["continue"] == "s-1"
    events = conn.receive_text(text(ready()), 0.0)
    assert [type(e) for e in events] == [ReadyReceived]
    assert [(m["type"], m["seq"]) for m in out(conn)] == [("message", 1)]


# -- idempotency keys (`message.client_id`) ----------------------------------------------


def test_server_hands_the_message_key_to_the_adapter() -> None:
    conn, _ = open_server()
    keyed = text(f.Message(seq=1, content="hi", client_id="cm-1"))
    [event] = conn.receive_text(keyed, 0.0)
    assert isinstance(event, Received)
    assert isinstance(event.frame, f.Message)
    assert event.frame.client_id == "cm-1"


def test_the_key_survives_a_resume_and_a_continued_numbering() -> None:
    _, chan = open_client()
    chan.send(f.Message(seq=0, content="hi", client_id="cm-1"))
    resumed, _ = started(chan=chan)
    resumed.receive_text(text(ready(resumed=True)), 0.0)
    [sent] = out(resumed)
    assert (sent["seq"], sent["client_id"]) == (1, "cm-1")
    # A continuation renumbers the unanswered message into a fresh channel, key and all.
    [data] = chan.unacknowledged()
    again = msgspec.structs.replace(f.client_frame_decoder.decode(data), seq=0)
    fresh = channel()
    fresh.send(again)
    continued = SessionConnection(role=Role.CLIENT, timing=TIMING, now=0.0)
    continued.start(f.Hello(continue_session="s-1"), fresh)
    continued.data_to_send()
    continued.receive_text(text(ready()), 0.0)
    [sent] = out(continued)
    assert (sent["seq"], sent["client_id"]) == (1, "cm-1")
