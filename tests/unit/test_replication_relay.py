"""The sans-I/O part of replication: which relayed entries reach this replica's
listeners (`Relay`), and the bus payloads of turn events and control (`codec`)."""

from __future__ import annotations

import msgspec
import pytest

from portico.core.events import (
    TurnChunk,
    TurnCompleted,
    TurnEvent,
    TurnFailed,
    TurnMediaChunk,
    TurnToolCall,
    TurnToolCallTimedOut,
)
from portico.core.tools import ClientReply
from portico.domain.model import ContentPart, Update
from portico.replication.codec import (
    Reply,
    Request,
    decode_control,
    decode_event,
    encode_control,
    encode_event,
)
from portico.replication.ordering import UpdateOrder
from portico.replication.relay import Relay, owner_topic, position_key, session_topic
from portico.runtime.base import MediaChunk, ToolCall

TOPIC = session_topic("sess-1")

EVENTS: list[TurnEvent] = [
    TurnChunk("s", "t", "héllo", message_id="msg-1", index=3),
    TurnMediaChunk("s", "t", MediaChunk("m", "audio/pcm", b"\x00\xff", sequence=2, is_last=True)),
    TurnToolCall("s", "t", ToolCall(id="c", name="get", arguments={"q": [1, 2.5, None]})),
    TurnToolCallTimedOut("s", "t", "c", "late"),
    TurnCompleted("s", "t", "done", parts=(ContentPart(type="text", text="x"),), cancelled=True),
    TurnCompleted("s", "t", "plain"),
    TurnFailed("s", "t", "PROVIDER_UNAVAILABLE", "down"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_turn_event_crosses_the_bus_unchanged(event: TurnEvent) -> None:
    published = decode_event(encode_event("rep-a", event))
    assert published.origin == "rep-a"
    assert type(published.event) is type(event)
    assert published.event == event


def test_a_foreign_payload_is_refused_not_misread() -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError, KeyError)):
        decode_event(b"\x93\xa1a\xa7unknown\xc0")
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_event(b"not msgpack at all")


def test_control_requests_and_replies_round_trip() -> None:
    request = Request(
        id="ctl-1",
        reply_to="rep-a",
        op="tool",
        principal="alice",
        call_id="call-1",
        reply=ClientReply(kind="result", result={"city": "Oslo"}, error=None),
    )
    assert decode_control(encode_control(request)) == request
    reply = Reply(id="ctl-1", error_code="INVALID_MESSAGE", error_message="no pending call")
    assert decode_control(encode_control(reply)) == reply


def test_positions_order_like_redis_stream_ids_and_counters() -> None:
    assert position_key("1700000000000-2") > position_key("1700000000000-1")
    assert position_key("1700000000001-0") > position_key("1700000000000-9")
    assert position_key("10") > position_key("9")  # numerically, not as text


def test_a_topic_is_read_while_one_listener_wants_it() -> None:
    relay = Relay("rep-a")
    assert relay.watch(TOPIC) is True  # the first: start reading
    assert relay.watch(TOPIC) is False
    assert relay.unwatch(TOPIC) is False  # one still wants it
    assert relay.unwatch(TOPIC) is True  # the last left: stop reading
    assert relay.topics() == []


def test_entries_this_replica_published_are_not_delivered_again() -> None:
    relay = Relay("rep-a")
    relay.watch(TOPIC)
    assert relay.accept(TOPIC, "1-0", origin="rep-b") is True
    # Its own listeners had the event from the turn directly.
    assert relay.accept(TOPIC, "2-0", origin="rep-a") is False
    assert relay.accept(TOPIC, "3-0", origin="rep-b") is True


def test_each_entry_is_delivered_once_even_when_a_read_restarts_behind() -> None:
    relay = Relay("rep-a")
    relay.watch(TOPIC)
    delivered = [p for p in ("1-0", "2-0", "3-0") if relay.accept(TOPIC, p, "rep-b")]
    # A reader that reconnected from an older position sees 2 and 3 again, then 4.
    delivered += [p for p in ("2-0", "3-0", "4-0") if relay.accept(TOPIC, p, "rep-b")]
    assert delivered == ["1-0", "2-0", "3-0", "4-0"]


def test_nothing_is_delivered_for_a_topic_nobody_watches() -> None:
    relay = Relay("rep-a")
    assert relay.accept(owner_topic("alice"), "1-0", origin="rep-b") is False
    relay.watch(TOPIC)
    relay.unwatch(TOPIC)
    assert relay.accept(TOPIC, "1-0", origin="rep-b") is False


def test_a_new_watch_after_everyone_left_starts_afresh() -> None:
    relay = Relay("rep-a")
    relay.watch(TOPIC)
    assert relay.accept(TOPIC, "5-0", "rep-b")
    relay.unwatch(TOPIC)
    relay.watch(TOPIC)
    # A new topic read (Redis recreated the stream after a restart) starts from 1 again.
    assert relay.accept(TOPIC, "1-0", "rep-b")


# -- an owner's updates in offset order ----------------------------------------------------


def update(offset: int, owner: str = "alice") -> Update:
    return Update(id=f"u{offset}", owner=owner, offset=offset, items=(), data_list=(), created_at=0)


def offsets(updates: list[Update]) -> list[int]:
    return [u.offset for u in updates]


def test_updates_are_delivered_in_offset_order_whatever_order_they_come_in() -> None:
    order = UpdateOrder()
    assert order.begin("alice", head=4) == []
    assert offsets(order.offer(update(6))) == []  # 5 first
    assert order.missing("alice") == (4, 2)  # read 5..6 from the archive
    assert offsets(order.offer(update(5))) == [5, 6]
    assert order.missing("alice") is None


def test_an_update_is_delivered_once_from_whichever_source_brings_it_first() -> None:
    order = UpdateOrder()
    order.begin("alice", head=0)
    assert offsets(order.offer(update(1))) == [1]
    assert order.offer(update(1)) == []  # the archive read brings it again
    order.announce("alice", 3)
    assert order.missing("alice") == (1, 2)
    assert offsets(order.offer(update(2)) + order.offer(update(3))) == [2, 3]


def test_what_comes_before_the_first_listener_is_held_then_cut_at_the_head() -> None:
    order = UpdateOrder()
    assert order.offer(update(3)) == []
    assert order.offer(update(5)) == []
    # The connection reads the log up to 4 itself: from the order, only 5 on.
    assert offsets(order.begin("alice", head=4)) == [5]


def test_a_pruned_range_is_skipped_instead_of_waited_for() -> None:
    order = UpdateOrder()
    order.begin("alice", head=0)
    assert order.offer(update(9)) == []
    assert offsets(order.skip_to("alice", 9)) == [9]


def test_owners_are_ordered_independently() -> None:
    order = UpdateOrder()
    order.begin("alice", head=0)
    order.begin("bob", head=10)
    assert order.offer(update(2, "alice")) == []
    assert offsets(order.offer(update(11, "bob"))) == [11]
    order.end("alice")
    assert not order.begun("alice")
