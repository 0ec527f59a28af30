"""The Store port's contract: every archive backend must pass this one suite.

A backend joins by adding one entry to `BACKENDS`: a factory that returns an
unopened store for a test's temporary directory.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest

from portico.core.model import ContentPart, MediaContent, Message, Session, ToolCallRecord, Turn
from portico.core.states import ToolCallState, TurnState
from portico.errors import StoreError
from portico.store.base import Store
from portico.store.memory import MemoryStore
from portico.store.sqlite import MIGRATIONS, SqliteStore

StoreFactory = Callable[[Path], Awaitable[Store]]


async def memory_store(tmp_path: Path) -> Store:
    return MemoryStore()


async def sqlite_store(tmp_path: Path) -> Store:
    return SqliteStore(tmp_path / "archive.db")


BACKENDS = [
    pytest.param(memory_store, id="memory"),
    pytest.param(sqlite_store, id="sqlite"),
    # pytest.param(postgres_store, id="postgres", marks=needs_postgres),
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


def make_turn(
    turn_id: str, *, session_id: str = "s1", state: TurnState = TurnState.PENDING, at: float = 1.0
) -> Turn:
    return Turn(id=turn_id, session_id=session_id, state=state, created_at=at)


async def append_many(store: Store, session_id: str, count: int) -> list[Message]:
    return [await store.append_message(make_message(session_id, n=n)) for n in range(count)]


def offsets(messages: list[Message]) -> list[int]:
    return [m.global_offset for m in messages]


# -- sessions -----------------------------------------------------------------------


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


async def test_interrupt_unfinished_turns(store: Store) -> None:
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

    assert await store.interrupt_unfinished_turns(50.0) == 2

    for turn in terminal:
        assert await store.get_turn(turn.id) == turn
    for turn in (pending, running):
        expected = msgspec.structs.replace(turn, state=TurnState.INTERRUPTED, ended_at=50.0)
        assert await store.get_turn(turn.id) == expected
    assert await store.interrupt_unfinished_turns(60.0) == 0


# -- SQLite only --------------------------------------------------------------------


async def open_sqlite(path: Path) -> SqliteStore:
    store = SqliteStore(path)
    await store.open()
    return store


def user_version(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        version: int = conn.execute("PRAGMA user_version").fetchone()[0]
    return version


async def test_sqlite_data_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "archive.db"
    first = await open_sqlite(path)
    session = await first.create_session(make_session())
    messages = await append_many(first, "s1", 3)
    turn = make_turn("t1", state=TurnState.COMPLETED)
    await first.create_turn(turn)
    await first.close()

    second = await open_sqlite(path)
    try:
        assert await second.get_session("s1") == session
        assert await second.list_messages("s1") == messages
        assert await second.get_turn("t1") == turn
        assert offsets([await second.append_message(make_message(n=9))]) == [4]
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


async def test_sqlite_failing_write_in_a_batch_fails_alone(tmp_path: Path) -> None:
    store = await open_sqlite(tmp_path / "archive.db")
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


async def test_sqlite_write_failing_outside_sqlite_fails_alone(tmp_path: Path) -> None:
    store = await open_sqlite(tmp_path / "archive.db")
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
