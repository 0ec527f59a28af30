"""The session-scoped half of `/v1/session`: numbering, acks, the resend buffer (spec §2, §6, §7).

`Channel` is pure: every rule is checked here without a socket or a clock.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from portico.errors import BufferOverflow, ProtocolViolation, ResumeFailed
from portico.protocols.session import frames as f
from portico.protocols.session.channel import Channel


def make(max_messages: int = 100, max_bytes: int = 1_000_000) -> Channel:
    return Channel(max_messages=max_messages, max_bytes=max_bytes)


def chunk(text: str = "x") -> f.Chunk:
    return f.Chunk(seq=0, turn_id="t-1", content=text)


def decoded(data: bytes) -> dict[str, Any]:
    value = json.loads(data)
    assert isinstance(value, dict)
    return value


def sent_seqs(channel: Channel) -> list[int]:
    return [decoded(data)["seq"] for data in channel.unacknowledged()]


# -- numbering (§2) ------------------------------------------------------------------------


def test_a_new_channel_has_sent_and_handled_nothing() -> None:
    channel = make()
    assert channel.next_seq == 1
    assert channel.handled == 0
    assert channel.peer_acked == 0
    assert channel.buffered == (0, 0)
    assert channel.unacknowledged() == []


def test_seq_starts_at_1_and_grows_by_exactly_1() -> None:
    channel = make()
    seqs = [decoded(channel.send(chunk(str(i))))["seq"] for i in range(5)]
    assert seqs == [1, 2, 3, 4, 5]
    assert channel.next_seq == 6


def test_the_seq_the_caller_put_in_the_frame_is_replaced() -> None:
    channel = make()
    data = channel.send(f.Chunk(seq=99, turn_id="t", content="a"))
    assert decoded(data)["seq"] == 1


def test_numbering_continues_after_acknowledgements() -> None:
    """Numbering belongs to the session: freeing the buffer never restarts it."""
    channel = make()
    channel.send(chunk())
    channel.send(chunk())
    channel.acknowledge(2)
    assert decoded(channel.send(chunk()))["seq"] == 3


@pytest.mark.parametrize(
    "frame",
    [
        f.Chunk(seq=0, turn_id="t-1", content="hi"),
        f.Done(seq=0, turn_id="t-1", content="hi"),
        f.Transcript(seq=0, role="user", text="hi"),
        f.ServerToolResult(seq=0, call_id="c-1", error="timeout"),
        f.ToolCall(seq=0, turn_id="t-1", tool_call=f.ToolCallInfo(id="c", name="n", arguments={})),
        f.Error(seq=0, turn_id="t-1", error=f.ErrorInfo(code="X", message="m")),
        f.Message(seq=0, content="hi"),
        f.ToolCallAck(seq=0, call_id="c-1"),
        f.ToolCallNack(seq=0, call_id="c-1", reason="no"),
        f.ClientToolResult(seq=0, call_id="c-1", result={"ok": True}),
        f.Context(seq=0, context={"doc": "a"}),
        f.Interrupt(seq=0),
        f.End(seq=0),
    ],
    ids=lambda frame: type(frame).__name__,
)
def test_send_encodes_seq_at_top_level_beside_type(frame: Any) -> None:
    channel = make()
    channel.send(chunk())  # so the seq under test is not the default-looking 1
    value = decoded(channel.send(frame))
    assert value["type"] == type(frame).__struct_config__.tag
    assert value["seq"] == 2
    # The rest of the frame is untouched, and still decodes as the peer would.
    client = isinstance(frame, f.ClientNumbered)
    decoder = f.client_frame_decoder if client else f.server_frame_decoder
    again = decoder.decode(channel.unacknowledged()[-1])
    assert again == type(frame)(**{**_fields(frame), "seq": 2})


def _fields(frame: Any) -> dict[str, Any]:
    return {name: getattr(frame, name) for name in frame.__struct_fields__}


def test_send_returns_exactly_what_is_kept_for_the_resend() -> None:
    channel = make()
    first = channel.send(chunk("a"))
    second = channel.send(chunk("b"))
    assert channel.unacknowledged() == [first, second]
    assert channel.buffered == (2, len(first) + len(second))


# -- acknowledgements (§6) -----------------------------------------------------------------


def test_a_cumulative_ack_frees_everything_up_to_n() -> None:
    channel = make()
    data = [channel.send(chunk(str(i))) for i in range(5)]
    channel.acknowledge(3)
    assert channel.peer_acked == 3
    assert channel.unacknowledged() == data[3:]
    assert channel.buffered == (2, len(data[3]) + len(data[4]))
    channel.acknowledge(5)
    assert channel.unacknowledged() == []
    assert channel.buffered == (0, 0)


def test_a_backlog_read_back_from_the_port_replaces_what_was_kept() -> None:
    # The server on the in-process port keeps no copy of the resend buffer: a resume
    # reads it back from the port into the channel.
    channel = make()
    data = [channel.send(chunk(str(i))) for i in range(4)]
    channel.acknowledge(1)
    channel.replace_backlog(((3, data[2]), (4, data[3])))
    assert channel.unacknowledged() == data[2:]
    assert channel.buffered == (2, len(data[2]) + len(data[3]))
    channel.replace_backlog(((1, data[0]), (4, data[3])))  # at or below peer_acked: dropped
    assert channel.unacknowledged() == [data[3]]


def test_an_ack_may_skip_ahead_over_several_messages() -> None:
    channel = make()
    for _ in range(4):
        channel.send(chunk())
    channel.acknowledge(4)
    assert channel.buffered == (0, 0)


def test_a_regressing_ack_is_ignored() -> None:
    channel = make()
    data = [channel.send(chunk(str(i))) for i in range(4)]
    channel.acknowledge(3)
    channel.acknowledge(1)
    assert channel.peer_acked == 3
    assert channel.unacknowledged() == data[3:]


def test_a_repeated_ack_is_ignored() -> None:
    channel = make()
    data = [channel.send(chunk(str(i))) for i in range(3)]
    channel.acknowledge(2)
    channel.acknowledge(2)
    assert channel.unacknowledged() == data[2:]


def test_ack_zero_on_a_new_channel_is_fine() -> None:
    """A new session's `ready.last_seq` and a new client's `hello.last_seq` are 0."""
    channel = make()
    channel.acknowledge(0)
    assert channel.peer_acked == 0


@pytest.mark.parametrize(("sent", "ack"), [(0, 1), (3, 4), (3, 1_000_000)])
def test_an_ack_beyond_the_highest_seq_sent_is_a_protocol_error(sent: int, ack: int) -> None:
    channel = make()
    data = [channel.send(chunk(str(i))) for i in range(sent)]
    with pytest.raises(ProtocolViolation) as caught:
        channel.acknowledge(ack)
    assert caught.value.code == "PROTOCOL_ERROR"
    assert caught.value.close_code == 4400
    # The session stays resumable: nothing was forgotten.
    assert channel.peer_acked == 0
    assert channel.unacknowledged() == data


def test_an_ack_beyond_after_a_good_ack_keeps_the_good_one() -> None:
    channel = make()
    data = [channel.send(chunk(str(i))) for i in range(3)]
    channel.acknowledge(1)
    with pytest.raises(ProtocolViolation):
        channel.acknowledge(4)
    assert channel.peer_acked == 1
    assert channel.unacknowledged() == data[1:]


# -- receiving (§6) ------------------------------------------------------------------------


def test_receive_accepts_the_next_seq_in_order() -> None:
    channel = make()
    assert [channel.receive(seq) for seq in (1, 2, 3)] == [True, True, True]
    assert channel.handled == 3


def test_a_duplicate_is_discarded_without_error() -> None:
    channel = make()
    for seq in (1, 2, 3):
        channel.receive(seq)
    assert channel.receive(3) is False
    assert channel.receive(1) is False
    assert channel.handled == 3
    assert channel.receive(4) is True


@pytest.mark.parametrize(("handled", "seq"), [(0, 2), (3, 5), (3, 100)])
def test_a_gap_is_a_protocol_error(handled: int, seq: int) -> None:
    channel = make()
    for n in range(1, handled + 1):
        channel.receive(n)
    with pytest.raises(ProtocolViolation) as caught:
        channel.receive(seq)
    assert caught.value.close_code == 4400
    assert channel.handled == handled
    # After the gap the peer resumes and resends from handled + 1.
    assert channel.receive(handled + 1) is True


def test_sending_and_receiving_are_independent_directions() -> None:
    channel = make()
    channel.receive(1)
    channel.receive(2)
    assert decoded(channel.send(chunk()))["seq"] == 1
    channel.acknowledge(1)
    assert channel.handled == 2


# -- the resend buffer (§7) ----------------------------------------------------------------


def test_unacknowledged_returns_the_backlog_in_order() -> None:
    channel = make()
    for i in range(6):
        channel.send(chunk(str(i)))
    channel.acknowledge(2)
    backlog = [decoded(data) for data in channel.unacknowledged()]
    assert [value["seq"] for value in backlog] == [3, 4, 5, 6]
    assert [value["content"] for value in backlog] == ["2", "3", "4", "5"]


def test_unacknowledged_is_a_snapshot() -> None:
    channel = make()
    channel.send(chunk())
    backlog = channel.unacknowledged()
    channel.acknowledge(1)
    assert len(backlog) == 1
    assert channel.unacknowledged() == []


def _assert_overflow(exc: BufferOverflow) -> None:
    assert isinstance(exc, ResumeFailed)
    assert exc.code == "RESUME_FAILED"
    assert exc.close_code == 4404
    assert exc.details == {"reason": "buffer_overflow"}


def test_the_buffer_is_bounded_by_messages() -> None:
    channel = make(max_messages=3)
    data = [channel.send(chunk(str(i))) for i in range(3)]
    with pytest.raises(BufferOverflow) as caught:
        channel.send(chunk("refused"))
    _assert_overflow(caught.value)
    # The refused send numbered and kept nothing.
    assert channel.next_seq == 4
    assert channel.unacknowledged() == data
    assert channel.buffered == (3, sum(map(len, data)))


def test_the_buffer_is_bounded_by_bytes() -> None:
    one = len(make().send(chunk("x" * 10)))
    channel = make(max_bytes=2 * one + one // 2)
    data = [channel.send(chunk("x" * 10)) for _ in range(2)]
    with pytest.raises(BufferOverflow) as caught:
        channel.send(chunk("x" * 10))
    _assert_overflow(caught.value)
    assert channel.next_seq == 3
    assert channel.unacknowledged() == data
    assert channel.buffered == (2, 2 * one)


def test_the_byte_bound_is_inclusive() -> None:
    one = len(make().send(chunk("x")))
    channel = make(max_bytes=2 * one)
    channel.send(chunk("x"))
    channel.send(chunk("x"))  # exactly at the bound: kept
    assert channel.buffered == (2, 2 * one)
    with pytest.raises(BufferOverflow):
        channel.send(chunk(""))


def test_a_single_message_larger_than_the_byte_bound_is_refused() -> None:
    channel = make(max_bytes=10)
    with pytest.raises(BufferOverflow):
        channel.send(chunk("x" * 100))
    assert channel.next_seq == 1
    assert channel.buffered == (0, 0)


def test_an_ack_makes_room_again() -> None:
    channel = make(max_messages=2)
    channel.send(chunk())
    channel.send(chunk())
    with pytest.raises(BufferOverflow):
        channel.send(chunk())
    channel.acknowledge(1)
    assert decoded(channel.send(chunk()))["seq"] == 3
    assert sent_seqs(channel) == [2, 3]


def test_an_overflowed_channel_can_still_receive() -> None:
    channel = make(max_messages=1)
    channel.send(chunk())
    with pytest.raises(BufferOverflow):
        channel.send(chunk())
    assert channel.receive(1) is True
