"""Fuzz the `/v1/rpc` decoder: whatever a client sends gets a defined answer.

Every frame after `connect` is answered by at most one frame (a reply with its id,
or an error frame), never an exception, and the connection stays open; before
`connect` anything else is refused with 4401.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portico.protocols.rpc import frames as f
from portico.protocols.rpc.connection import RequestReceived, RpcConnection, State

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
param_names = st.sampled_from(
    [
        "session_id",
        "limit",
        "cursor",
        "client_id",
        "content_data",
        "title",
        "deleted_at",
        "rtc_id",
        "status",
        "success",
        "message_id",
        "turn_id",
        "metadata",
        "old_server_session_id",
        "old_server_message_id",
    ]
)
requests = st.fixed_dictionaries(
    {
        "id": st.one_of(st.text(min_size=1, max_size=8), json_values),
        "method": st.one_of(st.sampled_from(sorted(f.METHODS)), json_values),
        "params": st.one_of(st.dictionaries(param_names, json_values, max_size=5), json_values),
    }
)


def opened() -> RpcConnection:
    conn = RpcConnection(max_send_queue_bytes=1 << 20)
    conn.receive_text(b'{"type": "connect"}')
    conn.accept(user_id="u", epoch="e", offset=0, recovered=False)
    conn.replay_done()
    while conn.next_frame() is not None:
        pass
    return conn


def answers(conn: RpcConnection) -> list[dict[str, Any]]:
    out = []
    while (data := conn.next_frame()) is not None:
        out.append(json.loads(data))
    return out


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_any_bytes_get_at_most_one_error_frame(data: bytes) -> None:
    conn = opened()
    events = conn.receive_text(data)
    replies = answers(conn)
    assert len(events) + len(replies) == 1
    assert conn.state is State.OPEN


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(requests)
def test_any_request_is_an_event_or_exactly_one_answer(frame: dict[str, Any]) -> None:
    conn = opened()
    events = conn.receive_text(json.dumps(frame))
    replies = answers(conn)
    assert len(events) + len(replies) == 1
    for event in events:
        assert isinstance(event, RequestReceived)
        assert event.request.method in f.METHODS
        assert isinstance(event.request.params, f.METHODS[event.request.method].params)
    for reply in replies:
        code = reply["error"]["code"]
        assert code in {"invalid_request", "method_not_found"}
        if "id" in reply:
            assert reply["id"] == frame["id"]
    assert conn.state is State.OPEN
    assert conn.close_request is None


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["type", "token", "offset", "epoch"]), json_values))
def test_any_first_frame_is_a_connect_or_a_4401(frame: dict[str, Any]) -> None:
    conn = RpcConnection(max_send_queue_bytes=1 << 20)
    events = conn.receive_text(json.dumps(frame))
    if events:
        assert conn.state is State.AWAIT_ACCEPT
    else:
        assert conn.close_request == (4401, "unauthenticated")
