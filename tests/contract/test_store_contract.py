"""The Store port's contract: every archive backend must pass this one suite.

A backend joins by adding one entry to `BACKENDS`: a factory that returns an
unopened store for a test's temporary directory. The PostgreSQL store gets a fresh
schema per store, dropped after the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncpg
import msgspec
import pytest

from portico.config import SqliteWriter
from portico.domain.memory import MemoryEntry, MemoryKey
from portico.domain.model import (
    ENTITY_KINDS,
    ContentPart,
    MediaContent,
    Message,
    MessageStatus,
    Session,
    ToolCallRecord,
    Turn,
    Update,
    UpdateLog,
)
from portico.domain.states import TERMINAL_TURN_STATES, ToolCallState, TurnState
from portico.domain.trace import TraceEvent
from portico.errors import DuplicateClientId, StoreError
from portico.store import postgres as postgres_backend
from portico.store import rows, sqlite_writes
from portico.store import sqlite as sqlite_backend
from portico.store.base import Store, collecting_updates
from portico.store.memory import MemoryStore
from portico.store.postgres import PostgresStore
from portico.store.sqlite import SqliteStore
from portico.store.sqlite_writes import MIGRATIONS
from support.postgres import create_schema, drop_schemas, require_postgres, schema_url

StoreFactory = Callable[[Path], Awaitable[Store]]
STARTING = "rep-starting"  # the replica that sweeps in the tests
LEASE = 30.0


async def memory_store(tmp_path: Path) -> Store:
    return MemoryStore()


async def sqlite_store(tmp_path: Path) -> Store:
    return SqliteStore(tmp_path / "archive.db", writer="thread")


async def sqlite_inline_store(tmp_path: Path) -> Store:
    return SqliteStore(tmp_path / "archive.db", writer="inline")


async def sqlite_process_store(tmp_path: Path) -> Store:
    return SqliteStore(tmp_path / "archive.db", writer="process")


# Schemas the running test created, dropped once it ends (see `drop_test_schemas`).
_schemas: list[str] = []


async def postgres_store(tmp_path: Path) -> Store:
    require_postgres()
    schema = await create_schema()
    _schemas.append(schema)
    return PostgresStore(schema_url(schema), pool_size=4)


@pytest.fixture(autouse=True)
async def drop_test_schemas() -> AsyncIterator[None]:
    yield
    schemas = _schemas[:]
    _schemas.clear()
    await drop_schemas(schemas)


BACKENDS = [
    pytest.param(memory_store, id="memory"),
    pytest.param(sqlite_store, id="sqlite"),
    pytest.param(sqlite_inline_store, id="sqlite-inline"),
    pytest.param(sqlite_process_store, id="sqlite-process"),
    pytest.param(postgres_store, id="postgres"),
]


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    factory: StoreFactory = request.param
    backend = await factory(tmp_path)
    await backend.open()
    try:
        yield backend
    finally:
        await backend.close()


# -- helpers ------------------------------------------------------------------------


def make_session(
    session_id: str = "s1", *, owner: str = "alice", created_at: float = 100.0
) -> Session:
    return Session(
        id=session_id,
        owner=owner,
        agent="default",
        created_at=created_at,
        updated_at=created_at,
        last_activity_at=created_at,
    )


def make_message(session_id: str = "s1", *, n: int = 0, content: str = "") -> Message:
    return Message(
        id=f"{session_id}-m{n}",
        session_id=session_id,
        role="user",
        content=content or f"message {n}",
        created_at=200.0 + n,
        updated_at=200.0 + n,
    )


def make_pending_reply(message_id: str, *, turn_id: str, session_id: str = "s1") -> Message:
    """A turn's reply as the engine creates it with the turn: empty and `pending`."""
    return Message(
        id=message_id,
        session_id=session_id,
        turn_id=turn_id,
        role="assistant",
        content="",
        content_type="markdown",
        status="pending",
        created_at=1.0,
        updated_at=1.0,
        turn_offset=2,
    )


def make_turn(
    turn_id: str, *, session_id: str = "s1", state: TurnState = TurnState.PENDING, at: float = 1.0
) -> Turn:
    return Turn(id=turn_id, session_id=session_id, state=state, created_at=at)


async def interrupt_at_start(store: Store, now: float) -> int:
    """What a starting server does: it holds the only lease, for turns it runs none of."""
    return await store.interrupt_orphaned_turns(
        now, replica_id=STARTING, lease=LEASE, include_own=True
    )


async def append_many(store: Store, session_id: str, count: int) -> list[Message]:
    return [await store.append_message(make_message(session_id, n=n)) for n in range(count)]


def offsets(messages: list[Message]) -> list[int]:
    return [m.global_offset for m in messages]


# -- sessions -----------------------------------------------------------------------


async def test_writes_of_many_concurrent_callers_keep_their_order_per_session(
    store: Store,
) -> None:
    # Callers on several sessions, each queueing bursts of writes without waiting
    # between them, so batches mix sessions and callers: a session numbers its messages
    # without gaps, and each caller's messages in the order it wrote them.
    sessions, callers, rounds, burst = 4, 5, 3, 3
    for s in range(sessions):
        await store.create_session(make_session(f"s{s}"))

    async def caller(session_id: str, c: int) -> list[Message]:
        written: list[Message] = []
        for r in range(rounds):
            queued = [make_message(session_id, n=c * 100 + r * 10 + k) for k in range(burst)]
            written += await asyncio.gather(*(store.append_message(m) for m in queued))
        return written

    written = await asyncio.gather(
        *(caller(f"s{s}", c) for s in range(sessions) for c in range(callers))
    )
    for messages in written:
        assert offsets(messages) == sorted(offsets(messages))
    for s in range(sessions):
        stored = await store.list_messages(f"s{s}")
        assert offsets(stored) == list(range(1, callers * rounds * burst + 1))
        mine = [m for messages in written for m in messages if m.session_id == f"s{s}"]
        assert sorted(mine, key=lambda m: m.global_offset) == stored
    updates = await all_updates(store, "alice")
    assert [u.offset for u in updates] == list(range(1, len(updates) + 1))


async def test_an_open_store_is_ready(store: Store) -> None:
    health = await store.health(5.0)
    assert health.ready, health.reason


async def test_a_closed_store_is_not_ready(store: Store) -> None:
    """A networked or file archive that is not open cannot serve; memory always can."""
    await store.close()
    health = await store.health(5.0)
    assert health.ready is isinstance(store, MemoryStore)


async def test_create_session_returns_the_stored_session(store: Store) -> None:
    session = msgspec.structs.replace(
        make_session(),
        title="Trip planning",
        status="active",
        client_session_id="client-1",
        root_session_id="s1",
        declare={"sandboxes": {"code/main": {"image": "python"}}, "n": [1, 2.5, True, None]},
    )
    assert await store.create_session(session) == session
    assert await store.get_session("s1") == session


async def test_a_sessions_binding_value_is_kept_through_every_write(store: Store) -> None:
    """The session-binding claim's value (auth jwt) is stored with the session's owner."""
    bound = await store.create_session(msgspec.structs.replace(make_session(), binding="sid-7"))
    assert bound.binding == "sid-7"
    await store.touch_session("s1", 50.0)
    stored = await store.get_session("s1")
    assert stored is not None
    assert stored.binding == "sid-7"
    renamed = await store.update_session(msgspec.structs.replace(stored, title="renamed"))
    assert renamed.binding == "sid-7"
    assert [s.binding for s in await store.list_sessions("alice", limit=10)] == ["sid-7"]
    unbound = await store.create_session(make_session("s2"))
    assert unbound.binding == ""


async def test_create_session_is_create_if_absent(store: Store) -> None:
    first = await store.create_session(make_session(owner="alice", created_at=1.0))
    second = await store.create_session(make_session(owner="mallory", created_at=2.0))
    assert second == first
    stored = await store.get_session("s1")
    assert stored is not None
    assert (stored.owner, stored.created_at) == ("alice", 1.0)
    assert await store.list_sessions("mallory", limit=10) == []


async def test_get_missing_session_is_none(store: Store) -> None:
    await store.create_session(make_session("s1"))
    assert await store.get_session("nope") is None


async def test_list_sessions_per_owner_newest_first_with_limit(store: Store) -> None:
    for session_id, created_at in (("a1", 1.0), ("a3", 3.0), ("a2", 2.0)):
        await store.create_session(make_session(session_id, owner="alice", created_at=created_at))
    await store.create_session(make_session("b1", owner="bob", created_at=5.0))

    def ids(sessions: list[Session]) -> list[str]:
        return [s.id for s in sessions]

    assert ids(await store.list_sessions("alice", limit=10)) == ["a3", "a2", "a1"]
    assert ids(await store.list_sessions("alice", limit=2)) == ["a3", "a2"]
    assert ids(await store.list_sessions("bob", limit=10)) == ["b1"]
    assert await store.list_sessions("carol", limit=10) == []


async def test_touch_session_updates_activity_and_updated_at(store: Store) -> None:
    original = await store.create_session(make_session(created_at=10.0))
    await store.touch_session("s1", 42.5)
    touched = await store.get_session("s1")
    assert touched == msgspec.structs.replace(original, last_activity_at=42.5, updated_at=42.5)


async def test_touch_missing_session_creates_nothing(store: Store) -> None:
    await store.touch_session("ghost", 1.0)
    assert await store.get_session("ghost") is None


# -- messages -----------------------------------------------------------------------


async def test_append_assigns_offsets_without_gaps(store: Store) -> None:
    await store.create_session(make_session())
    stored = await append_many(store, "s1", 3)
    assert offsets(stored) == [1, 2, 3]
    assert await store.list_messages("s1") == stored


async def test_append_to_a_missing_session_is_a_store_error(store: Store) -> None:
    with pytest.raises(StoreError):
        await store.append_message(make_message("no-such-session"))
    assert await store.list_messages("no-such-session") == []


async def test_offsets_are_per_session(store: Store) -> None:
    for session_id in ("s1", "s2"):
        await store.create_session(make_session(session_id))
    a1 = await store.append_message(make_message("s1", n=1))
    b1 = await store.append_message(make_message("s2", n=1))
    a2 = await store.append_message(make_message("s1", n=2))
    b2 = await store.append_message(make_message("s2", n=2))
    assert offsets([a1, a2, b1, b2]) == [1, 2, 1, 2]
    assert [m.id for m in await store.list_messages("s2")] == [b1.id, b2.id]


async def test_concurrent_appends_get_offsets_one_to_fifty(store: Store) -> None:
    await store.create_session(make_session())
    stored = await asyncio.gather(
        *(store.append_message(make_message("s1", n=n)) for n in range(50))
    )
    assert sorted(offsets(stored)) == list(range(1, 51))
    listed = await store.list_messages("s1")
    assert offsets(listed) == list(range(1, 51))
    assert {m.id: m.global_offset for m in listed} == {m.id: m.global_offset for m in stored}


async def test_concurrent_appends_to_two_sessions_stay_independent(store: Store) -> None:
    for session_id in ("s1", "s2"):
        await store.create_session(make_session(session_id))
    await asyncio.gather(
        *(store.append_message(make_message(f"s{1 + n % 2}", n=n)) for n in range(40))
    )
    assert offsets(await store.list_messages("s1")) == list(range(1, 21))
    assert offsets(await store.list_messages("s2")) == list(range(1, 21))


async def test_writes_started_one_after_another_apply_in_that_order(store: Store) -> None:
    # The engine starts a reply's insert and later its update without awaiting the
    # first (turns.py `_open_reply`): the update must find the message. Tasks start
    # in the order they were made.
    await store.create_session(make_session())
    reply = make_pending_reply("r1", turn_id="t1")
    done = msgspec.structs.replace(reply, content="all", status="completed", updated_at=300.0)
    changed = msgspec.structs.replace(make_message(n=2), content="edited", updated_at=301.0)
    writes = [
        store.begin_turn(make_turn("t1"), make_message(n=1), reply=reply),
        store.append_message(make_message(n=2)),
        store.end_turn(make_turn("t1", state=TurnState.COMPLETED), done),
        store.update_message(changed),
    ]
    *_, edited = await asyncio.gather(*(asyncio.ensure_future(write) for write in writes))
    assert isinstance(edited, Message)
    assert edited.content == "edited"
    stored = await store.list_messages("s1")
    assert [(m.id, m.global_offset, m.content) for m in stored] == [
        ("s1-m1", 1, "message 1"),
        ("r1", 2, "all"),
        ("s1-m2", 3, "edited"),
    ]
    turn = await store.get_turn("t1")
    assert turn is not None
    assert turn.state is TurnState.COMPLETED


async def test_a_write_whose_caller_is_cancelled_still_commits_and_publishes(store: Store) -> None:
    await store.create_session(make_session())
    received: list[Update] = []
    store.set_update_listener(received.append)
    cancelled = asyncio.ensure_future(store.append_message(make_message(n=1)))
    await asyncio.sleep(0)  # queued
    cancelled.cancel()
    await store.append_message(make_message(n=2))  # queued behind it
    assert offsets(await store.list_messages("s1")) == [1, 2]
    assert [items_of(update) for update in received] == [
        [("message", "created", "s1-m1")],
        [("message", "created", "s1-m2")],
    ]


async def test_list_messages_after_offset_and_limit(store: Store) -> None:
    await store.create_session(make_session())
    await append_many(store, "s1", 5)
    assert offsets(await store.list_messages("s1", after_offset=2)) == [3, 4, 5]
    assert offsets(await store.list_messages("s1", after_offset=2, limit=2)) == [3, 4]
    assert offsets(await store.list_messages("s1", limit=1)) == [1]
    assert await store.list_messages("s1", limit=0) == []
    assert await store.list_messages("s1", after_offset=5) == []
    assert await store.list_messages("unknown") == []


async def test_parts_and_metadata_round_trip_exactly(store: Store) -> None:
    await store.create_session(make_session())
    image = MediaContent(
        mime_type="image/png",
        data="aGVsbG8=",
        filename="cat.png",
        size_bytes=5,
        width=640,
        height=480,
        detail="high",
    )
    audio = MediaContent(
        mime_type="audio/pcm",
        storage_ref="media/abc",
        duration_ms=1500,
        sample_rate=16000,
        channels=1,
    )
    message = msgspec.structs.replace(
        make_message(),
        role="assistant",
        content="see attached",
        content_type="markdown",
        parts=(
            ContentPart(type="text", text="here é ✓"),
            ContentPart(type="image", media=image),
            ContentPart(type="audio", media=audio),
            ContentPart(type="file", media=MediaContent(mime_type="text/csv", url="https://x/y")),
        ),
        metadata={"mock_scenario": "image", "omnia.trace": "t-1", "empty": ""},
        status="streaming",
        turn_id="turn-1",
        client_id="c-9",
        turn_offset=2,
        parent_message_id="s1-m0",
    )
    stored = await store.append_message(message)
    assert stored == msgspec.structs.replace(message, global_offset=1)
    assert await store.list_messages("s1") == [stored]


# -- turns --------------------------------------------------------------------------


async def test_turns_create_save_get(store: Store) -> None:
    await store.create_session(make_session())
    turn = make_turn("t1")
    await store.create_turn(turn)
    assert await store.get_turn("t1") == turn

    finished = msgspec.structs.replace(
        turn,
        state=TurnState.FAILED,
        started_at=2.0,
        ended_at=3.0,
        error_code="PROVIDER_UNAVAILABLE",
        error_message="model endpoint unavailable",
        merged_into="t0",
    )
    await store.save_turn(finished)
    assert await store.get_turn("t1") == finished
    assert await store.list_turns("s1") == [finished]


async def test_get_missing_turn_is_none(store: Store) -> None:
    assert await store.get_turn("nope") is None


async def test_list_turns_oldest_first_per_session(store: Store) -> None:
    for session_id in ("s1", "s2"):
        await store.create_session(make_session(session_id))
    await store.create_turn(make_turn("t2", at=2.0))
    await store.create_turn(make_turn("t1", at=1.0))
    await store.create_turn(make_turn("other", session_id="s2", at=0.5))
    await store.create_turn(make_turn("t3", at=3.0))
    assert [t.id for t in await store.list_turns("s1")] == ["t1", "t2", "t3"]
    assert [t.id for t in await store.list_turns("s2")] == ["other"]
    assert await store.list_turns("s3") == []


async def test_turns_created_at_the_same_time_keep_creation_order(store: Store) -> None:
    # A coarse clock gives equal timestamps; saving a turn must not reorder the list.
    await store.create_session(make_session())
    for turn_id in ("ta", "tb", "tc"):
        await store.create_turn(make_turn(turn_id, at=7.0))
    await store.save_turn(make_turn("ta", state=TurnState.RUNNING, at=7.0))
    assert [t.id for t in await store.list_turns("s1")] == ["ta", "tb", "tc"]


async def test_a_starting_server_interrupts_every_unfinished_turn(store: Store) -> None:
    for session_id in ("s1", "s2"):
        await store.create_session(make_session(session_id))
    terminal = [
        msgspec.structs.replace(make_turn(f"t-{state}", state=state), ended_at=5.0)
        for state in (
            TurnState.COMPLETED,
            TurnState.FAILED,
            TurnState.CANCELLED,
            TurnState.INTERRUPTED,
            TurnState.MERGED,
        )
    ]
    pending = make_turn("pending", state=TurnState.PENDING)
    running = msgspec.structs.replace(
        make_turn("running", session_id="s2", state=TurnState.RUNNING), started_at=2.0
    )
    for turn in (*terminal, pending, running):
        await store.create_turn(turn)

    assert await interrupt_at_start(store, 50.0) == 2

    for turn in terminal:
        assert await store.get_turn(turn.id) == turn
    for turn in (pending, running):
        expected = msgspec.structs.replace(turn, state=TurnState.INTERRUPTED, ended_at=50.0)
        assert await store.get_turn(turn.id) == expected
    assert await interrupt_at_start(store, 60.0) == 0


# -- replicas: leases and orphaned turns -------------------------------------------


def replica_turn(turn_id: str, replica: str, *, session_id: str = "s1") -> Turn:
    return msgspec.structs.replace(
        make_turn(turn_id, session_id=session_id, state=TurnState.RUNNING), replica=replica
    )


async def begin_replica_turn(store: Store, turn_id: str, replica: str, n: int) -> Message:
    """A running turn of `replica` with its pending reply; returns the reply."""
    reply = make_pending_reply(f"r-{turn_id}", turn_id=turn_id)
    await store.begin_turn(replica_turn(turn_id, replica), make_message(n=n), reply=reply)
    stored = await store.get_message(reply.id)
    assert stored is not None
    return stored


async def sweep(store: Store, now: float, *, include_own: bool = False) -> int:
    return await store.interrupt_orphaned_turns(
        now, replica_id=STARTING, lease=LEASE, include_own=include_own
    )


async def test_a_turn_of_a_replica_with_a_live_lease_is_left_alone(store: Store) -> None:
    await store.create_session(make_session())
    reply = await begin_replica_turn(store, "t1", "rep-b", 1)
    await store.renew_replica("rep-b", 100.0)
    with collecting_updates() as collected:
        assert await sweep(store, 100.0 + LEASE) == 0
        assert await interrupt_at_start(store, 100.0 + LEASE) == 0
    assert collected == []
    assert await store.get_turn("t1") == replica_turn("t1", "rep-b")
    stored = await store.get_message(reply.id)
    assert stored is not None
    assert stored.status == "pending"


async def test_a_turn_of_a_replica_whose_lease_expired_is_interrupted(store: Store) -> None:
    await store.create_session(make_session("s1", owner="alice"))
    await store.create_session(make_session("s2", owner="bob"))
    alive = await begin_replica_turn(store, "alive", "rep-b", 1)
    dead = await begin_replica_turn(store, "dead", "rep-c", 2)
    await store.create_turn(replica_turn("dead2", "rep-c", session_id="s2"))
    await store.renew_replica("rep-b", 150.0)
    await store.renew_replica("rep-c", 100.0)
    before = {owner: (await store.update_log(owner)).last_offset for owner in ("alice", "bob")}

    with collecting_updates() as collected:
        assert await sweep(store, 100.0 + LEASE + 1) == 2

    interrupted = {
        turn_id: msgspec.structs.replace(
            replica_turn(turn_id, "rep-c", session_id=session_id),
            state=TurnState.INTERRUPTED,
            ended_at=100.0 + LEASE + 1,
        )
        for turn_id, session_id in (("dead", "s1"), ("dead2", "s2"))
    }
    failed = msgspec.structs.replace(dead, status="failed", updated_at=100.0 + LEASE + 1)
    assert [(u.owner, u.offset, items_of(u)) for u in collected] == [
        (
            "alice",
            before["alice"] + 1,
            [("turn", "updated", "dead"), ("message", "updated", failed.id)],
        ),
        ("bob", before["bob"] + 1, [("turn", "updated", "dead2")]),
    ]
    assert collected[0].data_list == (interrupted["dead"], failed)
    assert collected[1].data_list == (interrupted["dead2"],)
    for turn in interrupted.values():
        assert await store.get_turn(turn.id) == turn
    assert await store.get_message(failed.id) == failed
    assert await store.get_turn("alive") == replica_turn("alive", "rep-b")
    assert (await store.get_message(alive.id)) == alive
    with collecting_updates() as collected:
        assert await sweep(store, 200.0) == 1  # now rep-b's lease has expired too
    assert [items_of(u) for u in collected] == [
        [("turn", "updated", "alive"), ("message", "updated", alive.id)]
    ]


async def test_a_turn_of_a_replica_without_a_lease_is_interrupted(store: Store) -> None:
    await store.create_session(make_session())
    await store.create_turn(replica_turn("unnamed", ""))  # from before replicas
    await store.create_turn(replica_turn("unknown", "rep-never-renewed"))
    assert await sweep(store, 1.0) == 2
    for turn_id in ("unnamed", "unknown"):
        turn = await store.get_turn(turn_id)
        assert turn is not None
        assert (turn.state, turn.ended_at) == (TurnState.INTERRUPTED, 1.0)


async def test_own_turns_are_interrupted_at_start_only(store: Store) -> None:
    await store.create_session(make_session())
    reply = await begin_replica_turn(store, "mine", STARTING, 1)
    await store.renew_replica(STARTING, 100.0)
    # While serving, this replica runs its own turns: the sweep leaves them alone...
    assert await sweep(store, 1000.0) == 0
    assert await store.get_turn("mine") == replica_turn("mine", STARTING)
    # ...but at start-up (a stable replica id), they are what its earlier run left.
    assert await sweep(store, 101.0, include_own=True) == 1
    turn = await store.get_turn("mine")
    assert turn is not None
    assert (turn.state, turn.ended_at) == (TurnState.INTERRUPTED, 101.0)
    failed = await store.get_message(reply.id)
    assert failed is not None
    assert (failed.status, failed.updated_at) == ("failed", 101.0)


async def test_renewing_a_lease_moves_last_seen(store: Store) -> None:
    await store.create_session(make_session())
    await store.create_turn(replica_turn("t1", "rep-b"))
    await store.renew_replica("rep-b", 100.0)
    await store.renew_replica("rep-b", 200.0)
    # Expired when counted from the first renewal, live from the second.
    assert await sweep(store, 200.0 + LEASE) == 0
    assert await sweep(store, 200.0 + LEASE + 1) == 1


async def test_an_open_reply_without_an_unfinished_turn_fails(store: Store) -> None:
    # Nobody will write it again: its turn ended, or it never had one.
    await store.create_session(make_session())
    await store.create_turn(make_turn("ended", state=TurnState.COMPLETED))
    await store.create_turn(replica_turn("live", "rep-b"))
    await store.renew_replica("rep-b", 100.0)
    left = msgspec.structs.replace(make_reply("s1", 1, "streaming"), turn_id="ended")
    live = msgspec.structs.replace(make_reply("s1", 2, "streaming"), turn_id="live")
    left, live = await store.append_message(left), await store.append_message(live)
    assert await sweep(store, 110.0) == 0
    assert await store.get_message(left.id) == msgspec.structs.replace(
        left, status="failed", updated_at=110.0
    )
    assert await store.get_message(live.id) == live


def test_the_unfinished_turn_predicate_names_every_terminal_state() -> None:
    # The SQL backends' partial index repeats it: it must not drift from the states.
    terminal = ", ".join(f"'{state.value}'" for state in sorted(TERMINAL_TURN_STATES))
    assert f"state NOT IN ({terminal})" == rows.UNFINISHED_TURN


# -- SQLite only --------------------------------------------------------------------


# SQLite-only tests of what every writer must keep alike.
EVERY_WRITER = pytest.mark.parametrize("writer", ["thread", "inline", "process"])
# The writers of this process, which can run a write a test defines.
IN_PROCESS_WRITERS = pytest.mark.parametrize("writer", ["thread", "inline"])


async def open_sqlite(
    path: Path, writer: SqliteWriter = "thread", *, respawn_delay: float = 3600.0
) -> SqliteStore:
    """An open archive; a writer process that dies stays dead for the test's length
    unless the test asks for a shorter `respawn_delay`."""
    store = SqliteStore(path, writer=writer, respawn_delay=respawn_delay)
    await store.open()
    return store


@contextlib.asynccontextmanager
async def opened_sqlite(path: Path, writer: SqliteWriter) -> AsyncIterator[SqliteStore]:
    store = await open_sqlite(path, writer)
    try:
        yield store
    finally:
        await store.close()


def user_version(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        version: int = conn.execute("PRAGMA user_version").fetchone()[0]
    return version


@EVERY_WRITER
async def test_sqlite_data_survives_close_and_reopen(tmp_path: Path, writer: SqliteWriter) -> None:
    path = tmp_path / "archive.db"
    first = await open_sqlite(path, writer)
    session = await first.create_session(make_session())
    messages = await append_many(first, "s1", 3)
    turn = make_turn("t1", state=TurnState.COMPLETED)
    await first.create_turn(turn)
    await first.close()

    second = await open_sqlite(path, writer)
    try:
        assert await second.get_session("s1") == session
        assert await second.list_messages("s1") == messages
        assert await second.get_turn("t1") == turn
        assert offsets([await second.append_message(make_message(n=9))]) == [4]
    finally:
        await second.close()


async def test_sqlite_forgets_leases_on_open(tmp_path: Path) -> None:
    # The archive lock keeps every other process out: whatever it left unfinished is a
    # stopped server's, whichever replica id the new one has.
    path = tmp_path / "archive.db"
    first = await open_sqlite(path)
    await first.create_session(make_session())
    await first.create_turn(replica_turn("t1", "rep-killed"))
    await first.renew_replica("rep-killed", time.time())
    await first.close()

    second = await open_sqlite(path)
    try:
        assert await interrupt_at_start(second, time.time()) == 1
    finally:
        await second.close()


async def test_sqlite_schema_version_and_no_remigration(tmp_path: Path) -> None:
    path = tmp_path / "archive.db"
    store = await open_sqlite(path)
    await store.create_session(make_session())
    await store.close()
    assert user_version(path) == len(MIGRATIONS)

    # Re-running a migration would fail on CREATE TABLE, or wipe the data.
    reopened = await open_sqlite(path)
    try:
        assert await reopened.get_session("s1") is not None
    finally:
        await reopened.close()
    assert user_version(path) == len(MIGRATIONS)


@EVERY_WRITER
async def test_sqlite_failing_write_in_a_batch_fails_alone(
    tmp_path: Path, writer: SqliteWriter
) -> None:
    store = await open_sqlite(tmp_path / "archive.db", writer)
    try:
        await store.create_session(make_session())
        # Queued in one loop iteration, so they share one group-commit transaction.
        results = await asyncio.gather(
            *(store.append_message(make_message(n=n)) for n in range(3)),
            store.append_message(make_message("no-such-session", n=99)),
            *(store.append_message(make_message(n=n)) for n in range(3, 6)),
            store.create_session(make_session("s2")),
            return_exceptions=True,
        )
        failure = results[3]
        assert isinstance(failure, StoreError)
        assert isinstance(failure.__cause__, sqlite3.IntegrityError)
        good = [r for i, r in enumerate(results) if i != 3]
        assert not any(isinstance(r, BaseException) for r in good)
        assert offsets(await store.list_messages("s1")) == [1, 2, 3, 4, 5, 6]
        assert await store.list_messages("no-such-session") == []
        assert await store.get_session("s2") is not None
        # The store stays usable after the failure.
        assert (await store.append_message(make_message(n=7))).global_offset == 7
    finally:
        await store.close()


@EVERY_WRITER
async def test_sqlite_write_failing_outside_sqlite_fails_alone(
    tmp_path: Path, writer: SqliteWriter
) -> None:
    store = await open_sqlite(tmp_path / "archive.db", writer)
    try:
        unencodable = msgspec.structs.replace(make_session("bad"), declare={"x": object()})
        results = await asyncio.wait_for(
            asyncio.gather(
                store.create_session(unencodable),
                store.create_session(make_session("good")),
                return_exceptions=True,
            ),
            timeout=2.0,
        )
        assert isinstance(results[0], StoreError)
        assert results[1] == make_session("good")
        assert await store.get_session("bad") is None
        # The batch's transaction was committed, not left open.
        assert await store.create_session(make_session("later")) == make_session("later")
    finally:
        await store.close()


async def test_sqlite_writer_process_that_dies_fails_writes_and_the_archive_is_down(
    tmp_path: Path,
) -> None:
    store = await open_sqlite(tmp_path / "archive.db", "process")
    try:
        await store.create_session(make_session())
        pid = store.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        # Woken by the pipe closing, not by a deadline: the guard only keeps a hang short.
        async with asyncio.timeout(10):
            with pytest.raises(StoreError, match="writer process exited"):
                await store.append_message(make_message(n=1))
            with pytest.raises(StoreError, match="writer process exited"):
                await store.append_message(make_message(n=2))
        health = await store.health(1.0)
        assert not health.ready
        assert "writer process exited" in health.reason
        # Reads go on: they never needed the writer.
        assert await store.get_session("s1") == make_session()
        assert await store.list_messages("s1") == []
    finally:
        await store.close()


async def test_sqlite_writer_process_that_dies_is_started_again(tmp_path: Path) -> None:
    store = await open_sqlite(tmp_path / "archive.db", "process", respawn_delay=0.05)
    try:
        await store.create_session(make_session())
        first = store.writer_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        async with asyncio.timeout(30):  # a deadline: the new writer is polled for
            while store.writer_pid == first or not (await store.health(1.0)).ready:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        second = store.writer_pid
        assert second is not None
        # /readyz names the process that writes now.
        assert (await store.health(1.0)).reason == f"writer process {second}"
        # The new writer numbers on from what the archive holds.
        one = await store.append_message(make_message(n=1))
        two = await store.append_message(make_message(n=2))
        assert (one.global_offset, two.global_offset) == (1, 2)
        assert await store.get_session("s1") is not None
    finally:
        await store.close()
    with pytest.raises(ProcessLookupError):  # the new one exits with its store too
        os.kill(second, 0)


def test_sqlite_auto_writer_is_a_process_on_two_cpus_and_the_thread_on_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sqlite_backend, "usable_cpus", lambda: 2)
    assert sqlite_backend.writer_for("auto") == "process"
    monkeypatch.setattr(sqlite_backend, "usable_cpus", lambda: 1)
    assert sqlite_backend.writer_for("auto") == "thread"
    assert sqlite_backend.writer_for("inline") == "inline"


async def test_sqlite_writer_process_exits_when_its_store_closes(tmp_path: Path) -> None:
    store = await open_sqlite(tmp_path / "archive.db", "process")
    pid = store.writer_pid
    assert pid is not None
    await store.close()
    with pytest.raises(ProcessLookupError):  # exited, and reaped by the store
        os.kill(pid, 0)


async def test_sqlite_unopened_store_raises_store_error(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "archive.db")
    with pytest.raises(StoreError):
        await store.get_session("s1")
    with pytest.raises(StoreError):
        await store.create_session(make_session())


# -- tool calls ---------------------------------------------------------------------


def make_tool_call(call_id: str, session_id: str = "s1", *, at: float = 1.0) -> ToolCallRecord:
    return ToolCallRecord(
        id=call_id,
        session_id=session_id,
        turn_id="t1",
        name="get_location",
        arguments={"query": "current", "n": [1, 2]},
        state=ToolCallState.PENDING,
        created_at=at,
        updated_at=at,
        consent_message="Allow?",
        categories=("location",),
    )


async def test_tool_calls_round_trip_and_update_in_place(store: Store) -> None:
    await store.create_session(make_session())
    call = make_tool_call("c1")
    await store.save_tool_call(call)
    assert await store.get_tool_call("c1") == call
    done = msgspec.structs.replace(
        call, state=ToolCallState.COMPLETED, result={"city": "Oslo"}, updated_at=2.0
    )
    await store.save_tool_call(done)
    assert await store.get_tool_call("c1") == done
    assert done.outcome == "completed"
    assert await store.get_tool_call("missing") is None


async def test_list_tool_calls_per_session_oldest_first(store: Store) -> None:
    for session_id in ("s1", "s2"):
        await store.create_session(make_session(session_id))
    await store.save_tool_call(make_tool_call("c1", at=1.0))
    await store.save_tool_call(make_tool_call("other", "s2", at=1.5))
    await store.save_tool_call(make_tool_call("c2", at=2.0))
    await store.save_tool_call(
        msgspec.structs.replace(make_tool_call("c1", at=1.0), state=ToolCallState.TIMEOUT)
    )
    calls = await store.list_tool_calls("s1")
    assert [(c.id, c.outcome) for c in calls] == [("c1", "denied"), ("c2", None)]


# -- begin_turn ---------------------------------------------------------------------


async def test_begin_turn_creates_the_turn_appends_and_touches(store: Store) -> None:
    await store.create_session(make_session())
    await append_many(store, "s1", 2)
    turn = make_turn("t9")
    message = msgspec.structs.replace(make_message("s1", n=9), created_at=500.0, updated_at=500.0)
    stored = await store.begin_turn(turn, message)
    assert stored.global_offset == 3
    assert await store.get_turn("t9") == turn
    session = await store.get_session("s1")
    assert session is not None
    assert session.last_activity_at == 500.0
    assert (await store.list_messages("s1"))[-1] == stored


async def test_begin_turn_for_a_missing_session_writes_nothing(store: Store) -> None:
    with pytest.raises(StoreError):
        await store.begin_turn(make_turn("t1", session_id="missing"), make_message("missing"))
    assert await store.get_turn("t1") is None
    assert await store.list_messages("missing") == []


# -- the update log: what each write logs -------------------------------------------

Item = tuple[str, str, str]


def items_of(update: Update) -> list[Item]:
    return [(item.entity, item.action, item.entity_id) for item in update.items]


def assert_well_formed(update: Update) -> None:
    """One entity per item, of the item's kind and id."""
    assert len(update.data_list) == len(update.items)
    for item, entity in zip(update.items, update.data_list, strict=True):
        assert (ENTITY_KINDS[type(entity)], entity.id) == (item.entity, item.entity_id)


async def only_update(store: Store, write: Awaitable[object]) -> Update:
    """The one update `write` logged, checked against what the log replays."""
    with collecting_updates() as collected:
        await write
    assert len(collected) == 1
    (update,) = collected
    assert_well_formed(update)
    replayed = await store.list_updates(update.owner, after_offset=update.offset - 1, limit=10)
    assert replayed == [update]
    return update


async def no_update(store: Store, write: Awaitable[object], *, owner: str = "alice") -> None:
    """`write` fails and logs nothing: no update collected, no offset taken."""
    before = await store.update_log(owner)
    with collecting_updates() as collected, pytest.raises(StoreError):
        await write
    assert collected == []
    assert await store.update_log(owner) == before


async def all_updates(store: Store, owner: str) -> list[Update]:
    return await store.list_updates(owner, after_offset=0, limit=10_000)


async def test_create_session_logs_session_created_once(store: Store) -> None:
    session = make_session()
    update = await only_update(store, store.create_session(session))
    assert (update.owner, update.offset) == ("alice", 1)
    assert items_of(update) == [("session", "created", "s1")]
    assert update.data_list == (session,)
    assert update.id
    assert update.created_at == pytest.approx(time.time(), abs=60)

    # An existing id changes nothing, so it logs nothing, for either owner.
    with collecting_updates() as collected:
        await store.create_session(make_session(owner="mallory"))
    assert collected == []
    assert (await store.update_log("alice")).last_offset == 1
    assert (await store.update_log("mallory")).last_offset == 0


async def test_touch_session_logs_session_updated(store: Store) -> None:
    await store.create_session(make_session())
    update = await only_update(store, store.touch_session("s1", 42.5))
    assert items_of(update) == [("session", "updated", "s1")]
    assert update.data_list == (await store.get_session("s1"),)
    assert update.offset == 2

    with collecting_updates() as collected:
        await store.touch_session("ghost", 1.0)
    assert collected == []


async def test_update_session_replaces_and_logs(store: Store) -> None:
    await store.create_session(make_session())
    changed = msgspec.structs.replace(
        make_session(), title="Renamed", status="closed", closed_at=7.0, updated_at=7.0
    )
    update = await only_update(store, store.update_session(changed))
    assert items_of(update) == [("session", "updated", "s1")]
    assert update.data_list == (changed,)
    assert await store.get_session("s1") == changed
    assert await store.update_session(changed) == changed


async def test_update_missing_session_is_a_store_error(store: Store) -> None:
    await store.create_session(make_session())
    await no_update(store, store.update_session(make_session("ghost")))
    assert await store.get_session("ghost") is None


async def test_append_message_logs_message_created(store: Store) -> None:
    await store.create_session(make_session())
    update = await only_update(store, store.append_message(make_message(n=1)))
    assert items_of(update) == [("message", "created", "s1-m1")]
    assert update.data_list == tuple(await store.list_messages("s1"))
    (message,) = update.data_list
    assert isinstance(message, Message)
    assert message.global_offset == 1


async def test_begin_turn_logs_message_turn_and_session_in_one_update(store: Store) -> None:
    await store.create_session(make_session())
    turn = make_turn("t1")
    message = msgspec.structs.replace(make_message(n=1), turn_id="t1", created_at=500.0)
    update = await only_update(store, store.begin_turn(turn, message))
    assert items_of(update) == [
        ("message", "created", "s1-m1"),
        ("turn", "created", "t1"),
        ("session", "updated", "s1"),
    ]
    session = await store.get_session("s1")
    assert session is not None
    assert session.last_activity_at == 500.0
    assert update.data_list == (*(await store.list_messages("s1")), turn, session)


async def test_save_turn_logs_created_then_updated(store: Store) -> None:
    await store.create_session(make_session())
    turn = make_turn("t1")
    created = await only_update(store, store.create_turn(turn))
    assert items_of(created) == [("turn", "created", "t1")]
    assert created.data_list == (turn,)

    running = msgspec.structs.replace(turn, state=TurnState.RUNNING, started_at=2.0)
    updated = await only_update(store, store.save_turn(running))
    assert items_of(updated) == [("turn", "updated", "t1")]
    assert updated.data_list == (running,)
    assert (created.offset, updated.offset) == (2, 3)


async def test_save_tool_call_logs_rtc_created_then_updated(store: Store) -> None:
    await store.create_session(make_session())
    call = make_tool_call("c1")
    created = await only_update(store, store.save_tool_call(call))
    assert items_of(created) == [("rtc", "created", "c1")]
    assert created.data_list == (call,)

    done = msgspec.structs.replace(
        call, state=ToolCallState.COMPLETED, result={"city": "Oslo"}, updated_at=2.0
    )
    updated = await only_update(store, store.save_tool_call(done))
    assert items_of(updated) == [("rtc", "updated", "c1")]
    assert updated.data_list == (done,)


def make_reply(session_id: str, n: int, status: MessageStatus) -> Message:
    return msgspec.structs.replace(
        make_message(session_id, n=n), role="assistant", content=f"partial {n}", status=status
    )


async def test_interrupt_logs_one_update_per_owner(store: Store) -> None:
    await store.create_session(make_session("s1", owner="alice"))
    await store.create_session(make_session("s2", owner="alice"))
    await store.create_session(make_session("s3", owner="bob"))
    await store.create_turn(make_turn("done", state=TurnState.COMPLETED, at=1.0))
    await store.create_turn(make_turn("a1", at=2.0))
    await store.create_turn(make_turn("a2", session_id="s2", state=TurnState.RUNNING, at=3.0))
    await store.create_turn(make_turn("b1", session_id="s3", at=4.0))
    cut = await store.append_message(make_reply("s2", 1, "streaming"))
    finished = await store.append_message(make_reply("s1", 2, "completed"))
    before = {owner: (await store.update_log(owner)).last_offset for owner in ("alice", "bob")}

    with collecting_updates() as collected:
        assert await interrupt_at_start(store, 50.0) == 3

    by_owner = {update.owner: update for update in collected}
    assert len(collected) == len(by_owner) == 2
    expected = {
        "alice": [
            ("message", "updated", cut.id),
            ("turn", "updated", "a1"),
            ("turn", "updated", "a2"),
        ],
        "bob": [("turn", "updated", "b1")],
    }
    for owner, owner_items in expected.items():
        update = by_owner[owner]
        assert_well_formed(update)
        assert update.offset == before[owner] + 1
        assert sorted(items_of(update)) == owner_items
        assert (await all_updates(store, owner))[-1] == update
        for entity in update.data_list:
            if isinstance(entity, Turn):
                assert entity.state is TurnState.INTERRUPTED
                assert await store.get_turn(entity.id) == entity
    # The reply cut short is failed and keeps its content; a finished one is untouched.
    failed = msgspec.structs.replace(cut, status="failed", updated_at=50.0)
    assert await store.get_message(cut.id) == failed
    assert failed in by_owner["alice"].data_list
    assert await store.get_message(finished.id) == finished

    with collecting_updates() as collected:
        assert await interrupt_at_start(store, 60.0) == 0
    assert collected == []


# -- the update log: offsets, failures, collectors, listener -------------------------


async def test_update_offsets_have_no_gaps_under_concurrent_writes(store: Store) -> None:
    await store.create_session(make_session())

    async def append_collecting(n: int) -> tuple[Message, list[Update]]:
        with collecting_updates() as collected:
            return await store.append_message(make_message(n=n)), collected

    results = await asyncio.gather(*(append_collecting(n) for n in range(50)))
    log = await all_updates(store, "alice")
    assert [update.offset for update in log] == list(range(1, 52))
    # Each concurrent writer collected exactly its own update.
    for message, collected in results:
        assert [items_of(update) for update in collected] == [[("message", "created", message.id)]]
        assert collected[0] in log
    assert await store.update_log("alice") == UpdateLog(
        epoch=(await store.update_log("alice")).epoch, last_offset=51, first_offset=1
    )


async def test_update_offsets_are_per_owner(store: Store) -> None:
    await store.create_session(make_session("s1", owner="alice"))
    await store.create_session(make_session("s2", owner="bob"))
    await asyncio.gather(
        *(store.append_message(make_message(f"s{1 + n % 2}", n=n)) for n in range(30))
    )
    for owner, session_id in (("alice", "s1"), ("bob", "s2")):
        log = await all_updates(store, owner)
        assert [update.offset for update in log] == list(range(1, 17))
        assert {update.owner for update in log} == {owner}
        messages = [e for update in log[1:] for e in update.data_list]
        assert messages == await store.list_messages(session_id)
    assert await all_updates(store, "carol") == []


async def test_failing_writes_log_nothing_and_take_no_offset(store: Store) -> None:
    await store.create_session(make_session())
    await store.append_message(make_message(n=1))
    with collecting_updates() as collected:
        results = await asyncio.gather(
            store.append_message(make_message(n=2)),
            store.append_message(make_message("no-such-session", n=3)),
            store.begin_turn(make_turn("t9", session_id="missing"), make_message("missing")),
            store.append_message(make_message(n=4)),
            return_exceptions=True,
        )
    assert isinstance(results[1], StoreError)
    assert isinstance(results[2], StoreError)
    assert [update.offset for update in collected] == [3, 4]

    await no_update(store, store.fork_session(make_session(), [make_message(n=5)]))
    await no_update(store, store.update_message(make_message(n=99)))
    assert [update.offset for update in await all_updates(store, "alice")] == [1, 2, 3, 4]
    assert (await store.append_message(make_message(n=6))).global_offset == 4
    assert (await store.update_log("alice")).last_offset == 5


async def test_collecting_updates_gets_only_the_writes_awaited_inside(store: Store) -> None:
    await store.create_session(make_session("s1", owner="alice"))
    await store.create_session(make_session("s2", owner="bob"))
    # Started outside the block: its context has no collector, wherever it is awaited.
    outside = asyncio.create_task(store.append_message(make_message("s2", n=1)))
    with collecting_updates() as collected:
        await store.append_message(make_message("s1", n=1))
        await asyncio.gather(
            store.touch_session("s1", 5.0), store.append_message(make_message("s2", n=2))
        )
        await outside
    await store.append_message(make_message("s1", n=3))

    assert sorted((u.owner, items_of(u)[0]) for u in collected) == [
        ("alice", ("message", "created", "s1-m1")),
        ("alice", ("session", "updated", "s1")),
        ("bob", ("message", "created", "s2-m2")),
    ]
    logged = [*await all_updates(store, "alice"), *await all_updates(store, "bob")]
    assert all(update in logged for update in collected)


async def test_nested_collectors_each_see_their_own_writes(store: Store) -> None:
    await store.create_session(make_session())
    with collecting_updates() as outer:
        await store.append_message(make_message(n=1))
        with collecting_updates() as inner:
            await store.append_message(make_message(n=2))
        await store.append_message(make_message(n=3))
    assert [items_of(u)[0][2] for u in inner] == ["s1-m2"]
    assert [items_of(u)[0][2] for u in outer] == ["s1-m1", "s1-m3"]


async def test_listener_receives_every_update_in_order(store: Store) -> None:
    received: list[Update] = []
    store.set_update_listener(received.append)
    await store.create_session(make_session("s1", owner="alice"))
    await store.create_session(make_session("s2", owner="bob"))
    await asyncio.gather(
        *(store.append_message(make_message(f"s{1 + n % 2}", n=n)) for n in range(20)),
        store.begin_turn(make_turn("t1"), make_message(n=100)),
        store.save_tool_call(make_tool_call("c1")),
    )
    await interrupt_at_start(store, 9.0)
    for owner in ("alice", "bob"):
        mine = [update for update in received if update.owner == owner]
        assert mine == await all_updates(store, owner)
    assert len(received) == 25

    store.set_update_listener(None)
    await store.touch_session("s1", 10.0)
    assert len(received) == 25


async def test_a_failing_listener_is_logged_and_breaks_nothing(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(update: Update) -> None:
        raise RuntimeError("listener bug")

    store.set_update_listener(broken)
    with caplog.at_level(logging.WARNING), collecting_updates() as collected:
        await store.create_session(make_session())
        stored = await store.append_message(make_message(n=1))
    assert stored.global_offset == 1
    assert [update.offset for update in collected] == [1, 2]
    assert any(record.levelno >= logging.WARNING for record in caplog.records)
    assert await store.get_session("s1") is not None


# -- the update log: log position, replay, pruning, epoch ----------------------------


async def test_update_log_of_an_owner_without_updates(store: Store) -> None:
    log = await store.update_log("nobody")
    assert log.epoch
    assert (log.last_offset, log.first_offset) == (0, 1)
    assert await all_updates(store, "nobody") == []


async def test_list_updates_after_offset_and_limit(store: Store) -> None:
    await store.create_session(make_session())
    await append_many(store, "s1", 4)
    log = await all_updates(store, "alice")
    assert [update.offset for update in log] == [1, 2, 3, 4, 5]
    assert await store.list_updates("alice", after_offset=2, limit=2) == log[2:4]
    assert await store.list_updates("alice", after_offset=5, limit=10) == []
    assert await store.list_updates("alice", after_offset=0, limit=0) == []
    assert await store.list_updates("bob", after_offset=0, limit=10) == []


async def test_prune_updates_keeps_the_last_offset(store: Store) -> None:
    await store.create_session(make_session("s1", owner="alice"))
    await store.append_message(make_message(n=1))
    await store.create_session(make_session("s2", owner="bob"))
    await asyncio.sleep(0.01)
    cutoff = time.time()
    await asyncio.sleep(0.01)
    await store.append_message(make_message(n=2))
    await store.append_message(make_message(n=3))

    assert await store.prune_updates(cutoff) == 3
    alice = await store.update_log("alice")
    assert (alice.last_offset, alice.first_offset) == (4, 3)
    assert [u.offset for u in await all_updates(store, "alice")] == [3, 4]
    bob = await store.update_log("bob")
    assert (bob.last_offset, bob.first_offset) == (1, 2)

    assert await store.prune_updates(time.time() + 60) == 2
    alice = await store.update_log("alice")
    assert (alice.last_offset, alice.first_offset) == (4, 5)
    assert await all_updates(store, "alice") == []
    # Offsets go on from where they were, never reused.
    update = await only_update(store, store.touch_session("s1", 1.0))
    assert update.offset == 5
    assert await store.prune_updates(0.0) == 0


@pytest.mark.parametrize("factory", BACKENDS)
async def test_a_fresh_store_has_a_fresh_epoch(factory: StoreFactory, tmp_path: Path) -> None:
    epochs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        backend = await factory(tmp_path / name)
        await backend.open()
        try:
            epochs.append((await backend.update_log("alice")).epoch)
            await backend.create_session(make_session())
            assert (await backend.update_log("alice")).epoch == epochs[-1]
        finally:
            await backend.close()
    assert all(epochs)
    assert epochs[0] != epochs[1]


# -- sessions: paging, replace, fork --------------------------------------------------


def ids(entities: list[Session] | list[Turn] | list[ToolCallRecord]) -> list[str]:
    return [entity.id for entity in entities]


async def test_list_sessions_pages_with_a_cursor(store: Store) -> None:
    for session_id, created_at in (("a1", 1.0), ("a2", 2.0), ("a3", 2.0), ("a4", 3.0)):
        await store.create_session(make_session(session_id, owner="alice", created_at=created_at))
    await store.create_session(make_session("a5", owner="alice", created_at=4.0))
    await store.create_session(make_session("b1", owner="bob", created_at=2.5))

    assert ids(await store.list_sessions("alice", limit=2)) == ["a5", "a4"]
    # Equal created_at: the greater id first.
    assert ids(await store.list_sessions("alice", limit=2, cursor="a4")) == ["a3", "a2"]
    assert ids(await store.list_sessions("alice", limit=2, cursor="a2")) == ["a1"]
    assert await store.list_sessions("alice", limit=2, cursor="a1") == []
    assert await store.list_sessions("alice", limit=2, cursor="unknown") == []
    assert ids(await store.list_sessions("bob", limit=5)) == ["b1"]


async def test_list_sessions_can_hide_deleted_sessions(store: Store) -> None:
    for n in range(1, 5):
        await store.create_session(make_session(f"a{n}", created_at=float(n)))
    deleted = await store.update_session(
        msgspec.structs.replace(make_session("a3", created_at=3.0), deleted_at=9.0)
    )
    assert deleted.deleted_at == 9.0

    assert ids(await store.list_sessions("alice", limit=10)) == ["a4", "a3", "a2", "a1"]
    visible = await store.list_sessions("alice", limit=2, include_deleted=False)
    assert ids(visible) == ["a4", "a2"]
    rest = await store.list_sessions("alice", limit=2, cursor="a2", include_deleted=False)
    assert ids(rest) == ["a1"]


async def test_fork_session_creates_and_appends_in_one_update(store: Store) -> None:
    await store.create_session(make_session("s1"))
    await append_many(store, "s1", 3)
    fork = msgspec.structs.replace(
        make_session("s2", created_at=300.0), parent_session_id="s1", root_session_id="s1"
    )
    copies = [make_message("s2", n=n) for n in range(2)]

    with collecting_updates() as collected:
        stored = await store.fork_session(fork, copies)

    assert stored == [
        msgspec.structs.replace(message, global_offset=n + 1) for n, message in enumerate(copies)
    ]
    assert await store.get_session("s2") == fork
    assert await store.list_messages("s2") == stored
    assert len(collected) == 1
    (update,) = collected
    assert items_of(update) == [
        ("session", "created", "s2"),
        ("message", "created", "s2-m0"),
        ("message", "created", "s2-m1"),
    ]
    assert update.data_list == (fork, *stored)
    assert await store.list_updates("alice", after_offset=update.offset - 1, limit=5) == [update]
    assert (await store.append_message(make_message("s2", n=7))).global_offset == 3


async def test_fork_onto_an_existing_id_writes_nothing(store: Store) -> None:
    original = await store.create_session(make_session("s1"))
    await append_many(store, "s1", 2)
    clash = msgspec.structs.replace(make_session("s1"), title="fork")
    await no_update(store, store.fork_session(clash, [make_message("s1", n=5)]))
    assert await store.get_session("s1") == original
    assert offsets(await store.list_messages("s1")) == [1, 2]


async def test_fork_without_messages(store: Store) -> None:
    assert await store.fork_session(make_session("s2"), []) == []
    (update,) = await all_updates(store, "alice")
    assert items_of(update) == [("session", "created", "s2")]


# -- messages: update, get, find by client id ----------------------------------------


async def test_update_message_replaces_content_and_keeps_offsets(store: Store) -> None:
    await store.create_session(make_session())
    await append_many(store, "s1", 2)
    original = await store.append_message(
        msgspec.structs.replace(
            make_message(n=5), role="assistant", status="streaming", turn_id="t1", turn_offset=2
        )
    )
    change = msgspec.structs.replace(
        original,
        content="final answer",
        parts=(ContentPart(type="text", text="final answer"),),
        status="completed",
        metadata={"finish": "stop"},
        updated_at=999.0,
        global_offset=0,
        turn_offset=0,
    )
    update = await only_update(store, store.update_message(change))
    expected = msgspec.structs.replace(change, global_offset=3, turn_offset=2)
    assert items_of(update) == [("message", "updated", original.id)]
    assert update.data_list == (expected,)
    assert await store.get_message(original.id) == expected
    assert (await store.list_messages("s1"))[-1] == expected
    assert await store.update_message(change) == expected


async def test_update_missing_message_is_a_store_error(store: Store) -> None:
    await store.create_session(make_session())
    await no_update(store, store.update_message(make_message(n=1)))
    assert await store.get_message("s1-m1") is None


async def test_get_message(store: Store) -> None:
    await store.create_session(make_session())
    stored = await append_many(store, "s1", 2)
    assert await store.get_message("s1-m1") == stored[1]
    assert await store.get_message("nope") is None


async def test_find_message_by_client_id_is_scoped_by_owner(store: Store) -> None:
    await store.create_session(make_session("s1", owner="alice"))
    await store.create_session(make_session("s2", owner="bob"))
    await store.append_message(make_message("s1", n=0))  # no client id
    mine = await store.append_message(
        msgspec.structs.replace(make_message("s1", n=1), client_id="c-1")
    )
    theirs = await store.append_message(
        msgspec.structs.replace(make_message("s2", n=1), client_id="c-2")
    )
    assert await store.find_message_by_client_id("alice", "c-1") == mine
    assert await store.find_message_by_client_id("bob", "c-2") == theirs
    assert await store.find_message_by_client_id("bob", "c-1") is None
    assert await store.find_message_by_client_id("alice", "c-2") is None
    assert await store.find_message_by_client_id("alice", "") is None
    assert await store.find_message_by_client_id("alice", "unknown") is None


# -- turns and tool calls: newest-first pages -----------------------------------------


async def test_page_turns_newest_first_with_a_cursor(store: Store) -> None:
    for session_id in ("s1", "s2"):
        await store.create_session(make_session(session_id))
    for turn_id, at in (("t1", 1.0), ("t2", 2.0), ("t3", 2.0), ("t4", 3.0)):
        await store.create_turn(make_turn(turn_id, at=at))
    await store.create_turn(make_turn("other", session_id="s2", at=2.5))
    # Saving again keeps the creation order among equal timestamps.
    await store.save_turn(make_turn("t2", state=TurnState.RUNNING, at=2.0))

    assert ids(await store.page_turns("s1", limit=2)) == ["t4", "t3"]
    assert ids(await store.page_turns("s1", limit=2, cursor="t3")) == ["t2", "t1"]
    assert await store.page_turns("s1", limit=2, cursor="t1") == []
    assert await store.page_turns("s1", limit=2, cursor="unknown") == []
    assert ids(await store.page_turns("s1", limit=10)) == ["t4", "t3", "t2", "t1"]
    assert ids(await store.page_turns("s2", limit=10)) == ["other"]
    assert await store.page_turns("s3", limit=10) == []
    running = await store.page_turns("s1", limit=1, cursor="t3")
    assert running == [make_turn("t2", state=TurnState.RUNNING, at=2.0)]


async def test_page_tool_calls_newest_first_with_a_cursor(store: Store) -> None:
    for session_id in ("s1", "s2"):
        await store.create_session(make_session(session_id))
    for call_id, at in (("c1", 1.0), ("c2", 2.0), ("c3", 2.0), ("c4", 3.0)):
        await store.save_tool_call(make_tool_call(call_id, at=at))
    await store.save_tool_call(make_tool_call("other", "s2", at=2.5))
    done = msgspec.structs.replace(make_tool_call("c2", at=2.0), state=ToolCallState.COMPLETED)
    await store.save_tool_call(done)

    assert ids(await store.page_tool_calls("s1", limit=2)) == ["c4", "c3"]
    assert await store.page_tool_calls("s1", limit=2, cursor="c3") == [
        done,
        make_tool_call("c1", at=1.0),
    ]
    assert await store.page_tool_calls("s1", limit=2, cursor="c1") == []
    assert await store.page_tool_calls("s1", limit=2, cursor="unknown") == []
    assert ids(await store.page_tool_calls("s2", limit=10)) == ["other"]


# -- the update log, SQLite only ------------------------------------------------------


async def test_sqlite_epoch_and_log_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "archive.db"
    first = await open_sqlite(path)
    await first.create_session(make_session())
    await append_many(first, "s1", 2)
    log = await first.update_log("alice")
    updates = await all_updates(first, "alice")
    await first.close()

    second = await open_sqlite(path)
    try:
        assert await second.update_log("alice") == log
        assert await all_updates(second, "alice") == updates
        update = await only_update(second, second.touch_session("s1", 5.0))
        assert update.offset == log.last_offset + 1
    finally:
        await second.close()


async def test_sqlite_pruned_log_keeps_its_last_offset_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "archive.db"
    first = await open_sqlite(path)
    await first.create_session(make_session())
    await append_many(first, "s1", 2)
    assert await first.prune_updates(time.time() + 60) == 3
    await first.close()

    second = await open_sqlite(path)
    try:
        log = await second.update_log("alice")
        assert (log.last_offset, log.first_offset) == (3, 4)
        update = await only_update(second, second.append_message(make_message(n=5)))
        assert update.offset == 4
        assert (await second.update_log("alice")).first_offset == 4
    finally:
        await second.close()


async def test_sqlite_migrates_a_database_of_the_previous_schema(tmp_path: Path) -> None:
    path = tmp_path / "archive.db"
    conn = sqlite3.connect(path)
    try:
        # Version 2 is the schema before the update log.
        for version, script in enumerate(MIGRATIONS[:2], start=1):
            conn.executescript(f"BEGIN; {script}; PRAGMA user_version = {version}; COMMIT;")
        placeholders = ", ".join("?" * 6)
        conn.execute(
            "INSERT INTO sessions (id, owner, agent, created_at, updated_at, last_activity_at) "
            f"VALUES ({placeholders})",
            ("s1", "alice", "default", 100.0, 100.0, 100.0),
        )
        conn.commit()
    finally:
        conn.close()

    store = await open_sqlite(path)
    try:
        assert user_version(path) == len(MIGRATIONS)
        assert await store.get_session("s1") == make_session()
        log = await store.update_log("alice")
        assert log.epoch
        assert (log.last_offset, log.first_offset) == (0, 1)
        update = await only_update(store, store.append_message(make_message(n=1)))
        assert update.offset == 1
    finally:
        await store.close()


class AppendThenFail(sqlite_writes.Write, frozen=True):
    """A write only this process's writers can run (the writer process knows its own)."""

    def run(self, conn: sqlite_writes.Archive, out: list[Update]) -> None:
        sqlite_writes._append_message(conn, out, make_message(n=50))
        raise RuntimeError("fails after its update was logged")


@IN_PROCESS_WRITERS
async def test_sqlite_write_failing_after_logging_rolls_its_update_back(
    tmp_path: Path, writer: SqliteWriter
) -> None:
    store = SqliteStore(tmp_path / "archive.db", writer=writer)
    await store.open()
    received: list[Update] = []
    store.set_update_listener(received.append)
    try:
        await store.create_session(make_session())
        with collecting_updates() as collected:
            # Queued in one loop iteration, so they share one group-commit transaction.
            results = await asyncio.gather(
                store.append_message(make_message(n=1)),
                store._write(AppendThenFail()),
                store.append_message(make_message(n=2)),
                return_exceptions=True,
            )
        assert isinstance(results[1], StoreError)
        assert [update.offset for update in collected] == [2, 3]
        assert [update.offset for update in received] == [1, 2, 3]
        assert [update.offset for update in await all_updates(store, "alice")] == [1, 2, 3]
        assert offsets(await store.list_messages("s1")) == [1, 2]
    finally:
        await store.close()


class WhereRun(sqlite_writes.Write, frozen=True):
    """Returns the thread the writer ran it on."""

    RESULT = int

    def run(self, conn: sqlite_writes.Archive, out: list[Update]) -> int:
        return threading.get_ident()


class LongWhereRun(WhereRun, frozen=True):
    OFF_LOOP = True


async def test_sqlite_inline_writer_commits_on_the_loop_and_long_writes_off_it(
    tmp_path: Path,
) -> None:
    async with opened_sqlite(tmp_path / "archive.db", "inline") as store:
        loop_thread = threading.get_ident()
        assert await store._write(WhereRun()) == loop_thread
        # A batch holding a write that may take long runs on the writer's thread, whole.
        plain, long = await asyncio.gather(store._write(WhereRun()), store._write(LongWhereRun()))
        assert plain == long != loop_thread
        assert await store._write(WhereRun()) == loop_thread


@IN_PROCESS_WRITERS
async def test_sqlite_writes_queued_in_one_loop_pass_share_one_transaction(
    tmp_path: Path, writer: SqliteWriter
) -> None:
    async with opened_sqlite(tmp_path / "archive.db", writer) as store:
        await store.create_session(make_session())
        batch_writer = store._batch_writer()
        assert isinstance(batch_writer, sqlite_backend.ThreadWriter)
        statements: list[str] = []
        batch_writer._conn.set_trace_callback(statements.append)
        stored = await asyncio.gather(*(store.append_message(make_message(n=n)) for n in range(5)))
        batch_writer._conn.set_trace_callback(None)
        assert offsets(list(stored)) == [1, 2, 3, 4, 5]
        assert statements.count("BEGIN IMMEDIATE") == statements.count("COMMIT") == 1


@contextlib.asynccontextmanager
async def while_reading(
    store: SqliteStore, read: Callable[[sqlite_writes.Archive, Callable[[], None]], int]
) -> AsyncIterator[asyncio.Future[int]]:
    """Runs the body while `read` is in progress on a reading thread of the store's,
    paused where it calls the `pause` it is given; the body must end without it."""
    release, running = threading.Event(), threading.Event()

    def pause() -> None:
        running.set()
        release.wait()

    blocked = asyncio.ensure_future(store._read(lambda conn: read(conn, pause)))
    await asyncio.get_running_loop().run_in_executor(None, running.wait)
    try:
        async with asyncio.timeout(10):  # a guard against a hang, not a deadline
            yield blocked
        assert not blocked.done()
    finally:
        release.set()


def count_after_pause(conn: sqlite_writes.Archive, pause: Callable[[], None]) -> int:
    """Counts the messages once released: what was committed while it was paused."""
    pause()
    count: int = conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
    return count


@EVERY_WRITER
async def test_sqlite_writes_and_reads_go_on_while_a_read_is_in_progress(
    tmp_path: Path, writer: SqliteWriter
) -> None:
    """Reads (however long) run on connections and threads of their own: the writer
    commits without waiting for them (a big page read delays no turn's `done`), and
    one long read leaves the other reads a connection and a thread."""
    async with opened_sqlite(tmp_path / "archive.db", writer) as store:
        await store.create_session(make_session())
        async with while_reading(store, count_after_pause) as blocked:
            stored = await store.append_message(make_message(n=1))
            assert offsets([stored]) == [1]
            assert await store.list_messages("s1") == [stored]
        # A read sees every commit acknowledged before its statement ran.
        assert await blocked == 1


@EVERY_WRITER
async def test_sqlite_a_wal_restart_does_not_wait_for_a_read_in_progress(
    tmp_path: Path, writer: SqliteWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A RESTART waits for the reads of the WAL to end, holding the writer: it gives up
    after a moment instead (tried again at the next checkpoint), so writes go on."""
    # Far longer than the guard of `while_reading`: waiting for the read would hang.
    monkeypatch.setattr(sqlite_writes, "WRITER_BUSY_TIMEOUT_MS", 600_000)

    def count_on_a_snapshot(conn: sqlite_writes.Archive, pause: Callable[[], None]) -> int:
        cursor = conn.execute("SELECT id FROM messages")
        cursor.fetchone()  # a snapshot of the WAL, held until the read ends
        pause()
        return 1 + len(cursor.fetchall())

    store = SqliteStore(tmp_path / "archive.db", writer=writer, checkpoint_interval=3600)
    await store.open()
    try:
        await store.create_session(make_session())
        await append_many(store, "s1", 3)  # in the WAL: no checkpoint ran
        async with while_reading(store, count_on_a_snapshot) as blocked:
            await store._batch_writer().restart_wal()
            assert offsets([await store.append_message(make_message(n=4))]) == [4]
        assert await blocked == 3  # its snapshot, taken before the last write
        assert offsets(await store.list_messages("s1")) == [1, 2, 3, 4]
    finally:
        await store.close()


async def test_sqlite_in_memory_archive_reads_its_writes() -> None:
    """An in-memory archive cannot be shared with a second connection: its reads run on
    the writing connection, between batches."""
    store = SqliteStore(":memory:")
    await store.open()
    try:
        await store.create_session(make_session())
        stored = await asyncio.gather(*(store.append_message(make_message(n=n)) for n in range(3)))
        assert await store.list_messages("s1") == list(stored)
    finally:
        await store.close()


async def test_begin_turn_can_refuse_a_client_id_the_owner_already_used(store: Store) -> None:
    await store.create_session(make_session("s1", owner="alice"))
    await store.create_session(make_session("s2", owner="alice"))
    await store.create_session(make_session("b1", owner="bob"))
    first = msgspec.structs.replace(make_message("s1", n=1), client_id="c1")
    stored = await store.begin_turn(make_turn("t1"), first, unique_client_id=True)
    again = msgspec.structs.replace(make_message("s2", n=2), client_id="c1")
    with pytest.raises(DuplicateClientId) as refused:
        await store.begin_turn(make_turn("t2", session_id="s2"), again, unique_client_id=True)
    assert (refused.value.session_id, refused.value.message_id) == ("s1", stored.id)
    assert await store.list_messages("s2") == []  # nothing was written
    assert await store.get_turn("t2") is None
    # Another owner may use the same id; without the check it is only recorded.
    bobs = msgspec.structs.replace(make_message("b1", n=3), client_id="c1")
    await store.begin_turn(make_turn("t3", session_id="b1"), bobs, unique_client_id=True)
    unchecked = msgspec.structs.replace(make_message("s2", n=4), client_id="c1")
    await store.begin_turn(make_turn("t4", session_id="s2"), unchecked)
    assert [m.client_id for m in await store.list_messages("s2")] == ["c1"]


async def test_begin_turn_can_archive_the_turns_start_in_the_same_write(store: Store) -> None:
    await store.create_session(make_session("s1"))
    turn = make_turn("t1")
    started = msgspec.structs.replace(turn, state=TurnState.RUNNING, started_at=1.0)
    reply = make_pending_reply("r1", turn_id="t1")
    with collecting_updates() as updates:
        await store.begin_turn(turn, make_message("s1", n=1), reply=reply, started=started)
    assert await store.get_turn("t1") == started
    # Created `pending`, then `running`: two updates, in this order, one offset apart.
    assert [items_of(update)[-1] for update in updates] == [
        ("message", "created", "r1"),
        ("turn", "updated", "t1"),
    ]
    assert [update.offset for update in updates] == [2, 3]
    assert updates[0].data_list[1] == turn
    assert updates[1].data_list == (started,)
    assert (await all_updates(store, "alice"))[1:] == updates  # what the log replays
    # A refused client id writes neither: no turn, no update.
    await store.create_session(make_session("s2"))
    again = msgspec.structs.replace(make_message("s2", n=2), client_id="m")
    taken = msgspec.structs.replace(make_message("s1", n=3), client_id="m")
    await store.begin_turn(make_turn("t3"), taken, unique_client_id=True)
    t2 = make_turn("t2", session_id="s2")
    running = msgspec.structs.replace(t2, state=TurnState.RUNNING, started_at=1.0)
    with pytest.raises(DuplicateClientId):
        await store.begin_turn(t2, again, unique_client_id=True, started=running)
    assert await store.get_turn("t2") is None


async def test_begin_turn_can_create_the_turns_reply_in_the_same_write(store: Store) -> None:
    await store.create_session(make_session("s1"))
    turn = make_turn("t1")
    reply = make_pending_reply("r1", turn_id="t1")
    with collecting_updates() as updates:
        user = await store.begin_turn(turn, make_message("s1", n=1), reply=reply)
    stored = await store.list_messages("s1")
    assert [(m.id, m.global_offset, m.status) for m in stored] == [
        (user.id, 1, "completed"),
        ("r1", 2, "pending"),
    ]
    (update,) = updates
    assert [(i.entity, i.action, i.entity_id) for i in update.items] == [
        ("message", "created", user.id),
        ("turn", "created", "t1"),
        ("session", "updated", "s1"),
        ("message", "created", "r1"),
    ]
    # A server stopped under the turn leaves the reply `pending`: it fails at the next start.
    assert await interrupt_at_start(store, 5.0) == 1
    failed = await store.get_message("r1")
    assert failed is not None
    assert (failed.status, failed.updated_at) == ("failed", 5.0)


async def test_end_turn_writes_the_reply_and_the_turn_as_one_update(store: Store) -> None:
    await store.create_session(make_session("s1"))
    turn = make_turn("t1", state=TurnState.RUNNING)
    reply = make_pending_reply("r1", turn_id="t1")
    await store.begin_turn(turn, make_message("s1", n=1), reply=reply)
    done = msgspec.structs.replace(turn, state=TurnState.COMPLETED, ended_at=3.0)
    final = msgspec.structs.replace(reply, content="Hello", status="completed", updated_at=3.0)
    with collecting_updates() as updates:
        await store.end_turn(done, final)
    (update,) = updates
    assert [(i.entity, i.action) for i in update.items] == [
        ("message", "updated"),
        ("turn", "updated"),
    ]
    stored = await store.get_message("r1")
    assert stored is not None
    assert (stored.content, stored.status, stored.global_offset) == ("Hello", "completed", 2)
    assert await store.get_turn("t1") == done
    # A reply that was never stored is appended; a turn without one is saved alone.
    late = msgspec.structs.replace(final, id="r2", content="late")
    with collecting_updates() as more:
        await store.end_turn(done, late)
        await store.end_turn(done, None)
    assert [[(i.entity, i.action) for i in u.items] for u in more] == [
        [("message", "created"), ("turn", "updated")],
        [("turn", "updated")],
    ]
    assert [m.content for m in await store.list_messages("s1")][-1] == "late"


async def test_a_write_failing_after_its_first_append_takes_no_offset(store: Store) -> None:
    """The user's message lands, then the reply's id collides: nothing of it may count."""
    await store.create_session(make_session("s1"))
    first = await store.begin_turn(make_turn("t1"), make_message("s1", n=1))
    clash = make_pending_reply(first.id, turn_id="t2")
    with pytest.raises(StoreError):
        await store.begin_turn(make_turn("t2"), make_message("s1", n=2), reply=clash)
    assert await store.get_turn("t2") is None
    later = await store.append_message(make_message("s1", n=3))
    assert offsets(await store.list_messages("s1")) == [1, 2]
    assert later.global_offset == 2
    assert [update.offset for update in await all_updates(store, "alice")] == [1, 2, 3]


def wal_cuts(sizes: list[int]) -> int:
    """How often the WAL's size fell back to at most 2 MiB (a restart's cut)."""
    return sum(1 for old, new in itertools.pairwise(sizes) if new < old and new <= 2 << 20)


@IN_PROCESS_WRITERS
async def test_sqlite_wal_stays_bounded_under_a_writer_that_never_pauses(
    tmp_path: Path, writer: SqliteWriter
) -> None:
    # A passive checkpoint never restarts the WAL while writes keep coming: it grew to
    # GBs under load. Past `wal_restart_frames` the checkpointer restarts it.
    path = tmp_path / "archive.db"
    store = SqliteStore(
        path,
        checkpoint_interval=0.02,
        wal_restart_frames=64,
        wal_size_limit=1024 * 1024,
        writer=writer,
    )
    await store.open()
    try:
        await store.create_session(make_session())
        wal = path.with_name(path.name + "-wal")
        sizes: list[int] = []
        n = 0
        loop = asyncio.get_running_loop()
        # At least 1.5 s of writes, then on until the WAL has been cut back twice (it is
        # restarted again and again, not once), within 30 s and a 256 MiB WAL: never
        # restarted, it holds every row written (40-200 MiB in 1.5 s here).
        least, most = loop.time() + 1.5, loop.time() + 30
        while (loop.time() < least or wal_cuts(sizes) < 2) and loop.time() < most:
            batch = [make_message(n=n + k, content="x" * 2000) for k in range(20)]
            await asyncio.gather(*(store.append_message(m) for m in batch))
            n += len(batch)
            sizes.append(wal.stat().st_size)
            if sizes[-1] > 256 << 20:
                break
        assert offsets(await store.list_messages("s1")) == list(range(1, n + 1))
    finally:
        await store.close()
    # About 40 KiB of rows a batch. A passive checkpoint never shrinks the WAL; a restart
    # past 64 frames (256 KiB) lets the next write cut it back to 1 MiB. How far it grows
    # between two restarts is the write rate times a checkpoint's fsyncs, which a busy
    # disk stretches (67 MiB seen under CI's load before the first cut, a few MiB on a
    # quiet machine): the test asks for repeated cuts, not a peak.
    assert wal_cuts(sizes) >= 2, (
        f"the WAL was cut back {wal_cuts(sizes)} times: {max(sizes)} bytes at most, "
        f"after {n} messages"
    )


@IN_PROCESS_WRITERS
async def test_sqlite_wal_restart_finds_the_wal_already_copied(
    tmp_path: Path, writer: SqliteWriter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The RESTART holds the writer while it copies and fsyncs what the last PASSIVE
    # left; a second PASSIVE right before it (beside the writer) leaves it only what
    # came in meanwhile, under load the frames of a few milliseconds instead of an
    # interval's.
    path = tmp_path / "archive.db"
    store = SqliteStore(path, checkpoint_interval=3600, wal_restart_frames=8, writer=writer)
    await store.open()
    calls: list[tuple[str, int, int]] = []

    def recorded(conn: sqlite3.Connection, mode: str) -> int:
        _busy, frames, copied = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        calls.append((mode, int(frames), int(copied)))
        return int(frames)

    checkpointer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        await store.create_session(make_session())
        await asyncio.gather(*(store.append_message(make_message(n=n)) for n in range(40)))
        # The store runs the PASSIVEs, its writer the RESTART (`restart_wal`).
        monkeypatch.setattr(sqlite_backend, "checkpoint", recorded)
        monkeypatch.setattr(sqlite_writes, "checkpoint", recorded)
        await store._checkpoint_once(checkpointer)
    finally:
        checkpointer.close()
        await store.close()
    # (closing the store then truncates the WAL.)
    assert [mode for mode, _, _ in calls[:3]] == ["PASSIVE", "PASSIVE", "RESTART"], calls
    _, frames, copied = calls[1]
    assert frames > 8
    assert copied == frames, "the second PASSIVE copies all the RESTART would have"


async def test_sqlite_prune_drops_no_update_newer_than_its_cutoff(tmp_path: Path) -> None:
    # The prune walks the log in the order it was written: should the clock have gone
    # back, an older update logged after a newer one stays until a later prune, and
    # no update newer than the cutoff is ever dropped.
    path = tmp_path / "archive.db"
    store = await open_sqlite(path, "thread")
    await store.close()
    conn = sqlite3.connect(path)
    insert = "INSERT INTO updates (owner, log_offset, id, items, data_list, created_at) "
    for offset, created_at in enumerate((10.0, 20.0, 100.0, 30.0), start=1):
        conn.execute(
            insert + "VALUES ('x', ?, ?, '[]', '[]', ?)", (offset, f"u{offset}", created_at)
        )
    conn.commit()
    conn.close()
    store = await open_sqlite(path, "thread")
    try:
        assert await store.prune_updates(50.0) == 2
        assert [u.offset for u in await all_updates(store, "x")] == [3, 4]
        assert await store.prune_updates(50.0) == 0  # 30.0 waits behind 100.0
        assert await store.prune_updates(150.0) == 2
        log = await store.update_log("x")
        assert (log.last_offset, log.first_offset) == (4, 5)
    finally:
        await store.close()


@EVERY_WRITER
async def test_sqlite_archive_has_one_store_at_a_time(tmp_path: Path, writer: SqliteWriter) -> None:
    path = tmp_path / "archive.db"
    first = await open_sqlite(path, writer)
    second = SqliteStore(path, writer=writer)
    with pytest.raises(StoreError, match="in use by another Portico process"):
        await second.open()
    await first.create_session(make_session())
    await first.close()
    # Closing releases the archive for the next one.
    reopened = await open_sqlite(path, writer)
    try:
        assert await reopened.get_session("s1") is not None
    finally:
        await reopened.close()


@EVERY_WRITER
async def test_sqlite_reader_beside_the_owner_sees_commits_and_cannot_write(
    tmp_path: Path, writer: SqliteWriter
) -> None:
    path = tmp_path / "archive.db"
    owner = await open_sqlite(path, writer)
    reader = SqliteStore(path, read_only=True)
    await reader.open()
    try:
        await owner.create_session(make_session())
        await owner.append_message(make_message(n=1))
        assert offsets(await reader.list_messages("s1")) == [1]
        with pytest.raises(StoreError):
            await reader.append_message(make_message(n=2))
        assert offsets(await owner.list_messages("s1")) == [1]
    finally:
        await reader.close()
        await owner.close()


# -- PostgreSQL only: replicas sharing one database -------------------------------------


async def open_postgres_replicas(count: int) -> list[PostgresStore]:
    """`count` stores on one fresh schema, opened together, as replicas start."""
    require_postgres()
    schema = await create_schema()
    _schemas.append(schema)
    replicas = [PostgresStore(schema_url(schema), pool_size=4) for _ in range(count)]
    await asyncio.gather(*(replica.open() for replica in replicas))
    return replicas


async def test_postgres_replicas_migrate_once_and_share_the_epoch() -> None:
    replicas = await open_postgres_replicas(3)
    try:
        logs = [await replica.update_log("alice") for replica in replicas]
        assert len({log.epoch for log in logs}) == 1
        (version,) = {
            await replica._connected().fetchval("SELECT MAX(version) FROM schema_migrations")
            for replica in replicas
        }
        assert version == len(postgres_backend.MIGRATIONS)
    finally:
        await asyncio.gather(*(replica.close() for replica in replicas))


async def test_postgres_replicas_number_messages_and_updates_without_gaps() -> None:
    first, second = await open_postgres_replicas(2)
    try:
        await first.create_session(make_session())
        received: tuple[list[Update], list[Update]] = ([], [])
        first.set_update_listener(received[0].append)
        second.set_update_listener(received[1].append)
        stored = await asyncio.gather(
            *(
                (first, second)[n % 2].append_message(make_message(n=n, content=f"m{n}"))
                for n in range(40)
            )
        )
        assert sorted(offsets(stored)) == list(range(1, 41))
        assert offsets(await second.list_messages("s1")) == list(range(1, 41))
        log = await all_updates(first, "alice")
        assert [update.offset for update in log] == list(range(1, 42))
        # Each replica published exactly its own writes, in offset order.
        assert sorted([*received[0], *received[1]], key=lambda u: u.offset) == log[1:]
        for published in received:
            assert len(published) == 20
            assert [u.offset for u in published] == sorted(u.offset for u in published)
    finally:
        await asyncio.gather(first.close(), second.close())


async def test_postgres_replicas_sweeping_together_interrupt_each_turn_once() -> None:
    first, second = await open_postgres_replicas(2)
    try:
        await first.create_session(make_session())
        for n in range(10):
            await begin_replica_turn(first, f"t{n}", "rep-dead", n)
        with collecting_updates() as collected:
            counts = await asyncio.gather(
                *(
                    replica.interrupt_orphaned_turns(200.0, replica_id=name, lease=LEASE)
                    for replica, name in ((first, "rep-a"), (second, "rep-b"))
                )
            )
        assert sum(counts) == 10
        logged = [item for update in collected for item in items_of(update)]
        assert len(logged) == len(set(logged)) == 20  # every turn and reply, once
        assert all(t.state is TurnState.INTERRUPTED for t in await first.list_turns("s1"))
    finally:
        await asyncio.gather(first.close(), second.close())


async def test_postgres_failing_write_in_a_merged_batch_fails_alone() -> None:
    (store,) = await open_postgres_replicas(1)
    try:
        for n in range(4):
            await store.create_session(make_session(f"s{n}"))
        with collecting_updates() as collected:
            # Queued in one loop iteration: one batch, the turns merged into one group.
            results = await asyncio.gather(
                *(
                    store.begin_turn(make_turn(f"t{n}", session_id=f"s{n}"), make_message(f"s{n}"))
                    for n in range(2)
                ),
                store.begin_turn(make_turn("tx", session_id="gone"), make_message("gone")),
                *(
                    store.begin_turn(make_turn(f"t{n}", session_id=f"s{n}"), make_message(f"s{n}"))
                    for n in range(2, 4)
                ),
                return_exceptions=True,
            )
        failure = results[2]
        assert isinstance(failure, StoreError)
        assert isinstance(failure.__cause__, asyncpg.ForeignKeyViolationError)
        assert [offsets([r]) for i, r in enumerate(results) if i != 2] == [[1]] * 4  # type: ignore[list-item]
        assert await store.get_turn("tx") is None
        # Four sessions created, four turns begun: offsets 1-8 without a gap.
        assert [u.offset for u in collected] == [5, 6, 7, 8]
        assert [u.offset for u in await all_updates(store, "alice")] == list(range(1, 9))
    finally:
        await store.close()


async def test_postgres_replicas_merging_turns_number_without_gaps() -> None:
    first, second = await open_postgres_replicas(2)
    try:
        for n in range(8):
            await first.create_session(make_session(f"s{n}"))
        received: tuple[list[Update], list[Update]] = ([], [])
        first.set_update_listener(received[0].append)
        second.set_update_listener(received[1].append)

        async def turns(n: int) -> None:
            replica = (first, second)[n % 2]
            session_id = f"s{n % 8}"
            turn = make_turn(f"t{n}", session_id=session_id)
            reply = make_pending_reply(f"r{n}", turn_id=turn.id, session_id=session_id)
            await replica.begin_turn(turn, make_message(session_id, n=n), reply=reply)
            done = msgspec.structs.replace(reply, content=f"a{n}", status="completed")
            await replica.end_turn(msgspec.structs.replace(turn, state=TurnState.COMPLETED), done)

        await asyncio.gather(*(turns(n) for n in range(32)))
        for n in range(8):
            assert offsets(await first.list_messages(f"s{n}")) == list(range(1, 9))
        log = await all_updates(second, "alice")
        assert [update.offset for update in log] == list(range(1, 8 + 64 + 1))
        assert sorted([*received[0], *received[1]], key=lambda u: u.offset) == log[8:]
        for published in received:
            assert len(published) == 32
            assert [u.offset for u in published] == sorted(u.offset for u in published)
    finally:
        await asyncio.gather(first.close(), second.close())


async def test_postgres_data_and_schema_survive_reopen() -> None:
    (first,) = await open_postgres_replicas(1)
    await first.create_session(make_session())
    await append_many(first, "s1", 2)
    log = await first.update_log("alice")
    await first.close()
    (schema,) = _schemas[-1:]
    second = PostgresStore(schema_url(schema))
    await second.open()  # migrations already applied: none runs again
    try:
        assert await second.update_log("alice") == log
        assert offsets([await second.append_message(make_message(n=9))]) == [3]
    finally:
        await second.close()


async def test_postgres_json_keeps_numbers_exactly() -> None:
    (store,) = await open_postgres_replicas(1)
    try:
        await store.create_session(make_session())
        call = msgspec.structs.replace(
            make_tool_call("c1"), result={"big": 1e20, "small": 5e-324, "nul": "a\u0000b"}
        )
        await store.save_tool_call(call)
        assert await store.get_tool_call("c1") == call
    finally:
        await store.close()


async def test_postgres_failing_write_keeps_its_cause() -> None:
    (store,) = await open_postgres_replicas(1)
    try:
        await store.create_session(make_session())
        with pytest.raises(StoreError) as failed:
            await store.append_message(make_message("missing"))
        assert isinstance(failed.value.__cause__, asyncpg.ForeignKeyViolationError)
    finally:
        await store.close()


async def test_postgres_unreachable_database_is_a_store_error() -> None:
    store = PostgresStore("postgresql://postgres@127.0.0.1:1/test")
    with pytest.raises(StoreError, match="cannot open the PostgreSQL archive"):
        await store.open()
    with pytest.raises(StoreError):
        await store.get_session("s1")


# -- agent memory -------------------------------------------------------------------


def memory(
    memory_id: str, content: str, *, at: float, principal: str = "alice", facet: str = "acme"
) -> MemoryEntry:
    return MemoryEntry(
        id=memory_id,
        principal=principal,
        agent="default",
        facet=facet,
        content=content,
        created_at=at,
    )


ACME = MemoryKey(principal="alice", agent="default", facet="acme")


async def test_memory_search_finds_the_keys_entries_newest_first(store: Store) -> None:
    assert await store.save_memory(memory("m1", "Prefers TEA", at=1.0), max_entries=10)
    assert await store.save_memory(memory("m2", "likes green tea", at=2.0), max_entries=10)
    assert await store.save_memory(memory("m3", "drinks coffee", at=3.0), max_entries=10)

    found = await store.search_memory(ACME, "tea", limit=10)
    assert [entry.id for entry in found] == ["m2", "m1"]  # ASCII case ignored
    assert found[1] == memory("m1", "Prefers TEA", at=1.0)
    everything = await store.search_memory(ACME, "", limit=2)
    assert [entry.id for entry in everything] == ["m3", "m2"]


async def test_memory_keys_never_see_each_other(store: Store) -> None:
    await store.save_memory(memory("m1", "acme secret", at=1.0), max_entries=10)
    await store.save_memory(memory("m2", "globex secret", at=1.0, facet="globex"), max_entries=10)
    await store.save_memory(memory("m3", "bob secret", at=1.0, principal="bob"), max_entries=10)
    other_agent = MemoryKey(principal="alice", agent="other", facet="acme")

    assert [e.id for e in await store.search_memory(ACME, "secret", limit=10)] == ["m1"]
    globex = MemoryKey(principal="alice", agent="default", facet="globex")
    assert [e.id for e in await store.search_memory(globex, "secret", limit=10)] == ["m2"]
    assert await store.search_memory(other_agent, "secret", limit=10) == []
    # Forgetting through another key deletes nothing.
    assert not await store.forget_memory(globex, "m1")
    assert [e.id for e in await store.search_memory(ACME, "", limit=10)] == ["m1"]


async def test_memory_full_key_refuses_and_forget_makes_room(store: Store) -> None:
    assert await store.save_memory(memory("m1", "one", at=1.0), max_entries=2)
    assert await store.save_memory(memory("m2", "two", at=2.0), max_entries=2)
    assert not await store.save_memory(memory("m3", "three", at=3.0), max_entries=2)
    # Another facet has room of its own.
    assert await store.save_memory(memory("m4", "four", at=3.0, facet="x"), max_entries=2)

    assert await store.forget_memory(ACME, "m1")
    assert not await store.forget_memory(ACME, "m1")
    assert await store.save_memory(memory("m3", "three", at=3.0), max_entries=2)
    assert [e.id for e in await store.search_memory(ACME, "", limit=10)] == ["m3", "m2"]


async def test_memory_concurrent_saves_keep_the_bound(store: Store) -> None:
    saved = await asyncio.gather(
        *(store.save_memory(memory(f"m{n}", f"entry {n}", at=n), max_entries=3) for n in range(8))
    )
    assert sum(saved) == 3
    assert len(await store.search_memory(ACME, "", limit=10)) == 3


# -- session traces -------------------------------------------------------------------


def trace_event(
    kind: str, *, at: float, owner: str = "alice", session_id: str = "s1"
) -> TraceEvent:
    return TraceEvent(
        session_id=session_id, owner=owner, kind=kind, at=at, data={"n": at, "who": ["x", 1]}
    )


async def test_trace_lists_the_owners_events_in_order(store: Store) -> None:
    # The session need not be stored: /ws acknowledges the disclosure before it is.
    await store.append_trace(trace_event("ai.disclosure.displayed", at=5.0))
    await store.append_trace(trace_event("message.metadata", at=1.0))
    await store.append_trace(trace_event("error", at=2.0, owner="bob"))
    await store.append_trace(trace_event("error", at=3.0, session_id="s2"))

    events = await store.list_trace("s1", "alice", limit=10)
    assert events == [
        trace_event("ai.disclosure.displayed", at=5.0),
        trace_event("message.metadata", at=1.0),
    ]
    assert await store.list_trace("s1", "alice", limit=1) == events[:1]
    assert [e.owner for e in await store.list_trace("s1", "bob", limit=10)] == ["bob"]
    assert await store.list_trace("s1", "carol", limit=10) == []


async def test_sqlite_memory_and_trace_survive_reopen(tmp_path: Path) -> None:
    first = SqliteStore(tmp_path / "archive.db")
    await first.open()
    await first.save_memory(memory("m1", "kept", at=1.0), max_entries=10)
    await first.append_trace(trace_event("error", at=1.0))
    await first.close()
    second = SqliteStore(tmp_path / "archive.db")
    await second.open()
    try:
        assert [e.id for e in await second.search_memory(ACME, "kept", limit=10)] == ["m1"]
        assert await second.list_trace("s1", "alice", limit=10) == [trace_event("error", at=1.0)]
    finally:
        await second.close()
