"""The sans-I/O core in ledger mode (the server on the session-state port): an ack
never promises what the ledger does not hold, and acks received are reported."""

from __future__ import annotations

import json
from typing import Any

from portico.protocols.session import frames as f
from portico.protocols.session.channel import Channel
from portico.protocols.session.connection import (
    Acknowledged,
    HelloReceived,
    Received,
    Role,
    SessionConnection,
    State,
    Timing,
)

TIMING = Timing(ack_delay=0.1, ack_every=2)


def ready(last_seq: int) -> f.Ready:
    return f.Ready(
        session_id="s-1",
        resumed=False,
        last_seq=last_seq,
        capabilities=("resume",),
        heartbeat_ms=15000,
        resume_window_ms=30000,
    )


def open_ledger_server(chan: Channel | None = None) -> tuple[SessionConnection, Channel]:
    conn = SessionConnection(role=Role.SERVER, timing=TIMING, now=0.0, ledger=True)
    chan = chan or Channel(max_messages=100, max_bytes=100_000)
    [event] = conn.receive_text(f.encode(f.Hello()), 0.0)
    assert isinstance(event, HelloReceived)
    conn.accept(chan, ready(chan.handled), 0)
    assert conn.state is State.OPEN
    conn.data_to_send()
    return conn, chan


def acks(conn: SessionConnection) -> list[int]:
    sent: list[dict[str, Any]] = [json.loads(data) for data in conn.data_to_send()]
    return [frame["seq"] for frame in sent if frame["type"] == "ack"]


def message(seq: int) -> bytes:
    return f.encode(f.Message(seq=seq, content="hi"))


def test_a_handled_message_is_acknowledged_only_once_confirmed() -> None:
    conn, _ = open_ledger_server()
    [event] = conn.receive_text(message(1), 0.0)
    assert isinstance(event, Received)
    conn.on_timer(1.0)  # past the ack delay: still nothing, the ledger has not marked it
    assert acks(conn) == []
    conn.confirm(1, 1.0)
    conn.on_timer(1.2)
    assert acks(conn) == [1]


def test_acks_count_only_confirmed_messages() -> None:
    conn, _ = open_ledger_server()
    conn.receive_text(message(1), 0.0)
    conn.receive_text(message(2), 0.0)  # ack_every reached, but nothing confirmed
    conn.confirm(1, 0.0)
    conn.on_timer(0.2)
    assert acks(conn) == [1]  # not 2: its mark is still on its way


def test_a_duplicate_is_acknowledged_again_at_the_confirmed_position() -> None:
    conn, _ = open_ledger_server()
    conn.receive_text(message(1), 0.0)
    conn.confirm(1, 0.0)
    conn.on_timer(0.2)
    assert acks(conn) == [1]
    assert conn.receive_text(message(1), 0.3) == []
    conn.on_timer(0.5)
    assert acks(conn) == [1]


def test_an_ack_received_is_reported_for_the_ledger() -> None:
    conn, chan = open_ledger_server()
    seq, data = chan.number(f.Chunk(seq=0, turn_id="t", content="x"))
    chan.keep(seq, data)
    assert conn.receive_text(f.encode(f.Ack(seq=1)), 0.0) == [Acknowledged(1)]
    assert chan.unacknowledged() == []


def test_a_restored_channel_resends_its_backlog_and_numbers_on() -> None:
    chan = Channel.restore(
        max_messages=10,
        max_bytes=10_000,
        next_seq=4,
        handled=2,
        peer_acked=1,
        unacknowledged=((2, b"m2"), (3, b"m3")),
    )
    conn = SessionConnection(role=Role.SERVER, timing=TIMING, now=0.0, ledger=True)
    conn.receive_text(f.encode(f.Hello()), 0.0)
    conn.accept(chan, ready(2), 2)
    sent = conn.data_to_send()
    assert sent[1:] == [b"m3"]  # ready, then what the client has not acknowledged
    assert chan.number(f.Chunk(seq=0, turn_id="t", content="x"))[0] == 4
    # A message acknowledged while it was being recorded is not kept for a resend.
    assert conn.receive_text(f.encode(f.Ack(seq=3)), 0.0) == [Acknowledged(3)]
    chan.keep(3, b"late")
    assert chan.unacknowledged() == []
