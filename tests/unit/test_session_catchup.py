"""Which turns a replica taking a `/v1/session` over answers from the archive
(`server/session_catchup.py`): those whose terminal message the ledger lacks, its own
replica's included, never one that ended before the ledger's latest ended turn."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from portico.domain.model import Session, Turn
from portico.domain.states import TurnState
from portico.protocols.session.channel import Numbered
from portico.server.session_catchup import catch_up
from portico.store.memory import MemoryStore

SESSION = "sess-catchup"


class Answers:
    """The session copy: records each terminal message it is handed."""

    id = SESSION
    ended = False

    def __init__(self) -> None:
        self.ended_turns: list[tuple[str, str]] = []

    def end_turn(self, frame: Numbered, turn_id: str) -> None:
        self.ended_turns.append((turn_id, type(frame).__name__))


async def archive(store: MemoryStore, turn_id: str, created_at: float, replica: str) -> None:
    """An ended turn of `replica` (`gone`: a dead replica's, interrupted by the sweep)."""
    await store.create_session(
        Session(id=SESSION, owner="u", agent="a", created_at=0, updated_at=0, last_activity_at=0)
    )
    state = TurnState.INTERRUPTED if replica == "gone" else TurnState.COMPLETED
    turn = Turn(id=turn_id, session_id=SESSION, state=state, created_at=created_at)
    await store.create_turn(msgspec.structs.replace(turn, replica=replica))


async def test_turns_the_ledger_did_not_end_are_answered_once_this_replicas_included() -> None:
    store = MemoryStore()
    await archive(store, "t-recorded", 10.0, "here")  # its done is in the ledger
    await archive(store, "t-own", 11.0, "here")  # ended here while the copy was dropped
    await archive(store, "t-dead", 12.0, "gone")  # its replica died: interrupted
    answers = Answers()
    await catch_up(answers, store, since=0.0, ended=("t-recorded",), grace=0.01)
    assert answers.ended_turns == [("t-own", "Done"), ("t-dead", "Error")]


async def test_turns_before_the_latest_ended_one_are_not_answered_again() -> None:
    """The ledger keeps only its latest ended turn ids: an older turn missing from them
    ended (and was answered) before the latest one started."""
    store = MemoryStore()
    await archive(store, "t-old", 1.0, "other")  # answered long ago, its id forgotten
    await archive(store, "t-latest", 2.0, "other")
    answers = Answers()
    await catch_up(answers, store, since=0.0, ended=("t-latest",), grace=0.01)
    assert answers.ended_turns == []


class Lock:
    """Another replica's turn lock on the session, freed after `held_for` looks."""

    def __init__(self, held_for: int) -> None:
        self.held_for = held_for
        self.looks = 0

    async def runs_elsewhere(self, session_ids: Iterable[str]) -> bool:
        assert tuple(session_ids) == (SESSION,)
        self.looks += 1
        return self.looks <= self.held_for


async def test_an_ended_turn_is_answered_only_once_its_replica_freed_the_session() -> None:
    """The archive has a turn's end a moment before the replica that ran it releases the
    session's lock: answered earlier, a client sending its next message at once on this
    replica would be refused `TURN_IN_PROGRESS` (issue 16's round-robin race)."""
    store = MemoryStore()
    await archive(store, "t-elsewhere", 5.0, "other")
    answers, lock = Answers(), Lock(held_for=2)
    await catch_up(
        answers, store, since=0.0, ended=(), grace=0.01, runs_elsewhere=lock.runs_elsewhere
    )
    assert answers.ended_turns == [("t-elsewhere", "Done")]
    assert lock.looks == 3  # held twice, answered at the first look that found it free
