"""The `/v1/rpc` core, sans-I/O: frames in, events and frames out."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from portico.domain.model import Message, Session, Update, UpdateItem
from portico.errors import (
    InternalError,
    InvalidMessage,
    MediaNotEnabled,
    PorticoError,
    RateLimited,
    SessionNotFound,
    StoreError,
)
from portico.protocols.rpc import frames as f
from portico.protocols.rpc.connection import (
    MAX_HELD_LIVE,
    ConnectReceived,
    RequestReceived,
    RpcConnection,
    State,
)


def drain(conn: RpcConnection) -> list[dict[str, Any]]:
    frames = []
    while (data := conn.next_frame()) is not None:
        frames.append(json.loads(data))
    return frames


def opened(*, queue: int = 1 << 20) -> RpcConnection:
    conn = RpcConnection(max_send_queue_bytes=queue)
    assert conn.receive_text(b'{"type": "connect"}') == [ConnectReceived(f.Connect())]
    conn.accept(user_id="alice", epoch="e1", offset=0, recovered=False)
    conn.replay_done()
    drain(conn)
    return conn


def session_update(offset: int, session_id: str = "s1") -> Update:
    session = Session(
        id=session_id,
        owner="alice",
        agent="default",
        created_at=1.0,
        updated_at=1.0,
        last_activity_at=1.0,
    )
    return Update(
        id=f"u{offset}",
        owner="alice",
        offset=offset,
        items=(UpdateItem("session", "created", session_id),),
        data_list=(session,),
        created_at=1.0,
    )


def message_update(offset: int, action: str, status: str, message_id: str = "m1") -> Update:
    message = Message(
        id=message_id,
        session_id="s1",
        role="assistant",
        content="",
        created_at=1.0,
        updated_at=1.0,
        status=status,  # type: ignore[arg-type]
    )
    return Update(
        id=f"u{offset}",
        owner="alice",
        offset=offset,
        items=(UpdateItem("message", action, message_id),),  # type: ignore[arg-type]
        data_list=(message,),
        created_at=1.0,
    )


def live(index: int, message_id: str = "m1") -> f.Live:
    return f.Live("s1", "t1", message_id, index, f"d{index}")


def kinds(frames: list[dict[str, Any]]) -> list[str]:
    return [frame.get("type", "reply") for frame in frames]


# -- connect --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "first",
    [
        b'{"id": "1", "method": "v1.session.list"}',
        b"not json",
        b'{"type": "connect", "offset": "ten"}',
        b'{"type": "connect", "offset": -1}',
        b'{"type": "connect", "token": 5}',
        b"[1, 2]",
    ],
)
def test_anything_but_a_good_connect_first_is_unauthenticated_and_closes_4401(
    first: bytes,
) -> None:
    conn = RpcConnection(max_send_queue_bytes=1 << 20)
    assert conn.receive_text(first) == []
    assert drain(conn) == [
        {
            "type": "error",
            "error": {"code": "unauthenticated", "message": "the first frame must be connect"},
        }
    ]
    assert conn.close_request == (4401, "unauthenticated")
    assert conn.receive_text(b'{"type": "connect"}') == []  # closed: ignored


def test_connect_carries_token_offset_and_epoch() -> None:
    conn = RpcConnection(max_send_queue_bytes=1 << 20)
    events = conn.receive_text(b'{"type": "connect", "token": "t", "offset": 41, "epoch": "e"}')
    assert events == [ConnectReceived(f.Connect(token="t", offset=41, epoch="e"))]
    assert conn.state is State.AWAIT_ACCEPT
    conn.accept(user_id="u", epoch="e", offset=57, recovered=True)
    assert drain(conn) == [
        {"type": "connected", "user_id": "u", "epoch": "e", "offset": 57, "recovered": True}
    ]


def test_requests_before_connected_are_refused_without_closing() -> None:
    conn = RpcConnection(max_send_queue_bytes=1 << 20)
    conn.receive_text(b'{"type": "connect"}')
    assert conn.receive_text(b'{"id": "1", "method": "v1.session.list"}') == []
    assert [frame["error"]["code"] for frame in drain(conn)] == ["invalid_request"]
    assert conn.close_request is None


# -- requests -------------------------------------------------------------------------------


def test_a_valid_request_becomes_an_event_with_typed_params() -> None:
    conn = opened()
    events = conn.receive_text(
        b'{"id": "r-1", "method": "v1.message.send", '
        b'"params": {"content_data": "hi", "client_id": "c1"}}'
    )
    assert events == [
        RequestReceived(
            f.Request(
                id="r-1",
                method="v1.message.send",
                params=f.MessageSend(content_data="hi", client_id="c1"),
            )
        )
    ]


def test_defaults_apply_when_params_are_absent() -> None:
    conn = opened()
    (event,) = conn.receive_text(b'{"id": "1", "method": "v1.session.list"}')
    assert isinstance(event, RequestReceived)
    assert event.request.params == f.SessionList(cursor="", limit=20)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({}, "params.session_id"),
        ({"session_id": 7}, "params.session_id"),
        ({"session_id": "s", "limit": 0}, "params.limit"),
        ({"session_id": "s", "limit": 201}, "params.limit"),
        ({"session_id": "s", "limit": "ten"}, "params.limit"),
        ({"session_id": "s", "cursor": [1]}, "params.cursor"),
    ],
)
def test_bad_params_are_invalid_request_naming_the_field(
    params: dict[str, Any], field: str
) -> None:
    conn = opened()
    frame = {"id": "r", "method": "v1.message.list", "params": params}
    assert conn.receive_text(json.dumps(frame)) == []
    (reply,) = drain(conn)
    assert reply["id"] == "r"
    assert reply["error"]["code"] == "invalid_request"
    assert reply["error"]["details"] == {"field": field}
    assert conn.state is State.OPEN


def test_limit_maximum_is_per_method() -> None:
    conn = opened()
    ok = {
        "id": "a",
        "method": "v1.session.fork",
        "params": {
            "old_server_session_id": "s",
            "old_server_message_id": "m",
            "content_data": "x",
            "limit": 1000,
        },
    }
    assert len(conn.receive_text(json.dumps(ok))) == 1
    too_many = {"id": "b", "method": "v1.session.list", "params": {"limit": 101}}
    assert conn.receive_text(json.dumps(too_many)) == []
    assert drain(conn)[0]["error"]["details"] == {"field": "params.limit"}


def test_params_that_are_not_an_object_are_invalid() -> None:
    conn = opened()
    conn.receive_text(b'{"id": "r", "method": "v1.session.list", "params": [1]}')
    assert drain(conn)[0]["error"]["details"] == {"field": "params"}


def test_unknown_method_is_method_not_found() -> None:
    conn = opened()
    conn.receive_text(b'{"id": "r", "method": "v1.session.explode"}')
    (reply,) = drain(conn)
    assert (reply["id"], reply["error"]["code"]) == ("r", "method_not_found")


@pytest.mark.parametrize(
    "frame",
    [
        b"not json",
        b'{"method": "v1.session.list"}',
        b'{"id": 5, "method": "v1.session.list"}',
        b'{"id": "", "method": "v1.session.list"}',
        b'{"type": "connect"}',
        b'{"type": "subscribe"}',
        b'"text"',
    ],
)
def test_malformed_frames_get_an_error_frame_and_the_connection_stays_open(frame: bytes) -> None:
    conn = opened()
    assert conn.receive_text(frame) == []
    (reply,) = drain(conn)
    assert reply["type"] == "error"
    assert reply["error"]["code"] == "invalid_request"
    assert conn.state is State.OPEN
    assert conn.close_request is None


def test_a_method_that_is_not_a_string_is_answered_by_id() -> None:
    conn = opened()
    conn.receive_text(b'{"id": "r", "method": 3}')
    assert drain(conn)[0] == {
        "id": "r",
        "error": {
            "code": "invalid_request",
            "message": "`method` must be a string",
            "details": {"field": "method"},
        },
    }


def test_replies_carry_result_and_updates_or_an_error() -> None:
    conn = opened()
    conn.reply("a", {"ok": 1}, [session_update(1)])
    conn.reply("q", {"ok": 2}, None)
    conn.reply_error("e", SessionNotFound("s9"))
    action, query, failed = drain(conn)
    assert action["result"] == {"ok": 1}
    assert [u["offset"] for u in action["updates"]] == [1]
    assert action["updates"][0]["data_list"][0]["id"] == "s1"
    assert "updates" not in query
    assert failed == {
        "id": "e",
        "error": {"code": "session.not_found", "message": "session s9 not found"},
    }


# -- updates: replay, order, repeats ---------------------------------------------------------


def recovering(offset: int) -> RpcConnection:
    conn = RpcConnection(max_send_queue_bytes=1 << 20)
    conn.receive_text(json.dumps({"type": "connect", "offset": offset, "epoch": "e"}))
    conn.accept(user_id="alice", epoch="e", offset=9, recovered=True)
    conn.start_from(offset)
    drain(conn)
    return conn


def test_replay_fills_missing_offsets_with_gaps() -> None:
    conn = recovering(2)
    conn.replayed(session_update(3))
    conn.replayed(session_update(6))
    conn.gaps_until(8)
    conn.replay_done()
    frames = drain(conn)
    assert [(fr["type"], fr.get("offset") or fr["update"]["offset"]) for fr in frames] == [
        ("update", 3),
        ("gap", 4),
        ("gap", 5),
        ("update", 6),
        ("gap", 7),
        ("gap", 8),
    ]


def test_updates_pushed_during_the_replay_follow_it_in_order_without_repeats() -> None:
    conn = recovering(0)
    conn.push_update(session_update(4))
    conn.push_update(session_update(2))  # also in the replay
    conn.push_update(session_update(3))
    conn.replayed(session_update(1))
    conn.replayed(session_update(2))
    conn.replay_done()
    conn.push_update(session_update(3))  # a repeat after the replay
    conn.push_update(session_update(5))
    offsets = [fr["update"]["offset"] for fr in drain(conn)]
    assert offsets == [1, 2, 3, 4, 5]


def test_updates_the_client_already_has_are_never_sent() -> None:
    conn = opened()
    conn.start_from(10)
    conn.push_update(session_update(10))
    conn.push_update(session_update(11))
    assert [fr["update"]["offset"] for fr in drain(conn)] == [11]


# -- live -----------------------------------------------------------------------------------


def test_live_chunks_wait_for_their_message_created_update() -> None:
    conn = opened()
    conn.push_live(live(0))
    conn.push_live(live(1))
    assert drain(conn) == []
    conn.push_update(message_update(1, "created", "streaming"))
    conn.push_live(live(2))
    frames = drain(conn)
    assert kinds(frames) == ["update", "live", "live", "live"]
    assert [fr["live"]["index"] for fr in frames[1:]] == [0, 1, 2]


def test_live_chunks_are_dropped_once_the_final_content_went_out() -> None:
    conn = opened()
    conn.push_live(live(0, "m2"))
    conn.push_update(message_update(1, "created", "completed", "m2"))  # no streaming phase
    conn.push_live(live(1, "m2"))
    assert kinds(drain(conn)) == ["update"]


def test_held_live_chunks_are_bounded() -> None:
    conn = opened()
    for index in range(MAX_HELD_LIVE + 10):
        conn.push_live(live(index))
    conn.push_update(message_update(1, "created", "streaming"))
    assert len([fr for fr in drain(conn) if fr["type"] == "live"]) == MAX_HELD_LIVE


def test_live_frames_are_dropped_not_queued_past_the_send_queue_bound() -> None:
    conn = opened(queue=2000)
    conn.push_update(message_update(1, "created", "streaming"))
    for index in range(200):
        conn.push_live(live(index))
    assert conn.close_request is None
    assert not conn.overflowed
    frames = drain(conn)
    assert 0 < len(frames) < 201


def test_updates_past_the_send_queue_bound_close_4408() -> None:
    conn = opened(queue=2000)
    for offset in range(1, 50):
        conn.push_update(session_update(offset))
    assert conn.overflowed
    assert conn.close_request == (4408, "slow consumer")


def test_nothing_is_pushed_before_the_connection_is_accepted() -> None:
    conn = RpcConnection(max_send_queue_bytes=1 << 20)
    conn.push_update(session_update(1))
    conn.push_live(live(0))
    assert drain(conn) == []


def test_frames_decode_with_msgspec_types() -> None:
    # Every server frame type encodes (the AsyncAPI document relies on the types).
    for frame in (f.GapFrame(3), f.LiveFrame(live(0)), f.ErrorFrame(f.ErrorBody("c", "m"))):
        assert msgspec.json.decode(msgspec.json.encode(frame))["type"] in {"gap", "live", "error"}


# -- limits and error codes ----------------------------------------------------------------------


def test_requests_past_the_rate_limit_are_rate_limited_and_the_rest_go_through() -> None:
    conn = RpcConnection(
        max_send_queue_bytes=1 << 20, requests_per_second=10, request_burst=3, now=0.0
    )
    conn.receive_text(b'{"type": "connect"}', 0.0)
    conn.accept(user_id="u", epoch="e", offset=0, recovered=False)
    conn.replay_done()
    drain(conn)
    request = b'{"id": "r", "method": "v1.session.list"}'
    accepted = sum(len(conn.receive_text(request, 0.0)) for _ in range(5))
    assert accepted == 3
    assert [fr["error"]["code"] for fr in drain(conn)] == ["rate_limited", "rate_limited"]
    assert len(conn.receive_text(request, 0.1)) == 1  # a token came back after 100 ms


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidMessage("bad part"), "invalid_request"),
        (RateLimited("slow down"), "rate_limited"),
        (MediaNotEnabled(), "invalid_request"),
        (StoreError("disk full at /var/secret"), "internal"),
        (InternalError(), "internal"),
        (SessionNotFound("s"), "session.not_found"),
    ],
)
def test_errors_of_shared_code_get_rpc_codes_and_hide_internals(
    error: PorticoError, code: str
) -> None:
    conn = opened()
    conn.reply_error("r", error)
    (reply,) = drain(conn)
    assert reply["error"]["code"] == code
    if code == "internal":
        assert reply["error"]["message"] == "internal error"


def test_a_live_push_that_skips_offsets_announces_them_as_gaps() -> None:
    conn = opened()
    conn.push_update(session_update(1))
    conn.push_update(session_update(4))
    frames = drain(conn)
    assert [(fr["type"], fr.get("offset") or fr["update"]["offset"]) for fr in frames] == [
        ("update", 1),
        ("gap", 2),
        ("gap", 3),
        ("update", 4),
    ]


def test_replies_already_streaming_at_connect_get_their_live_chunks_at_once() -> None:
    conn = opened()
    conn.streaming(["m1"])
    conn.push_live(live(7))
    assert [fr["live"]["index"] for fr in drain(conn)] == [7]


def test_an_unknown_param_is_refused_naming_it() -> None:
    conn = opened()
    frame = {
        "id": "r",
        "method": "v1.message.send",
        "params": {"content_data": "x", "client_id": "c", "session_id": "s-1"},
    }
    assert conn.receive_text(json.dumps(frame)) == []
    assert drain(conn)[0]["error"]["details"] == {"field": "params.session_id"}


def test_a_ping_is_answered_with_a_pong_whatever_the_rate_limit() -> None:
    conn = RpcConnection(max_send_queue_bytes=1 << 20, requests_per_second=1, request_burst=1)
    conn.receive_text(b'{"type": "connect"}')
    conn.accept(user_id="u", epoch="e", offset=0, recovered=False)
    conn.replay_done()
    drain(conn)
    for _ in range(3):
        assert conn.receive_text(b'{"type": "ping"}') == []
    assert drain(conn) == [{"type": "pong"}] * 3
