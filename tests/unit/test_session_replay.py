"""A replica taking a `/v1/session` over mid-turn numbers what the old holder did not
record, from the bus's copy of the turn's events, then what it heard meanwhile, each
step once (server/session_replay.py)."""

from __future__ import annotations

import asyncio

import msgspec

from portico.core.events import (
    TurnChunk,
    TurnCompleted,
    TurnEvent,
    TurnMediaChunk,
    TurnToolCall,
)
from portico.runtime.base import MediaChunk, ToolCall
from portico.server.session_replay import replayed_events, to_replay
from portico.server.session_ws import LiveSession
from support.live_session import in_process_session

SID = "s-1"


def chunk(turn: str, step: int) -> TurnChunk:
    return TurnChunk(SID, turn, f"{turn}-{step}", "msg", step - 1, step)


def done(turn: str, step: int) -> TurnCompleted:
    return TurnCompleted(SID, turn, "all", step=step)


def newest_first(*events: TurnEvent) -> list[TurnEvent]:
    return list(reversed(events))


def test_the_steps_after_the_recorded_one_are_replayed_oldest_first() -> None:
    bus = newest_first(
        chunk("t1", 1), done("t1", 2), chunk("t2", 1), chunk("t2", 2), chunk("t2", 3)
    )
    picked = to_replay(bus, ended=("t1",), last_step=("t2", 1))
    assert picked == [chunk("t2", 2), chunk("t2", 3)]


def test_a_turn_the_old_holder_never_numbered_is_replayed_from_its_first_step() -> None:
    bus = newest_first(chunk("t1", 1), done("t1", 2), chunk("t2", 1), chunk("t2", 2))
    assert to_replay(bus, ended=("t1",), last_step=("t1", 2)) == [chunk("t2", 1), chunk("t2", 2)]


def test_a_turn_whose_end_the_ledger_holds_is_not_replayed() -> None:
    bus = newest_first(chunk("t1", 1), done("t1", 2))
    assert to_replay(bus, ended=("t1",), last_step=("t1", 2)) == []


def test_a_turn_whose_end_was_not_recorded_gets_it_replayed() -> None:
    bus = newest_first(chunk("t1", 1), chunk("t1", 2), done("t1", 3))
    assert to_replay(bus, ended=(), last_step=("t1", 2)) == [done("t1", 3)]


def test_media_and_uncounted_events_are_not_replayed() -> None:
    media = TurnMediaChunk(SID, "t1", MediaChunk("m1", "audio/pcm", b"x", 0, False), step=2)
    uncounted = TurnChunk(SID, "t1", "voice", "msg", 0)  # a voice call's own: no step
    bus = newest_first(chunk("t1", 1), media, uncounted, chunk("t1", 3))
    assert to_replay(bus, ended=(), last_step=("", 0)) == [chunk("t1", 1), chunk("t1", 3)]


async def test_a_bus_that_does_not_answer_replays_nothing_within_the_bound() -> None:
    async def never(session_id: str, count: int, after: str) -> list[TurnEvent]:
        await asyncio.Event().wait()
        return []

    got = await replayed_events(
        never, SID, count=10, after="", ended=(), last_step=("", 0), within=0.05
    )
    assert got == []


# -- the session's side ---------------------------------------------------------------------


async def live_session(counts_steps: bool | None = True) -> LiveSession:
    """Counting steps as on a port replicas share, unless `counts_steps` is None."""
    _, live, _ = await in_process_session(SID, counts_steps=counts_steps)
    return live


def delivered(live: LiveSession) -> list[tuple[int, str]]:
    """(seq, what) of every numbered message in the session's buffer."""
    out: list[tuple[int, str]] = []
    for seq, data in live.ledger.backlog():
        frame = msgspec.json.decode(data)
        out.append((seq, frame.get("content") or frame["type"]))
    return out


async def test_what_is_heard_during_the_replay_waits_and_overlaps_once() -> None:
    live = await live_session()
    live.hold_events(("t2", 1))  # the old holder recorded t2's first step
    live.on_turn_event(chunk("t2", 3))  # heard live while the bus is read
    live.on_turn_event(chunk("t2", 4))
    assert delivered(live) == []
    live.replay([chunk("t2", 2), chunk("t2", 3)])  # the bus had up to step 3
    live.on_turn_event(done("t2", 5))
    assert delivered(live) == [(1, "t2-2"), (2, "t2-3"), (3, "t2-4"), (4, "all")]


async def test_the_ledger_records_the_step_each_event_ends_with() -> None:
    live = await live_session()
    live.on_turn_event(chunk("t1", 1))
    call = ToolCall(id="call-1", name="lookup", arguments={})
    live.on_turn_event(TurnToolCall(SID, "t1", call, step=2))
    snapshot = await live.ledger.states.load(SID)
    assert snapshot is not None
    assert snapshot.last_step == ("t1", 2)
    live.on_turn_event(done("t1", 3))
    snapshot = await live.ledger.states.load(SID)
    assert snapshot is not None
    assert (snapshot.last_step, snapshot.ended_turns) == (("t1", 3), ("t1",))
    # Once a turn ended here, an event of it arriving again is not numbered.
    live.on_turn_event(chunk("t1", 1))
    assert [what for _, what in delivered(live)] == ["t1-1", "tool_call", "all"]


async def test_a_repeated_step_is_numbered_once() -> None:
    live = await live_session()
    for event in (chunk("t1", 1), chunk("t1", 2), chunk("t1", 1), chunk("t1", 2)):
        live.on_turn_event(event)
    assert [what for _, what in delivered(live)] == ["t1-1", "t1-2"]


async def test_one_process_keeps_no_steps() -> None:
    live = await live_session(counts_steps=None)
    live.on_turn_event(chunk("t1", 1))
    snapshot = await live.ledger.states.load(SID)
    assert snapshot is not None
    assert snapshot.last_step == ("", 0)  # nobody else takes it over: nothing to record
