"""SQLite archive, the embedded default.

One connection owned by one thread. Writes are grouped: every write queued
while the previous batch was committing goes into the next single transaction
(group commit), so hundreds of concurrent turns cost a handful of fsyncs, not
one each. Each write runs inside its own SAVEPOINT, so one failing write fails
alone. We use sqlite3 on a dedicated thread rather than aiosqlite because a
batch must run many statements in one thread hop; aiosqlite hops per statement.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from portico.core.model import ContentPart, Message, Session, ToolCallRecord, Turn
from portico.core.states import TERMINAL_TURN_STATES, ToolCallState, TurnState
from portico.errors import StoreError

T = TypeVar("T")
Operation = Callable[[sqlite3.Connection], Any]

# Each entry upgrades the schema by one version (PRAGMA user_version).
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        agent TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        last_activity_at REAL NOT NULL,
        title TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL DEFAULT 'idle',
        closed_at REAL,
        deleted_at REAL,
        client_session_id TEXT NOT NULL DEFAULT '',
        parent_session_id TEXT NOT NULL DEFAULT '',
        root_session_id TEXT NOT NULL DEFAULT '',
        forked_from_message_id TEXT NOT NULL DEFAULT '',
        declare TEXT
    );
    CREATE INDEX sessions_owner_created ON sessions (owner, created_at);
    CREATE TABLE messages (
        id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL REFERENCES sessions (id),
        global_offset INTEGER NOT NULL,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        content_type TEXT NOT NULL,
        parts TEXT NOT NULL,
        metadata TEXT NOT NULL,
        status TEXT NOT NULL,
        turn_id TEXT NOT NULL,
        turn_offset INTEGER NOT NULL,
        client_id TEXT NOT NULL,
        parent_message_id TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        UNIQUE (session_id, global_offset)
    );
    CREATE TABLE turns (
        id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL REFERENCES sessions (id),
        state TEXT NOT NULL,
        created_at REAL NOT NULL,
        started_at REAL,
        ended_at REAL,
        error_code TEXT NOT NULL,
        error_message TEXT NOT NULL,
        merged_into TEXT NOT NULL
    );
    CREATE INDEX turns_session ON turns (session_id, created_at);
    """,
    """
    CREATE TABLE tool_calls (
        id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL REFERENCES sessions (id),
        turn_id TEXT NOT NULL,
        name TEXT NOT NULL,
        arguments TEXT NOT NULL,
        state TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        consent_message TEXT,
        categories TEXT NOT NULL,
        result TEXT NOT NULL,
        error TEXT NOT NULL,
        message_id TEXT NOT NULL,
        client_id TEXT NOT NULL
    );
    CREATE INDEX tool_calls_session ON tool_calls (session_id, created_at);
    """,
)

SESSION_COLUMNS = tuple(field.name for field in msgspec.structs.fields(Session))
MESSAGE_COLUMNS = tuple(field.name for field in msgspec.structs.fields(Message))
_json_encode = msgspec.json.encode
_parts_decoder = msgspec.json.Decoder(tuple[ContentPart, ...])
_metadata_decoder = msgspec.json.Decoder(dict[str, str])
_declare_decoder = msgspec.json.Decoder(dict[str, Any] | None)
_any_decoder = msgspec.json.Decoder()
_JSON_TOOL_COLUMNS = ("arguments", "categories", "result")


def _migrate(conn: sqlite3.Connection) -> None:
    version: int = conn.execute("PRAGMA user_version").fetchone()[0]
    for index, script in enumerate(MIGRATIONS[version:], start=version + 1):
        conn.executescript(f"BEGIN; {script}; PRAGMA user_version = {index}; COMMIT;")


def _session_row(session: Session) -> tuple[Any, ...]:
    values = msgspec.structs.astuple(session)
    return (*values[:-1], None if session.declare is None else _json_encode(session.declare))


def _row_dict(row: sqlite3.Row) -> dict[str, Any]:
    return dict(zip(row.keys(), tuple(row), strict=True))


def _session_from_row(row: sqlite3.Row) -> Session:
    data = _row_dict(row)
    data["declare"] = _declare_decoder.decode(data["declare"]) if data["declare"] else None
    return Session(**data)


def _message_from_row(row: sqlite3.Row) -> Message:
    data = _row_dict(row)
    data["parts"] = _parts_decoder.decode(data["parts"])
    data["metadata"] = _metadata_decoder.decode(data["metadata"])
    return Message(**data)


def _turn_from_row(row: sqlite3.Row) -> Turn:
    data = _row_dict(row)
    data["state"] = TurnState(data["state"])
    return Turn(**data)


def _insert_message(conn: sqlite3.Connection, *, message: Message) -> Message:
    """Append `message` with the session's next global_offset (1, 2, ... without gaps)."""
    (last,) = conn.execute(
        "SELECT COALESCE(MAX(global_offset), 0) FROM messages WHERE session_id = ?",
        (message.session_id,),
    ).fetchone()
    stored = msgspec.structs.replace(message, global_offset=last + 1)
    row = {f: getattr(stored, f) for f in MESSAGE_COLUMNS}
    row["parts"] = _json_encode(stored.parts)
    row["metadata"] = _json_encode(stored.metadata)
    columns = ", ".join(row)
    conn.execute(
        f"INSERT INTO messages ({columns}) VALUES ({', '.join('?' * len(row))})",
        tuple(row.values()),
    )
    return stored


def _turn_row(turn: Turn) -> dict[str, Any]:
    row = msgspec.structs.asdict(turn)
    row["state"] = turn.state.value
    return row


def _tool_call_row(call: ToolCallRecord) -> dict[str, Any]:
    row = msgspec.structs.asdict(call)
    row["state"] = call.state.value
    for column in _JSON_TOOL_COLUMNS:
        row[column] = _json_encode(row[column])
    return row


def _tool_call_from_row(row: sqlite3.Row) -> ToolCallRecord:
    data = _row_dict(row)
    for column in _JSON_TOOL_COLUMNS:
        data[column] = _any_decoder.decode(data[column])
    data["state"] = ToolCallState(data["state"])
    data["categories"] = tuple(data["categories"])
    return ToolCallRecord(**data)


class SqliteStore:
    def __init__(self, path: str | Path) -> None:
        self._path = str(path)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portico-sqlite")
        self._conn: sqlite3.Connection | None = None
        self._pending: list[tuple[Operation, asyncio.Future[Any]]] = []
        self._committer: asyncio.Task[None] | None = None

    # -- plumbing ---------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._path != ":memory:":
            Path(self._path).parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL under WAL is durable across process crashes; only an OS crash
        # can lose the last commits, which is the usual trade for chat archives.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
        _migrate(conn)
        return conn

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._connection()
        try:
            return await self._in_thread(lambda: fn(conn))
        except sqlite3.Error as exc:
            raise StoreError("archive read failed") from exc

    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        self._connection()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending.append((fn, future))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_pending())
        return await future

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError("the archive is not open")
        return self._conn

    async def _commit_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            conn = self._connection()
            try:
                outcomes = await self._in_thread(functools.partial(self._run_batch, conn, batch))
            except sqlite3.Error as exc:
                outcomes = [StoreError("archive write failed")] * len(batch)
                outcomes[0].__cause__ = exc
            for (_, future), outcome in zip(batch, outcomes, strict=True):
                if future.done():
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    @staticmethod
    def _run_batch(
        conn: sqlite3.Connection, batch: list[tuple[Operation, asyncio.Future[Any]]]
    ) -> list[Any]:
        outcomes: list[Any] = []
        conn.execute("BEGIN IMMEDIATE")
        for operation, _ in batch:
            conn.execute("SAVEPOINT op")
            try:
                outcomes.append(operation(conn))
                conn.execute("RELEASE op")
            # Any exception, not only sqlite3.Error: one escaping here would leave the
            # transaction open and every future of the batch unresolved.
            except Exception as exc:
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
                error = StoreError("archive write failed")
                error.__cause__ = exc
                outcomes.append(error)
        conn.execute("COMMIT")
        return outcomes

    # -- lifecycle --------------------------------------------------------------

    async def open(self) -> None:
        try:
            self._conn = await self._in_thread(self._connect)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the archive at {self._path}") from exc

    async def close(self) -> None:
        if self._committer is not None:
            await self._committer
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await self._in_thread(conn.close)
        self._executor.shutdown(wait=True)

    # -- sessions ---------------------------------------------------------------

    async def create_session(self, session: Session) -> Session:
        placeholders = ", ".join("?" * len(SESSION_COLUMNS))

        def insert_or_get(conn: sqlite3.Connection) -> Session:
            conn.execute(
                f"INSERT OR IGNORE INTO sessions VALUES ({placeholders})", _session_row(session)
            )
            row = conn.execute("SELECT * FROM sessions WHERE id = ?", (session.id,)).fetchone()
            return _session_from_row(row)

        return await self._write(insert_or_get)

    async def get_session(self, session_id: str) -> Session | None:
        def select(conn: sqlite3.Connection) -> Session | None:
            row = conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
            return None if row is None else _session_from_row(row)

        return await self._read(select)

    async def list_sessions(self, owner: str, *, limit: int) -> list[Session]:
        def select(conn: sqlite3.Connection) -> list[Session]:
            rows = conn.execute(
                "SELECT * FROM sessions WHERE owner = ? ORDER BY created_at DESC, id DESC LIMIT ?",
                (owner, limit),
            ).fetchall()
            return [_session_from_row(row) for row in rows]

        return await self._read(select)

    async def touch_session(self, session_id: str, now: float) -> None:
        def update(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE sessions SET last_activity_at = ?, updated_at = ? WHERE id = ?",
                (now, now, session_id),
            )

        await self._write(update)

    # -- messages ---------------------------------------------------------------

    async def append_message(self, message: Message) -> Message:
        return await self._write(functools.partial(_insert_message, message=message))

    async def begin_turn(self, turn: Turn, message: Message) -> Message:
        def begin(conn: sqlite3.Connection) -> Message:
            stored = _insert_message(conn, message=message)
            _upsert("turns", _turn_row(turn))(conn)
            conn.execute(
                "UPDATE sessions SET last_activity_at = ?, updated_at = ? WHERE id = ?",
                (message.created_at, message.created_at, message.session_id),
            )
            return stored

        # One write, one thread hop, and all or nothing (each write is a savepoint).
        return await self._write(begin)

    async def list_messages(
        self, session_id: str, *, after_offset: int = 0, limit: int | None = None
    ) -> list[Message]:
        def select(conn: sqlite3.Connection) -> list[Message]:
            rows = conn.execute(
                "SELECT * FROM messages WHERE session_id = ? AND global_offset > ? "
                "ORDER BY global_offset LIMIT ?",
                (session_id, after_offset, -1 if limit is None else limit),
            ).fetchall()
            return [_message_from_row(row) for row in rows]

        return await self._read(select)

    # -- turns ------------------------------------------------------------------

    async def create_turn(self, turn: Turn) -> None:
        await self.save_turn(turn)

    async def save_turn(self, turn: Turn) -> None:
        await self._write(_upsert("turns", _turn_row(turn)))

    async def get_turn(self, turn_id: str) -> Turn | None:
        def select(conn: sqlite3.Connection) -> Turn | None:
            row = conn.execute("SELECT * FROM turns WHERE id = ?", (turn_id,)).fetchone()
            return None if row is None else _turn_from_row(row)

        return await self._read(select)

    async def list_turns(self, session_id: str) -> list[Turn]:
        def select(conn: sqlite3.Connection) -> list[Turn]:
            rows = conn.execute(
                "SELECT * FROM turns WHERE session_id = ? ORDER BY created_at, rowid",
                (session_id,),
            ).fetchall()
            return [_turn_from_row(row) for row in rows]

        return await self._read(select)

    # -- tool calls -------------------------------------------------------------

    async def save_tool_call(self, call: ToolCallRecord) -> None:
        await self._write(_upsert("tool_calls", _tool_call_row(call)))

    async def get_tool_call(self, call_id: str) -> ToolCallRecord | None:
        def select(conn: sqlite3.Connection) -> ToolCallRecord | None:
            row = conn.execute("SELECT * FROM tool_calls WHERE id = ?", (call_id,)).fetchone()
            return None if row is None else _tool_call_from_row(row)

        return await self._read(select)

    async def list_tool_calls(self, session_id: str) -> list[ToolCallRecord]:
        def select(conn: sqlite3.Connection) -> list[ToolCallRecord]:
            rows = conn.execute(
                "SELECT * FROM tool_calls WHERE session_id = ? ORDER BY created_at, rowid",
                (session_id,),
            ).fetchall()
            return [_tool_call_from_row(row) for row in rows]

        return await self._read(select)

    async def interrupt_unfinished_turns(self, now: float) -> int:
        terminal = tuple(state.value for state in TERMINAL_TURN_STATES)

        def update(conn: sqlite3.Connection) -> int:
            cursor = conn.execute(
                f"UPDATE turns SET state = ?, ended_at = ? "
                f"WHERE state NOT IN ({', '.join('?' * len(terminal))})",
                (TurnState.INTERRUPTED.value, now, *terminal),
            )
            return cursor.rowcount

        return await self._write(update)


def _upsert(table: str, row: dict[str, Any]) -> Callable[[sqlite3.Connection], None]:
    """An insert that updates in place on a known id (keeping the rowid, so order holds)."""
    columns = ", ".join(row)
    updates = ", ".join(f"{column} = excluded.{column}" for column in row if column != "id")
    sql = (
        f"INSERT INTO {table} ({columns}) VALUES ({', '.join('?' * len(row))}) "
        f"ON CONFLICT (id) DO UPDATE SET {updates}"
    )
    values = tuple(row.values())

    def upsert(conn: sqlite3.Connection) -> None:
        conn.execute(sql, values)

    return upsert
