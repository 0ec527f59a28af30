"""A session on the in-process port has one resend buffer, the port's: the channel keeps
no copy, a resume reads the backlog back, and acks trim the port in the caller's step."""

from __future__ import annotations

import asyncio

import pytest

from portico.core.events import TurnChunk
from portico.errors import ProtocolViolation, SessionMoved
from portico.server.session_ws import LiveSession
from portico.sessionstate.memory import InProcessSessionStates
from support.live_session import in_process_session


async def open_session() -> tuple[InProcessSessionStates, LiveSession, int]:
    return await in_process_session("s-1")


def chunks(live: LiveSession, count: int) -> None:
    for index in range(count):
        live.on_turn_event(TurnChunk("s-1", "turn-1", f"c{index}", "msg-1", index))


async def test_the_port_holds_the_backlog_and_the_channel_no_copy() -> None:
    states, live, _ = await open_session()
    chunks(live, 3)
    assert live.ledger.in_process
    assert live.channel.buffered == (0, 0)
    assert [seq for seq, _ in live.ledger.backlog()] == [1, 2, 3]
    snapshot = await states.load("s-1")
    assert snapshot is not None
    assert snapshot.unacknowledged == live.ledger.backlog()


async def test_an_ack_trims_the_port_at_once() -> None:
    _, live, epoch = await open_session()
    chunks(live, 4)
    assert live.ledger.acknowledged_now(epoch, 2)
    assert [seq for seq, _ in live.ledger.backlog()] == [3, 4]
    with pytest.raises(ProtocolViolation):
        live.ledger.acknowledged_now(epoch, 5)  # beyond the highest seq sent
    with pytest.raises(SessionMoved):
        live.ledger.acknowledged_now(epoch - 1, 3)  # a fenced connection's ack


async def test_while_the_lock_is_held_the_ack_waits_its_turn() -> None:
    _, live, epoch = await open_session()
    chunks(live, 2)
    ledger = live.ledger
    async with ledger._lock:  # what a claim or a mark holds
        assert not ledger.acknowledged_now(epoch, 1)
        waiting = asyncio.ensure_future(ledger.acknowledged(epoch, 1))
        await asyncio.sleep(0)
        assert [seq for seq, _ in ledger.backlog()] == [1, 2]
    await waiting
    assert [seq for seq, _ in ledger.backlog()] == [2]
