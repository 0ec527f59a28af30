"""Credential expiry and refresh (spec identity.md) on each sans-I/O core.

Time goes in as `now` (monotonic) with the wall-clock time `WALL + now`; tokens are
`Identity` values whose `expires_at` is wall-clock. No socket, no sleep.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import pytest

from portico.auth.base import Identity
from portico.client.credentials import refresh_delay, token_expiry
from portico.protocols.credential import CredentialClock, held_off
from portico.protocols.omnia.connection import (
    ConnectionLimits,
    MessageReceived,
    OmniaConnection,
    RefreshOffered,
)
from portico.protocols.rpc import connection as rpc
from portico.protocols.session import frames as sf
from portico.protocols.session.channel import Channel
from portico.protocols.session.connection import (
    CredentialOffered,
    Received,
    Role,
    SessionConnection,
    Timing,
)

WALL = 1_800_000_000.0  # the wall-clock time at now=0
MARGIN = 30.0


def token(expires_in: float | None, *, principal: str = "alice", binding: str = "") -> Identity:
    """An identity whose token expires `expires_in` seconds after now=0."""
    expires_at = None if expires_in is None else WALL + expires_in
    return Identity(principal=principal, expires_at=expires_at, session_value=binding)


# -- the rule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lifetime", "close_at"),
    [
        (3600.0, 3570.0),  # a long token: 30 s before its exp
        (60.0, 30.0),  # exactly where the two rules meet
        (40.0, 20.0),  # shorter: at half its remaining life
        (4.0, 2.0),
    ],
)
def test_close_point_is_the_margin_before_exp_or_half_the_remaining_life(
    lifetime: float, close_at: float
) -> None:
    clock = CredentialClock(token(lifetime), margin=MARGIN, now=0.0, wall=WALL)
    assert clock.deadline == lifetime
    assert clock.close_at == close_at
    assert clock.next_deadline() == close_at
    assert not clock.close_due(close_at - 0.001, turn_running=False)
    assert clock.close_due(close_at, turn_running=False)


def test_the_remaining_life_counts_from_when_the_token_was_accepted() -> None:
    # Accepted at now=100 with 40 s left: half of those 40 s, not of the token's age.
    clock = CredentialClock(token(140.0), margin=MARGIN, now=100.0, wall=WALL + 100.0)
    assert (clock.deadline, clock.close_at) == (140.0, 120.0)


def test_a_credential_without_expiry_never_closes() -> None:
    clock = CredentialClock(token(None), margin=MARGIN, now=0.0, wall=WALL)
    assert clock.next_deadline() == math.inf
    assert not clock.expired(1e12)
    assert not clock.close_due(1e12, turn_running=False)


def test_a_ws_connection_without_expiry_shares_one_clock_that_acts_as_its_own_would() -> None:
    # No clock per idle connection (docs/performance.md): the shared one answers as a
    # CredentialClock of a credential without expiry does, refreshes included.
    own = CredentialClock(token(None), margin=MARGIN, now=0.0, wall=WALL)
    first, second = omnia(token(None)), omnia(token(None))
    assert first.credential is second.credential
    for clock in (own, first.credential):
        assert clock.next_deadline() == math.inf
        assert not clock.expired(1e12)
        assert not clock.close_due(1e12, turn_running=False)
        assert not clock.refresh(token(120.0), now=5.0, wall=WALL + 5.0)
    assert not first.expiry_due(1e12, turn_running=False)
    assert first.next_deadline() < math.inf  # the keepalive's, not the credential's


def test_the_close_waits_for_a_running_turn_then_happens_at_once() -> None:
    clock = CredentialClock(token(60.0), margin=MARGIN, now=0.0, wall=WALL)
    assert not clock.close_due(31.0, turn_running=True)
    assert clock.next_deadline() == math.inf  # due: only a turn's end asks again
    assert clock.close_due(31.5, turn_running=False)


def test_a_close_held_off_for_a_turn_elsewhere_is_marked_due() -> None:
    """The adapters ask another replica only past the close point; a held-off close
    stops asking for a timer, and closes at once when nothing runs any more."""
    clock = CredentialClock(token(60.0), margin=MARGIN, now=0.0, wall=WALL)
    assert not clock.close_point_passed(29.9)
    assert not held_off(clock, 29.9, turn_running=False)
    assert clock.next_deadline() == 30.0  # asking changed nothing
    assert clock.close_point_passed(30.0)
    assert held_off(clock, 30.0, turn_running=True)
    assert clock.next_deadline() == math.inf
    assert clock.close_point_passed(31.0)
    assert clock.close_due(31.0, turn_running=False)


@pytest.mark.parametrize(
    ("offered", "accepted"),
    [
        (token(120.0), True),
        (token(60.0), False),  # a repeat of the current token
        (token(50.0), False),  # expires sooner
        (token(120.0, principal="mallory"), False),
        (token(120.0, binding="other-device"), False),
        (token(None), False),  # never expires: not a token of this kind
    ],
)
def test_refresh_needs_same_principal_same_binding_and_later_expiry(
    offered: Identity, accepted: bool
) -> None:
    clock = CredentialClock(token(60.0), margin=MARGIN, now=0.0, wall=WALL)
    assert clock.refresh(offered, now=10.0, wall=WALL + 10.0) is accepted
    assert clock.deadline == (120.0 if accepted else 60.0)


def test_refresh_with_a_session_binding_keeps_it() -> None:
    clock = CredentialClock(token(60.0, binding="dev-1"), margin=MARGIN, now=0.0, wall=WALL)
    assert not clock.refresh(token(120.0), now=1.0, wall=WALL + 1.0)
    assert clock.refresh(token(120.0, binding="dev-1"), now=1.0, wall=WALL + 1.0)


def test_a_refresh_moves_the_deadline_and_the_close_point() -> None:
    clock = CredentialClock(token(60.0), margin=MARGIN, now=0.0, wall=WALL)
    assert clock.refresh(token(200.0), now=20.0, wall=WALL + 20.0)
    assert (clock.deadline, clock.close_at) == (200.0, 170.0)
    assert not clock.close_due(31.0, turn_running=False)


# -- /ws --------------------------------------------------------------------------------


def omnia(identity: Identity) -> OmniaConnection:
    limits = ConnectionLimits(
        max_payload_size=1 << 20, ping_interval=1e6, pong_timeout=2e6, credential_margin=MARGIN
    )
    conn = OmniaConnection(
        session_id="sess-own", binary=False, limits=limits, now=0.0, wall=WALL, identity=identity
    )
    conn.data_to_send()  # connected
    return conn


def sent(frames: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(frame) for frame in frames]


def test_ws_deadline_is_in_the_cores_next_deadline() -> None:
    assert omnia(token(40.0)).next_deadline() == 20.0


def test_ws_expiry_due_only_past_the_close_point_and_without_a_turn() -> None:
    conn = omnia(token(60.0))
    assert not conn.expiry_due(29.0, turn_running=False)
    assert not conn.expiry_due(30.0, turn_running=True)
    assert conn.expiry_due(45.0, turn_running=False)


def test_ws_message_after_the_deadline_is_credential_expired_and_not_processed() -> None:
    conn = omnia(token(60.0))
    before = conn.receive_text('{"type":"message","content":"hi"}', 59.0)
    assert isinstance(before[0], MessageReceived)
    assert conn.receive_text('{"type":"message","content":"late"}', 60.0) == []
    [error] = sent(conn.data_to_send())
    assert error["type"] == "error"
    assert error["error"]["code"] == "CREDENTIAL_EXPIRED"


def test_ws_credential_refresh_is_an_event_and_has_no_reply() -> None:
    conn = omnia(token(60.0))
    events = conn.receive_text('{"type":"credential_refresh","token":"t2"}', 5.0)
    assert events == [RefreshOffered("t2")]
    assert conn.data_to_send() == []


@pytest.mark.parametrize(
    ("offered", "accepted"),
    [
        (token(120.0), True),
        (token(60.0), False),
        (token(120.0, principal="mallory"), False),
        (token(120.0, binding="x"), False),
    ],
)
def test_ws_refresh_rules_and_no_reply(offered: Identity, accepted: bool) -> None:
    conn = omnia(token(60.0))
    assert conn.refresh(offered, now=5.0, wall=WALL + 5.0) is accepted
    assert conn.data_to_send() == []
    assert conn.expiry_due(45.0, turn_running=False) is not accepted


def test_ws_refresh_after_the_deadline_is_ignored() -> None:
    conn = omnia(token(60.0))
    assert not conn.refresh(token(120.0), now=60.0, wall=WALL + 60.0)


# -- /v1/session --------------------------------------------------------------------------


READY = sf.Ready(
    session_id="s-1",
    resumed=False,
    last_seq=0,
    capabilities=("resume",),
    heartbeat_ms=15000,
    resume_window_ms=30000,
)


def session(identity: Identity) -> SessionConnection:
    conn = SessionConnection(role=Role.SERVER, timing=Timing(credential_margin=MARGIN), now=0.0)
    hello = sf.Hello(protocol=sf.PROTOCOL_VERSION)
    conn.receive_text(sf.encode(hello), 0.0)
    conn.accept(Channel(max_messages=100, max_bytes=1 << 20), READY, 0)
    conn.bind_credential(identity, now=0.0, wall=WALL)
    conn.data_to_send()  # ready
    return conn


def test_session_close_4401_at_the_close_point_once_no_turn_runs() -> None:
    conn = session(token(40.0))
    assert conn.next_deadline() == 20.0
    conn.check_credential(20.0, turn_running=True)
    assert conn.close_request is None
    conn.check_credential(25.0, turn_running=False)
    assert conn.close_request == (4401, "credential expired")


def test_session_message_after_the_deadline_is_not_handled() -> None:
    conn = session(token(60.0))
    assert conn.receive_text(sf.encode(sf.Message(seq=1, content="hi")), 61.0) == []
    [error] = sent(conn.data_to_send())
    assert error == {
        "type": "error",
        "error": {
            "code": "CREDENTIAL_EXPIRED",
            "message": "the credential expired; reconnect with a fresh one",
        },
    }
    assert conn.close_request == (4401, "CREDENTIAL_EXPIRED")
    # Not handled: a resume with a fresh token gets it resent and handled.
    assert conn.channel is not None
    assert conn.channel.handled == 0


def test_session_credential_message_is_an_event_with_no_reply() -> None:
    conn = session(token(60.0))
    frame = '{"type":"credential","credential":"t2"}'
    assert conn.receive_text(frame, 5.0) == [CredentialOffered("t2")]
    assert conn.data_to_send() == []
    assert isinstance(conn.receive_text(sf.encode(sf.Message(seq=1)), 6.0)[0], Received)


@pytest.mark.parametrize(
    ("offered", "accepted"),
    [
        (token(120.0), True),
        (token(60.0), False),
        (token(120.0, principal="mallory"), False),
        (token(120.0, binding="x"), False),
    ],
)
def test_session_refresh_rules(offered: Identity, accepted: bool) -> None:
    conn = session(token(60.0))
    assert conn.refresh(offered, now=5.0, wall=WALL + 5.0) is accepted
    conn.check_credential(45.0, turn_running=False)
    assert (conn.close_request is None) is accepted
    assert conn.data_to_send() == []


def test_session_client_sends_the_unnumbered_credential() -> None:
    conn = SessionConnection(role=Role.CLIENT, timing=Timing(), now=0.0)
    conn.start(sf.Hello(protocol=sf.PROTOCOL_VERSION), Channel(max_messages=10, max_bytes=1 << 16))
    conn.data_to_send()
    conn.receive_text(sf.encode(READY), 0.1)
    conn.send_credential("t2")
    assert sent(conn.data_to_send()) == [{"type": "credential", "credential": "t2"}]


# -- /v1/rpc ------------------------------------------------------------------------------


def rpc_connection(identity: Identity) -> rpc.RpcConnection:
    conn = rpc.RpcConnection(max_send_queue_bytes=1 << 20, credential_margin=MARGIN)
    conn.receive_text('{"type":"connect","token":"t1"}')
    conn.accept(user_id="alice", epoch="e1", offset=0, recovered=False)
    conn.replay_done()
    conn.bind_credential(identity, now=0.0, wall=WALL)
    while conn.next_frame() is not None:
        pass
    return conn


def rpc_out(conn: rpc.RpcConnection) -> list[dict[str, Any]]:
    frames = []
    while (frame := conn.next_frame()) is not None:
        frames.append(json.loads(frame))
    return frames


def test_rpc_close_4401_at_the_close_point_once_no_turn_runs() -> None:
    conn = rpc_connection(token(40.0))
    assert conn.next_deadline() == 20.0
    conn.check_credential(21.0, turn_running=True)
    assert conn.close_request is None
    conn.check_credential(22.0, turn_running=False)
    assert conn.close_request == (4401, "credential expired")


def test_rpc_request_after_the_deadline_is_credential_expired() -> None:
    conn = rpc_connection(token(60.0))
    request = '{"id":"r1","method":"session.list","params":{}}'
    assert conn.receive_text(request, 60.5) == []
    [failed] = rpc_out(conn)
    assert failed["id"] == "r1"
    assert failed["error"]["code"] == "credential_expired"


def test_rpc_credential_frame_is_an_event_with_no_reply() -> None:
    conn = rpc_connection(token(60.0))
    events = conn.receive_text('{"type":"credential","credential":"t2"}', 1.0)
    assert events == [rpc.CredentialOffered("t2")]
    assert rpc_out(conn) == []


@pytest.mark.parametrize(
    ("offered", "accepted"),
    [
        (token(120.0), True),
        (token(60.0), False),
        (token(120.0, principal="mallory"), False),
        (token(120.0, binding="x"), False),
    ],
)
def test_rpc_refresh_rules(offered: Identity, accepted: bool) -> None:
    conn = rpc_connection(token(60.0))
    assert conn.refresh(offered, now=5.0, wall=WALL + 5.0) is accepted
    conn.check_credential(45.0, turn_running=False)
    assert (conn.close_request is None) is accepted
    assert rpc_out(conn) == []


def test_rpc_rtc_answers_after_the_deadline_still_go_through() -> None:
    """They end a running turn, which the 4401 waits for."""
    conn = rpc_connection(token(60.0))
    request = '{"id":"r1","method":"v1.rtc.get","params":{"rtc_id":"rtc-1"}}'
    [event] = conn.receive_text(request, 61.0)
    assert isinstance(event, rpc.RequestReceived)


def test_ws_tool_replies_after_the_deadline_still_go_through() -> None:
    conn = omnia(token(60.0))
    frame = '{"type":"tool_result","tool_result":{"call_id":"c1","result":1}}'
    assert len(conn.receive_text(frame, 61.0)) == 1
    assert conn.data_to_send() == []


def test_session_tool_results_after_the_deadline_are_handled() -> None:
    conn = session(token(60.0))
    frame = sf.encode(sf.ClientToolResult(seq=1, call_id="c1", result=1))
    assert isinstance(conn.receive_text(frame, 61.0)[0], Received)
    assert conn.close_request is None


# -- the SDK's refresh schedule -------------------------------------------------------------


def unsigned_jwt(claims: dict[str, Any]) -> str:
    def part(data: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none'})}.{part(claims)}.sig"


def test_sdk_reads_a_jwts_exp_and_nothing_else() -> None:
    assert token_expiry(unsigned_jwt({"exp": 1_800_000_060})) == 1_800_000_060.0
    assert token_expiry(unsigned_jwt({"sub": "a"})) is None
    assert token_expiry("key-1") is None
    assert token_expiry(None) is None
    assert token_expiry("a.!!!.c") is None


@pytest.mark.parametrize("lifetime", [4.0, 40.0, 60.0, 100.0, 3600.0])
def test_sdk_refreshes_before_the_servers_close_point(lifetime: float) -> None:
    delay = refresh_delay(WALL + lifetime, WALL)
    server = CredentialClock(token(lifetime), margin=MARGIN, now=0.0, wall=WALL)
    assert 0 < delay < server.close_at
    assert delay >= lifetime - 60.0  # a long token is not refreshed needlessly early
