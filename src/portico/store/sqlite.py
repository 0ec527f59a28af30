"""SQLite archive, the embedded default.

One writing connection, owned by one thread of the server, or with
`sqlite_writer: inline` used on the event loop's own thread (`InlineWriter`), or with
`sqlite_writer: process` owned by a writer process (store/sqlite_process.py; each
write is a `Write` struct, so it can cross as data). Writes are grouped: every write queued
while the previous batch was committing goes into the next single transaction
(group commit), so hundreds of concurrent turns cost a handful of fsyncs, not
one each. Each write runs inside its own SAVEPOINT, so one failing write fails
alone. We use sqlite3 on a dedicated thread rather than aiosqlite because a
batch must run many statements in one thread hop; aiosqlite hops per statement.

Each write appends its updates to the owner's log inside its own savepoint, so
a write that rolls back leaves no update and takes no offset. The updates are
handed to the caller's collector and to the listener only after the commit.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import os
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar

import msgspec
from msgspec.structs import astuple

from portico.domain.memory import MemoryEntry, MemoryKey
from portico.domain.model import (
    Entity,
    Message,
    Session,
    ToolCallRecord,
    Turn,
    Update,
    UpdateItem,
    UpdateLog,
)
from portico.domain.trace import TraceEvent
from portico.errors import DuplicateClientId, StoreError
from portico.health import IN_PROCESS, Health
from portico.store import rows, sql
from portico.store.base import (
    UpdateListener,
    as_store_error,
    current_collector,
    is_orphaned,
    publish,
)

if TYPE_CHECKING:  # not imported at run time: the writer process starts faster
    from portico.config import SqliteWriter
    from portico.store.sqlite_process import ProcessWriter

log = logging.getLogger("portico.store")

T = TypeVar("T")
# Sessions and owners whose last offsets the writer remembers; past this it forgets all.
HEADS_SIZE = 50_000


class Heads:
    """The last message offset of each session and update offset of each owner.

    The archive has one writer (the store's thread or writer process;
    `_lock_archive` keeps other processes out), so it can number the next message and
    update itself instead of reading MAX() before each insert: two statements fewer
    per write, and every statement costs the event loop a hand-off
    of the GIL. Whatever a rolled-back write may have taught is forgotten (`clear`).
    """

    def __init__(self) -> None:
        self.messages: dict[str, int] = {}
        self.updates: dict[str, int] = {}
        self.owners: dict[str, str] = {}

    def clear(self) -> None:
        self.messages.clear()
        self.updates.clear()
        self.owners.clear()

    def bound(self) -> None:
        if max(len(self.messages), len(self.updates), len(self.owners)) > HEADS_SIZE:
            self.clear()


class Archive(sqlite3.Connection):
    """The store's connection, with the offsets its writes have handed out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.heads = Heads()


# A write runs on the writer's connection, in its batch's transaction (alone in a
# savepoint only after a write of the batch failed: `_run_batch`); it appends the
# updates it logged to the list it is given, which is published only once the batch
# commits.
Operation = Callable[[Archive, list[Update]], Any]
# What a write returned (or the StoreError it failed with) and the updates it logged.
Outcome = tuple[Any, list[Update]]
Action = Literal["created", "updated"]

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
    # The per-owner update log. An owner's next offset is one past its newest update
    # (a seek on the primary key, rolled back with its savepoint like any row);
    # `update_heads` keeps the last offset of owners whose newest updates were pruned,
    # so an offset is never handed out twice. The epoch is drawn once, here, and names
    # this database's log for good.
    """
    CREATE TABLE meta (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        epoch TEXT NOT NULL
    );
    INSERT INTO meta (id, epoch) VALUES (1, 'epoch-' || lower(hex(randomblob(16))));
    CREATE TABLE update_heads (
        owner TEXT PRIMARY KEY,
        last_offset INTEGER NOT NULL
    ) WITHOUT ROWID;
    CREATE TABLE updates (
        owner TEXT NOT NULL,
        log_offset INTEGER NOT NULL,
        id TEXT NOT NULL,
        items TEXT NOT NULL,
        data_list TEXT NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (owner, log_offset)
    );
    CREATE INDEX updates_created ON updates (created_at);
    """,
    # Partial indexes, small and cheap to keep: most messages (all assistant output)
    # carry no client id, and only replies being written are `streaming` (found at
    # start without scanning the archive).
    """
    CREATE INDEX messages_client_id ON messages (client_id) WHERE client_id != '';
    CREATE INDEX messages_streaming ON messages (status) WHERE status = 'streaming';
    """,
    """
    ALTER TABLE turns ADD COLUMN input_tokens INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE turns ADD COLUMN output_tokens INTEGER NOT NULL DEFAULT 0;
    """,
    # A turn's reply is created `pending` with the turn; open replies are both kinds.
    """
    DROP INDEX messages_streaming;
    CREATE INDEX messages_open ON messages (status) WHERE status IN ('pending', 'streaming');
    """,
    # Turns name the replica running them; replicas hold leases (store/base.py). The
    # index keeps the orphan sweep to unfinished turns; its predicate is
    # rows.UNFINISHED_TURN.
    """
    ALTER TABLE turns ADD COLUMN replica TEXT NOT NULL DEFAULT '';
    CREATE INDEX turns_unfinished ON turns (replica)
        WHERE state NOT IN ('cancelled', 'completed', 'failed', 'interrupted', 'merged');
    CREATE TABLE replicas (
        id TEXT PRIMARY KEY,
        last_seen REAL NOT NULL
    ) WITHOUT ROWID;
    """,
    # The session-binding claim's value of the token that opened the session.
    """
    ALTER TABLE sessions ADD COLUMN binding TEXT NOT NULL DEFAULT '';
    """,
    # Agent memory (domain/memory.py) and session traces (domain/trace.py). A trace may
    # start before its session is stored, so it references no session row.
    """
    CREATE TABLE memories (
        id TEXT PRIMARY KEY,
        principal TEXT NOT NULL,
        agent TEXT NOT NULL,
        facet TEXT NOT NULL,
        content TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX memories_key ON memories (principal, agent, facet, created_at);
    CREATE TABLE traces (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        session_id TEXT NOT NULL,
        owner TEXT NOT NULL,
        kind TEXT NOT NULL,
        at REAL NOT NULL,
        data TEXT NOT NULL
    );
    CREATE INDEX traces_session ON traces (session_id, seq);
    """,
    # The update log is appended in time order by the one writer, so the prune walks it
    # in rowid order (`_PRUNED`) instead of by time: the by-time index cost a page of WAL
    # for every update logged, two per turn (docs/performance.md, "The WAL's fsyncs").
    """
    DROP INDEX updates_created;
    """,
)


SQL = sql.Statements(sql.SQLITE)
# Built once: sqlite3 caches compiled statements by their text.
_INSERT_SESSION_IF_ABSENT = sql.insert(
    sql.SQLITE, "sessions", rows.SESSION_COLUMNS, "INSERT OR IGNORE"
)
# A turn's session and creation time never change: its end does not rewrite its entry
# in `turns_session` (a page of another b-tree, in the WAL, per turn).
_REPLACE_TURN = sql.replace(
    sql.SQLITE, "turns", rows.TURN_COLUMNS, fixed=("session_id", "created_at")
)
_LAST_MESSAGE_OFFSET = "SELECT COALESCE(MAX(global_offset), 0) FROM messages WHERE session_id = ?"
# An owner's last offset: its newest update, or the head prune left when it dropped
# that one. A read, not a counter row written by every write: the log is hot.
_LAST_OFFSET_OF = (
    "MAX(COALESCE((SELECT MAX(log_offset) FROM updates WHERE owner = {0}), 0), "
    "COALESCE((SELECT last_offset FROM update_heads WHERE owner = {0}), 0))"
)
# The owner's next offset, by owner or by session id (no row when the session is
# missing). A separate read: an INSERT ... RETURNING buffers through a temporary
# table and measured slower than the two statements.
_NEXT_OFFSET = f"SELECT ?1, 1 + {_LAST_OFFSET_OF.format('?1')}"
_NEXT_OFFSET_OF_SESSION = (
    f"SELECT s.owner, 1 + {_LAST_OFFSET_OF.format('s.owner')} FROM sessions s WHERE s.id = ?"
)
_UPDATE_LOG = (
    f"SELECT {_LAST_OFFSET_OF.format('?1')}, (SELECT MIN(log_offset) FROM updates WHERE owner = ?1)"
)
# What a prune drops: the log's updates before its first one created at or after the
# cutoff (?1), in rowid order, which is the order the one writer logged them in. Walking
# from the oldest, it reads what it drops and one row more. Should the clock have gone
# back, an update older than the cutoff but logged after a newer one stays until a
# later prune: a prune never drops an update newer than its cutoff.
_PRUNED = (
    "updates.rowid < COALESCE("
    "(SELECT rowid FROM updates WHERE created_at >= ?1 ORDER BY rowid LIMIT 1), "
    "(SELECT COALESCE(MAX(rowid), 0) + 1 FROM updates))"
)
# Before pruning, the owners losing updates record their last offset. NOT INDEXED keeps
# this to the pruned rowid range (the planner would scan the whole key index for
# DISTINCT); the WHERE true is what lets SQLite parse an upsert after a SELECT.
_KEEP_HEADS = (
    "INSERT INTO update_heads (owner, last_offset) "
    "SELECT p.owner, (SELECT MAX(log_offset) FROM updates u WHERE u.owner = p.owner) "
    f"FROM (SELECT DISTINCT owner FROM updates NOT INDEXED WHERE {_PRUNED}) p WHERE true "
    "ON CONFLICT (owner) DO UPDATE SET last_offset = excluded.last_offset"
)
_PRUNE_UPDATES = f"DELETE FROM updates WHERE {_PRUNED}"


def _save_memory(conn: Archive, out: list[Update], entry: MemoryEntry, max_entries: int) -> bool:
    held: int = conn.execute(SQL.count_memories, astuple(entry.key)).fetchone()[0]
    if held >= max_entries:
        return False
    conn.execute(SQL.insert_memory, rows.memory_row(entry))
    return True


def _migrate(conn: Archive) -> None:
    version: int = conn.execute("PRAGMA user_version").fetchone()[0]
    for index, script in enumerate(MIGRATIONS[version:], start=version + 1):
        conn.executescript(f"BEGIN; {script}; PRAGMA user_version = {index}; COMMIT;")


# -- rows -----------------------------------------------------------------------------


def _row_dict(row: sqlite3.Row) -> dict[str, Any]:
    return dict(zip(row.keys(), tuple(row), strict=True))


def _session_from_row(row: sqlite3.Row) -> Session:
    return rows.session_from_data(_row_dict(row))


def _message_from_row(row: sqlite3.Row) -> Message:
    return rows.message_from_data(_row_dict(row))


def _turn_from_row(row: sqlite3.Row) -> Turn:
    return rows.turn_from_data(_row_dict(row))


def _tool_call_from_row(row: sqlite3.Row) -> ToolCallRecord:
    return rows.tool_call_from_data(_row_dict(row))


# -- the update log (run inside a write's savepoint) ----------------------------------


def _log(
    conn: Archive,
    out: list[Update],
    head: tuple[str, int] | sqlite3.Row | None,
    items: tuple[UpdateItem, ...],
    data_list: tuple[Entity, ...],
) -> None:
    """Store one update under the owner and offset `head` names, and report it."""
    if head is None:  # no such session: no owner's data changed
        return
    owner, offset = head
    update = rows.new_update(owner, offset, items, data_list)
    conn.execute(SQL.insert_update, rows.update_row(update))
    conn.heads.updates[owner] = offset
    out.append(update)


def _log_for_owner(
    conn: Archive,
    out: list[Update],
    owner: str,
    items: tuple[UpdateItem, ...],
    data_list: tuple[Entity, ...],
) -> None:
    last = conn.heads.updates.get(owner)
    if last is not None:
        _log(conn, out, (owner, last + 1), items, data_list)
    else:
        _log(conn, out, conn.execute(_NEXT_OFFSET, (owner,)).fetchone(), items, data_list)


def _log_for_session(
    conn: Archive,
    out: list[Update],
    session_id: str,
    items: tuple[UpdateItem, ...],
    data_list: tuple[Entity, ...],
) -> None:
    owner = conn.heads.owners.get(session_id)
    if owner is not None:
        _log_for_owner(conn, out, owner, items, data_list)
        return
    head = conn.execute(_NEXT_OFFSET_OF_SESSION, (session_id,)).fetchone()
    if head is not None:
        conn.heads.owners[session_id] = head[0]
    _log(conn, out, head, items, data_list)


# -- writes (run on the store thread) -------------------------------------------------


def _insert_message(conn: Archive, message: Message) -> Message:
    """Append `message` with the session's next global_offset (1, 2, ... without gaps)."""
    return _insert_messages(conn, (message,))[0]


@functools.cache
def _insert_messages_sql(count: int) -> str:
    columns = rows.MESSAGE_COLUMNS
    row = f"({', '.join('?' * len(columns))})"
    return f"INSERT INTO messages ({', '.join(columns)}) VALUES {', '.join([row] * count)}"


def _insert_messages(conn: Archive, messages: Sequence[Message]) -> list[Message]:
    """Append messages of one session, numbered on from its last, in one statement."""
    session_id = messages[0].session_id
    assert all(message.session_id == session_id for message in messages)
    last = conn.heads.messages.get(session_id)
    if last is None:
        (last,) = conn.execute(_LAST_MESSAGE_OFFSET, (session_id,)).fetchone()
    stored = [
        msgspec.structs.replace(message, global_offset=last + n)
        for n, message in enumerate(messages, start=1)
    ]
    values = [v for m in stored for v in rows.message_row(m)]
    conn.execute(_insert_messages_sql(len(stored)), values)
    conn.heads.messages[session_id] = last + len(stored)
    return stored


def _append_message(conn: Archive, out: list[Update], message: Message) -> Message:
    stored = _insert_message(conn, message)
    _log_for_session(conn, out, stored.session_id, *rows.changes(("created", stored)))
    return stored


def _save_turn(conn: Archive, turn: Turn) -> Action:
    """Replace in place when known (keeping the rowid, so creation order holds)."""
    row = rows.turn_row(turn)
    if conn.execute(_REPLACE_TURN, row).rowcount:
        return "updated"
    conn.execute(SQL.insert_turn, row)
    return "created"


def _create_turn(conn: Archive, turn: Turn) -> Action:
    """Insert first: a turn being created is new, so this is one statement."""
    row = rows.turn_row(turn)
    try:
        conn.execute(SQL.insert_turn, row)
    except sqlite3.IntegrityError:
        # A known id is replaced, as save_turn would; a missing session fails still.
        if not conn.execute(_REPLACE_TURN, row).rowcount:
            raise
        return "updated"
    return "created"


def _log_turn(
    save: Callable[[Archive, Turn], Action],
    conn: Archive,
    out: list[Update],
    turn: Turn,
) -> None:
    action = save(conn, turn)
    _log_for_session(conn, out, turn.session_id, *rows.changes((action, turn)))


def _begin_turn(
    conn: Archive,
    out: list[Update],
    turn: Turn,
    message: Message,
    reply: Message | None = None,
    unique_client_id: bool = False,
    started: Turn | None = None,
) -> Message:
    if unique_client_id and message.client_id:
        taken = conn.execute(SQL.owners_client_id, (message.client_id, message.session_id))
        if (row := taken.fetchone()) is not None:
            raise DuplicateClientId(message.client_id, session_id=row[0], message_id=row[1])
    # The user's message and the pending reply: one statement, which fails first on
    # a missing session.
    stored, *reply_stored = _insert_messages(
        conn, (message,) if reply is None else (message, reply)
    )
    action = _create_turn(conn, turn)
    touched = conn.execute(SQL.touch_session, (message.session_id, message.created_at))
    session = _session_from_row(touched.fetchone())
    _log_for_owner(
        conn, out, session.owner, *rows.begun_turn(stored, action, turn, session, reply_stored)
    )
    if started is not None:
        _log_for_owner(
            conn, out, session.owner, *rows.changes((_save_turn(conn, started), started))
        )
    return stored


def _save_tool_call(conn: Archive, out: list[Update], call: ToolCallRecord) -> None:
    row = rows.tool_call_row(call)
    action: Action = "updated"
    if not conn.execute(SQL.replace_tool_call, row).rowcount:
        conn.execute(SQL.insert_tool_call, row)
        action = "created"
    _log_for_session(conn, out, call.session_id, *rows.changes((action, call)))


def _replace_message(conn: Archive, message: Message) -> Message | None:
    """The stored message after its content changed; None when there is none."""
    row = conn.execute(SQL.update_message, (message.id, *rows.message_change(message))).fetchone()
    return None if row is None else _message_from_row(row)


def _update_message(conn: Archive, out: list[Update], message: Message) -> Message:
    stored = _replace_message(conn, message)
    if stored is None:
        raise StoreError(f"no message {message.id}")
    _log_for_session(conn, out, stored.session_id, *rows.changes(("updated", stored)))
    return stored


def _end_turn(conn: Archive, out: list[Update], turn: Turn, reply: Message | None) -> None:
    stored: tuple[Action, Message] | None = None
    if reply is not None:
        replaced = _replace_message(conn, reply)
        stored = (
            ("created", _insert_message(conn, reply)) if replaced is None else ("updated", replaced)
        )
    change = rows.ended_turn(turn, _save_turn(conn, turn), stored)
    _log_for_session(conn, out, turn.session_id, *change)


def _fork_session(
    conn: Archive, out: list[Update], session: Session, messages: Sequence[Message]
) -> list[Message]:
    if any(message.session_id != session.id for message in messages):
        raise StoreError(f"a forked message does not belong to session {session.id}")
    conn.execute(SQL.insert_session, rows.session_row(session))  # an existing id fails here
    created = _session_from_row(conn.execute(SQL.select_session, (session.id,)).fetchone())
    stored = [_insert_message(conn, message) for message in messages]
    _log_for_owner(conn, out, created.owner, *rows.forked(created, stored))
    return stored


# Each row leads with its session's owner (the update's owner) and the lease of the
# turn's replica (NULL: it holds none).
_UNFINISHED_TURNS = (
    "SELECT s.owner AS owner, r.last_seen AS last_seen, t.* FROM turns t "
    "JOIN sessions s ON s.id = t.session_id LEFT JOIN replicas r ON r.id = t.replica "
    f"WHERE t.{rows.UNFINISHED_TURN} ORDER BY t.created_at, t.rowid"
)
_INTERRUPT_TURN = "UPDATE turns SET state = ?, ended_at = ? WHERE id = ?"
# Open replies whose turn is not unfinished: nobody will write them again.
_ORPHANED_REPLIES = (
    "SELECT s.owner AS owner, m.* FROM messages m JOIN sessions s ON s.id = m.session_id "
    f"WHERE m.{rows.OPEN_REPLY} AND NOT EXISTS "
    f"(SELECT 1 FROM turns t WHERE t.id = m.turn_id AND t.{rows.UNFINISHED_TURN}) "
    "ORDER BY m.rowid"
)
_FAIL_REPLY = "UPDATE messages SET status = ?, updated_at = ? WHERE id = ?"


def _interrupt_orphaned_turns(
    conn: Archive,
    out: list[Update],
    now: float,
    replica_id: str,
    lease: float,
    include_own: bool,
) -> int:
    """Interrupt the orphaned turns, then fail the replies left open without a turn to
    finish them; one update per owner. One writer: nothing changes in between."""
    turns: list[tuple[str, Turn]] = []
    for row in conn.execute(_UNFINISHED_TURNS).fetchall():
        owner, data = rows.owned(_row_dict(row))
        last_seen = data.pop("last_seen")
        turn = rows.turn_from_data(data)
        if is_orphaned(
            turn.replica,
            last_seen,
            replica_id=replica_id,
            lease=lease,
            now=now,
            include_own=include_own,
        ):
            turns.append((owner, rows.interrupted(turn, now)))
    conn.executemany(_INTERRUPT_TURN, [(t.state.value, now, t.id) for _, t in turns])
    replies = [
        (owner, rows.failed(rows.message_from_data(data), now))
        for owner, data in map(rows.owned, map(_row_dict, conn.execute(_ORPHANED_REPLIES)))
    ]
    conn.executemany(_FAIL_REPLY, [(m.status, now, m.id) for _, m in replies])
    for owner, (items, entities) in rows.interruption(turns, replies):
        _log_for_owner(conn, out, owner, items, entities)
    return len(turns)


def _prune_updates(conn: Archive, out: list[Update], older_than: float) -> int:
    conn.execute(_KEEP_HEADS, (older_than,))  # so offsets go on from where they were
    return conn.execute(_PRUNE_UPDATES, (older_than,)).rowcount


def _create_session(conn: Archive, out: list[Update], session: Session) -> Session:
    inserted = conn.execute(_INSERT_SESSION_IF_ABSENT, rows.session_row(session)).rowcount
    stored = _session_from_row(conn.execute(SQL.select_session, (session.id,)).fetchone())
    if inserted:
        _log_for_owner(conn, out, stored.owner, *rows.changes(("created", stored)))
    return stored


def _touch_session(conn: Archive, out: list[Update], session_id: str, now: float) -> None:
    row = conn.execute(SQL.touch_session, (session_id, now)).fetchone()
    if row is not None:  # touching a missing session changes nothing
        session = _session_from_row(row)
        _log_for_owner(conn, out, session.owner, *rows.changes(("updated", session)))


def _update_session(conn: Archive, out: list[Update], session: Session) -> Session:
    row = conn.execute(SQL.replace_session, rows.session_row(session)).fetchone()
    if row is None:
        raise StoreError(f"no session {session.id}")
    stored = _session_from_row(row)
    _log_for_owner(conn, out, stored.owner, *rows.changes(("updated", stored)))
    return stored


# -- writes as data -------------------------------------------------------------------


class Write(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """One write: its name (the tag) and arguments, so it can cross to a writer
    process as msgpack as well as run on the store's thread. `RESULT` is the type
    `run` returns, which the store decodes a process's answer as."""

    RESULT: ClassVar[Any] = None
    # A write whose time grows with the archive (a scan, a copy, a bulk delete): the
    # inline writer runs a batch holding one on the store's thread, not on the loop.
    OFF_LOOP: ClassVar[bool] = False

    def run(self, conn: Archive, out: list[Update]) -> Any:
        raise NotImplementedError


class CreateSession(Write, frozen=True):
    RESULT = Session
    session: Session

    def run(self, conn: Archive, out: list[Update]) -> Session:
        return _create_session(conn, out, self.session)


class TouchSession(Write, frozen=True):
    session_id: str
    now: float

    def run(self, conn: Archive, out: list[Update]) -> None:
        _touch_session(conn, out, self.session_id, self.now)


class UpdateSession(Write, frozen=True):
    RESULT = Session
    session: Session

    def run(self, conn: Archive, out: list[Update]) -> Session:
        return _update_session(conn, out, self.session)


class ForkSession(Write, frozen=True):
    RESULT = list[Message]
    OFF_LOOP = True
    session: Session
    messages: tuple[Message, ...]

    def run(self, conn: Archive, out: list[Update]) -> list[Message]:
        return _fork_session(conn, out, self.session, self.messages)


class AppendMessage(Write, frozen=True):
    RESULT = Message
    message: Message

    def run(self, conn: Archive, out: list[Update]) -> Message:
        return _append_message(conn, out, self.message)


class UpdateMessage(Write, frozen=True):
    RESULT = Message
    message: Message

    def run(self, conn: Archive, out: list[Update]) -> Message:
        return _update_message(conn, out, self.message)


class BeginTurn(Write, frozen=True):
    RESULT = Message
    turn: Turn
    message: Message
    reply: Message | None
    unique_client_id: bool
    started: Turn | None

    def run(self, conn: Archive, out: list[Update]) -> Message:
        return _begin_turn(
            conn, out, self.turn, self.message, self.reply, self.unique_client_id, self.started
        )


class CreateTurn(Write, frozen=True):
    turn: Turn

    def run(self, conn: Archive, out: list[Update]) -> None:
        _log_turn(_create_turn, conn, out, self.turn)


class SaveTurn(Write, frozen=True):
    turn: Turn

    def run(self, conn: Archive, out: list[Update]) -> None:
        _log_turn(_save_turn, conn, out, self.turn)


class EndTurn(Write, frozen=True):
    turn: Turn
    reply: Message | None

    def run(self, conn: Archive, out: list[Update]) -> None:
        _end_turn(conn, out, self.turn, self.reply)


class SaveToolCall(Write, frozen=True):
    call: ToolCallRecord

    def run(self, conn: Archive, out: list[Update]) -> None:
        _save_tool_call(conn, out, self.call)


class RenewReplica(Write, frozen=True):
    replica_id: str
    now: float

    def run(self, conn: Archive, out: list[Update]) -> None:
        conn.execute(SQL.renew_replica, (self.replica_id, self.now))


class InterruptOrphanedTurns(Write, frozen=True):
    RESULT = int
    OFF_LOOP = True
    now: float
    replica_id: str
    lease: float
    include_own: bool

    def run(self, conn: Archive, out: list[Update]) -> int:
        return _interrupt_orphaned_turns(
            conn, out, self.now, self.replica_id, self.lease, self.include_own
        )


class SaveMemory(Write, frozen=True):
    RESULT = bool
    entry: MemoryEntry
    max_entries: int

    def run(self, conn: Archive, out: list[Update]) -> bool:
        return _save_memory(conn, out, self.entry, self.max_entries)


class ForgetMemory(Write, frozen=True):
    RESULT = bool
    key: MemoryKey
    memory_id: str

    def run(self, conn: Archive, out: list[Update]) -> bool:
        return conn.execute(SQL.forget_memory, (*astuple(self.key), self.memory_id)).rowcount > 0


class AppendTrace(Write, frozen=True):
    event: TraceEvent

    def run(self, conn: Archive, out: list[Update]) -> None:
        conn.execute(SQL.insert_trace, rows.trace_row(self.event))


class PruneUpdates(Write, frozen=True):
    RESULT = int
    OFF_LOOP = True
    older_than: float

    def run(self, conn: Archive, out: list[Update]) -> int:
        return _prune_updates(conn, out, self.older_than)


# Every write a writer process can be asked to run (tagged by class name).
WRITES: tuple[type[Write], ...] = (
    CreateSession,
    TouchSession,
    UpdateSession,
    ForkSession,
    AppendMessage,
    UpdateMessage,
    BeginTurn,
    CreateTurn,
    SaveTurn,
    EndTurn,
    SaveToolCall,
    RenewReplica,
    InterruptOrphanedTurns,
    SaveMemory,
    ForgetMemory,
    AppendTrace,
    PruneUpdates,
)


Pending = tuple[Write, asyncio.Future[Any], list[Update] | None]


def commit_batch(conn: Archive, writes: Sequence[Write]) -> list[Outcome]:
    """Run `writes` as one batch (`_run_batch`); a failing transaction fails them all."""
    try:
        return _run_batch(conn, [write.run for write in writes])
    except sqlite3.Error as exc:
        return [(as_store_error(exc), [])] * len(writes)


def _run_batch(conn: Archive, operations: list[Operation]) -> list[Outcome]:
    """Run every operation in one transaction; one that fails changes nothing.

    Optimistically without savepoints (two statements fewer per operation, and writes
    rarely fail); when one does, the transaction is rolled back and the batch run
    again with each operation in its own savepoint.
    """
    conn.heads.bound()
    try:
        return _run_in_transaction(conn, operations, _run_plainly)
    except _RetryWithSavepoints:
        return _run_in_transaction(conn, operations, _run_in_savepoints)


class _RetryWithSavepoints(Exception):
    """An operation of a batch run without savepoints failed."""


def _run_in_transaction(
    conn: Archive,
    operations: list[Operation],
    run: Callable[[Archive, list[Operation]], list[Outcome]],
) -> list[Outcome]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        outcomes = run(conn, operations)
        conn.execute("COMMIT")
    except BaseException:
        # Left open, the transaction would make every later BEGIN fail; and offsets
        # handed out inside it never landed.
        conn.heads.clear()
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return outcomes


def _run_plainly(conn: Archive, operations: list[Operation]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for operation in operations:
        updates: list[Update] = []
        try:
            outcomes.append((operation(conn, updates), updates))
        except Exception as exc:
            raise _RetryWithSavepoints from exc
    return outcomes


def _run_in_savepoints(conn: Archive, operations: list[Operation]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for operation in operations:
        updates: list[Update] = []
        conn.execute("SAVEPOINT op")
        try:
            result = operation(conn, updates)
            conn.execute("RELEASE op")
        # Any exception, not only sqlite3.Error: one escaping here would leave the
        # transaction open and every future of the batch unresolved.
        except Exception as exc:
            conn.execute("ROLLBACK TO op")
            conn.execute("RELEASE op")
            conn.heads.clear()  # what the failed operation numbered did not land
            outcomes.append((as_store_error(exc), []))
        else:
            outcomes.append((result, updates))
    return outcomes


SESSION_CACHE_SIZE = 10_000  # sessions kept in memory (most recently used)
CHECKPOINT_INTERVAL = 1.0  # seconds between WAL checkpoints
# WAL frames (one page, 4 KiB, each) past which a checkpoint also restarts the WAL.
WAL_RESTART_FRAMES = 4096
# Bytes a restarted WAL file is cut back to (it is reused from its start, not grown).
WAL_SIZE_LIMIT = 64 * 1024 * 1024
# Reads of a file archive that may run at once, each on a connection and thread of its
# own (`Readers`, opened as reads overlap): two long reads (a big session's page, seconds)
# still leave the others a thread. Not more: reads build their rows in Python, so more
# threads add no throughput, only contenders for the event loop's GIL (docs/performance.md).
READERS = 4
# How long a write waits for the checkpoint connection's locks.
WRITER_BUSY_TIMEOUT_MS = 5000
# How long a WAL restart waits for the reads on the WAL to end (`restart_wal`).
RESTART_BUSY_TIMEOUT_MS = 20


def _lock_archive(path: str) -> IO[bytes]:
    """Hold `<archive>.lock` for as long as the store is open.

    The store assumes it is the archive's one writer (it caches sessions and numbers
    messages itself): a second server on the same data dir is refused, not let in.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    lock = open(f"{path}.lock", "wb")  # noqa: SIM115 - held open until close()
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise StoreError(f"the archive at {path} is in use by another Portico process") from None
    return lock


def checkpoint(conn: sqlite3.Connection, mode: str) -> int:
    """Run a checkpoint; returns how many frames the WAL holds."""
    _busy, frames, _copied = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
    return int(frames)


def restart_wal(conn: Archive) -> None:
    """Restart the WAL from the writing connection, between two batches, if no read is
    on it: a RESTART waits for every read of the WAL to end, holding the writer, so a
    long read beside it (a big page, seconds) would stall every write for as long. It
    waits a moment (a short read ends in it), then gives up until the next checkpoint;
    what it copied stays copied."""
    conn.execute(f"PRAGMA busy_timeout={RESTART_BUSY_TIMEOUT_MS}")
    try:
        checkpoint(conn, "RESTART")
    finally:
        conn.execute(f"PRAGMA busy_timeout={WRITER_BUSY_TIMEOUT_MS}")


class _SessionCache:
    """Sessions as last committed, so a message does not cost a read of its session.

    One process owns the archive file, and every write that changes a session logs
    the stored session in its update: the cache learns from the committed updates.
    A read that raced a session write (the generation moved) is not cached.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.generation = 0

    def get(self, session_id: str) -> Session | None:
        session = self._sessions.get(session_id)
        if session is not None:
            self._sessions.move_to_end(session_id)
        return session

    def learn(self, updates: list[Update]) -> None:
        for update in updates:
            for entity in update.data_list:
                if isinstance(entity, Session):
                    self.generation += 1
                    self._put(entity)

    def offer(self, session: Session, generation: int) -> None:
        if generation == self.generation:
            self._put(session)

    def _put(self, session: Session) -> None:
        self._sessions[session.id] = session
        self._sessions.move_to_end(session.id)
        if len(self._sessions) > self._size:
            self._sessions.popitem(last=False)


DEFAULT_WRITER: SqliteWriter = "auto"
# Seconds between a writer process's death and the start of the next one (and between
# two failed starts): writes fail at once meanwhile, none waits for it.
RESPAWN_DELAY = 1.0


def writer_for(kind: SqliteWriter) -> Literal["inline", "process", "thread"]:
    """Where writes run. `auto`: a process of its own when this server may run on two
    CPUs or more, where the writer's Python (rows, updates, statements) then runs
    beside the event loop instead of taking its GIL (stream throughput +20 % on a quiet
    2-core machine, docs/performance.md); on one CPU the thread, where a process would
    only add a pipe's round trip to every batch."""
    if kind != "auto":
        return kind
    return "process" if usable_cpus() >= 2 else "thread"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def connect_writer(path: str, wal_size_limit: int) -> Archive:
    """The archive's one writing connection, schema migrated."""
    if path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, factory=Archive)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    # NORMAL under WAL is durable across process crashes; only an OS crash
    # can lose the last commits, which is the usual trade for chat archives.
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    # Checkpoints (copying the WAL into the database, with fsyncs) run on a thread
    # of their own: run by the commit that crosses the threshold, they stalled that
    # commit and every write queued behind it for milliseconds (the p99 of turns).
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute(f"PRAGMA journal_size_limit={wal_size_limit}")
    # A passive checkpoint reading the WAL may hold a lock for a moment: wait for it.
    conn.execute(f"PRAGMA busy_timeout={WRITER_BUSY_TIMEOUT_MS}")
    _migrate(conn)
    # The archive lock lets no other process in, so no other replica is alive: the
    # turns left unfinished are a stopped server's, orphans from the start.
    conn.execute("DELETE FROM replicas")
    return conn


def connect_reader(path: str) -> Archive:
    """A read-only connection: a reader beside the owner, or the owner's own reads
    while its writer is a process (WAL lets readers run beside the writer)."""
    uri = f"{Path(path).absolute().as_uri()}?mode=ro"
    conn = sqlite3.connect(
        uri, uri=True, isolation_level=None, check_same_thread=False, factory=Archive
    )
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout={WRITER_BUSY_TIMEOUT_MS}")
    return conn


class Readers:
    """Where the store's reads run: read-only connections of their own, one per thread
    of a small pool, opened on a thread's first read (WAL lets them read beside the one
    writer and beside each other). Every writer reads this way, so a long read (a page
    of a big session) holds neither the writes, whose `done` waits for a COMMIT, nor
    more than one reading thread. Each read statement takes a fresh snapshot: it sees
    every commit acknowledged before it started, so a caller reads its own writes.

    An in-memory archive cannot be shared with a second connection: its reads run on
    the writing connection and thread, between batches (`shared`).
    """

    def __init__(
        self, executor: ThreadPoolExecutor, connect: Callable[[], Archive], *, owned: bool
    ) -> None:
        self._executor = executor
        self._connect = connect
        self._owned = owned  # the pool's own threads and connections, closed with it
        self._local = threading.local()
        self._opened: list[Archive] = []

    @classmethod
    def pool(cls, path: str, size: int) -> Readers:
        executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="portico-read")
        return cls(executor, functools.partial(connect_reader, path), owned=True)

    @classmethod
    def shared(cls, conn: Archive, executor: ThreadPoolExecutor) -> Readers:
        return cls(executor, lambda: conn, owned=False)

    def _connection(self) -> Archive:
        """The calling thread's connection: a connection is used by one thread only."""
        conn: Archive | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
            self._opened.append(conn)
        return conn

    async def run(self, fn: Callable[[Archive], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: fn(self._connection())
        )

    async def close(self) -> None:
        """Once the reads running have ended (a cancelled read runs to its end)."""
        if self._owned:
            await asyncio.to_thread(self._executor.shutdown)
            for conn in self._opened:
                conn.close()
        self._opened.clear()


class BatchWriter(Protocol):
    """Where the store's batches run: its own thread, or a writer process."""

    @property
    def pid(self) -> int | None:
        """The writer process's id; None for the thread."""

    async def run_batch(self, writes: list[Write]) -> list[Outcome]:
        """Each write's outcome, in order; raises StoreError when it cannot run any."""

    async def restart_wal(self) -> None:
        """Restart the WAL from the writing connection, between two batches."""

    async def close(self) -> None: ...

    def health(self) -> Health: ...


class ThreadWriter:
    """Batches on a thread of the store's, on the writing connection (reads run beside
    it, on connections of their own: `Readers`)."""

    def __init__(self, conn: Archive, executor: ThreadPoolExecutor, read_only: bool) -> None:
        self._conn = conn
        self._executor = executor
        self._read_only = read_only

    @property
    def pid(self) -> int | None:
        return None

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def run_batch(self, writes: list[Write]) -> list[Outcome]:
        return await self._in_thread(functools.partial(commit_batch, self._conn, writes))

    async def restart_wal(self) -> None:
        await self._in_thread(functools.partial(restart_wal, self._conn))

    async def close(self) -> None:
        if not self._read_only:
            # The owner, closing, checkpoints the WAL into the database file.
            await self._in_thread(functools.partial(checkpoint, self._conn, "TRUNCATE"))
        await self._in_thread(self._conn.close)

    def health(self) -> Health:
        return IN_PROCESS


class InlineWriter(ThreadWriter):
    """Batches on the event loop's own thread, on a writing connection of their own.

    A batch of the usual writes is a few statements and a COMMIT without fsync (WAL,
    `synchronous=NORMAL`): tens of microseconds, less than the hand-off to a thread
    and back (the submit, the thread's wake-up, its wait for the GIL while the loop
    runs Python, `call_soon_threadsafe` home). Group commit is unchanged: the store's
    committer runs once per loop pass, so every write queued before it shares its
    transaction. What may take long stays off the loop, on the store's thread with
    this connection: the WAL restart and the TRUNCATE at close (a checkpoint copies
    pages and syncs), and any batch holding a write whose time grows with the archive
    (`Write.OFF_LOOP`). They run on a thread of the writer's own, and no batch runs on
    the loop meanwhile (`_on_thread`). Reads run on the store's `Readers`.
    """

    def __init__(self, conn: Archive) -> None:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portico-writer")
        super().__init__(conn, executor, read_only=False)
        self._on_thread = asyncio.Lock()

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        async with self._on_thread:
            return await super()._in_thread(fn)

    async def run_batch(self, writes: list[Write]) -> list[Outcome]:
        if any(write.OFF_LOOP for write in writes):
            return await super().run_batch(writes)
        # Uncontended, the lock is taken without a yield: the batch runs now.
        async with self._on_thread:
            return commit_batch(self._conn, writes)

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=True)


class SqliteStore:
    def __init__(
        self,
        path: str | Path,
        *,
        checkpoint_interval: float = CHECKPOINT_INTERVAL,
        wal_restart_frames: int = WAL_RESTART_FRAMES,
        wal_size_limit: int = WAL_SIZE_LIMIT,
        read_only: bool = False,
        writer: SqliteWriter = DEFAULT_WRITER,
        readers: int = READERS,
        respawn_delay: float = RESPAWN_DELAY,
    ) -> None:
        """`read_only`: a reader beside the server that owns the archive (it takes no
        lock, runs no migration or checkpoint; writes fail). `writer`: where writes run,
        the store's thread, the event loop's thread or a process of their own (an
        in-memory archive and a reader always use the store's thread: neither can be
        shared with a second connection). `readers`: how many reads may run at once,
        each on a connection and thread of its own (`Readers`). `respawn_delay`: seconds
        before a writer process that died is started again."""
        self._path = str(path)
        self._read_only = read_only
        self._wal_size_limit = wal_size_limit
        self._checkpoint_interval = checkpoint_interval
        self._wal_restart_frames = wal_restart_frames
        in_file = self._path != ":memory:" and not read_only
        self._writer_kind = writer_for(writer) if in_file else "thread"
        self._respawn_delay = respawn_delay
        self._readers_size = readers
        # Opens the archive; with the thread writer, runs its batches.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portico-sqlite")
        self._readers: Readers | None = None
        self._writer: BatchWriter | None = None
        self._epoch = ""
        self._pending: list[Pending] = []
        self._committer: asyncio.Task[None] | None = None
        self._listener: UpdateListener | None = None
        self._sessions = _SessionCache(SESSION_CACHE_SIZE)
        self._checkpointer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portico-wal")
        self._checkpoints: asyncio.Task[None] | None = None
        self._supervisor: asyncio.Task[None] | None = None  # the writer process's
        self._lock: IO[bytes] | None = None

    # -- plumbing ---------------------------------------------------------------

    def _connect(self) -> Archive:
        if self._read_only:
            return connect_reader(self._path)
        return connect_writer(self._path, self._wal_size_limit)

    def _checkpoint_connection(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout=1000")
        return conn

    async def _checkpoint_periodically(self) -> None:
        loop = asyncio.get_running_loop()
        conn = await loop.run_in_executor(self._checkpointer, self._checkpoint_connection)
        try:
            while True:
                await asyncio.sleep(self._checkpoint_interval)
                try:
                    await self._checkpoint_once(conn)
                except (sqlite3.Error, StoreError):
                    log.exception("archive checkpoint failed; tried again in a moment")
        finally:
            await loop.run_in_executor(self._checkpointer, conn.close)

    async def _checkpoint_once(self, conn: sqlite3.Connection) -> None:
        """PASSIVE copies what it can without waiting for (or blocking) the writer. But
        a writer that never pauses never lets it restart the WAL, which then grows
        without end (GBs under load, every page lookup slower): once the WAL is long,
        the writing connection runs a RESTART between two batches (no other writer,
        no reader to wait for), copies the few frames PASSIVE left, and the next write
        starts the WAL from its beginning."""
        loop = asyncio.get_running_loop()
        frames = await loop.run_in_executor(self._checkpointer, checkpoint, conn, "PASSIVE")
        if frames > self._wal_restart_frames:
            # The RESTART holds the writer while it fsyncs the frames written since the
            # last PASSIVE: up to an interval of them (10-20 ms on a slow disk, and every
            # `done` waits). A second PASSIVE first copies and syncs what came in during
            # the first one's fsync, beside the writer, so the RESTART syncs only the
            # frames of the last few milliseconds (docs/performance.md, "The WAL's fsyncs").
            await loop.run_in_executor(self._checkpointer, checkpoint, conn, "PASSIVE")
            await self._batch_writer().restart_wal()

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _read(self, fn: Callable[[Archive], T]) -> T:
        if self._readers is None:
            raise StoreError("the archive is not open")
        try:
            return await self._readers.run(fn)
        except sqlite3.Error as exc:
            raise StoreError("archive read failed") from exc

    async def _write(self, write: Write) -> Any:
        """`write`'s result once its batch committed (and its updates were published).
        Typed by the caller: the store's methods name what each write returns."""
        self._batch_writer()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # The collector is read here, in the caller's context: the committer task
        # runs in a context of its own.
        self._pending.append((write, future, current_collector()))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_pending())
        return await future

    def _batch_writer(self) -> BatchWriter:
        if self._writer is None:
            raise StoreError("the archive is not open")
        return self._writer

    async def _commit_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            writes = [write for write, _, _ in batch]
            try:
                outcomes = await self._batch_writer().run_batch(writes)
            except StoreError as exc:
                outcomes = [(exc, [])] * len(batch)
            for (_, future, collector), (outcome, updates) in zip(batch, outcomes, strict=True):
                if updates:
                    # Before the future resolves: the caller reads its collector
                    # as soon as the write it awaited returns.
                    self._publish(updates, collector)
                if future.done():
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    def _publish(self, updates: list[Update], collector: list[Update] | None) -> None:
        self._sessions.learn(updates)
        publish(updates, collector, self._listener)

    def set_update_listener(self, listener: UpdateListener | None) -> None:
        self._listener = listener

    # -- lifecycle --------------------------------------------------------------

    async def open(self) -> None:
        if self._path != ":memory:" and not self._read_only:
            self._lock = _lock_archive(self._path)
        try:
            self._writer, self._readers = await self._start_writer()
            # The first read, which opens the first reading connection.
            self._epoch = await self._read(
                lambda conn: str(conn.execute("SELECT epoch FROM meta").fetchone()[0])
            )
        except (sqlite3.Error, StoreError) as exc:
            await self._close_connections()
            self._unlock()
            raise StoreError(f"cannot open the archive at {self._path}: {exc}") from exc
        if self._path != ":memory:" and not self._read_only:
            self._checkpoints = asyncio.create_task(self._checkpoint_periodically())

    async def _start_writer(self) -> tuple[BatchWriter, Readers]:
        """The writer (its schema migrated), and where reads run."""
        if self._writer_kind == "process":
            process = await self._start_process()
            self._supervisor = asyncio.create_task(self._supervise(process))
            writer: BatchWriter = process
        else:
            # Opened (and migrated) on the store's thread; inline, used on the loop after.
            conn = await self._in_thread(self._connect)
            if self._writer_kind == "inline":
                writer = InlineWriter(conn)
            else:
                writer = ThreadWriter(conn, self._executor, self._read_only)
            if self._path == ":memory:":
                return writer, Readers.shared(conn, self._executor)
        return writer, Readers.pool(self._path, self._readers_size)

    async def _start_process(self) -> ProcessWriter:
        # Imported here: it imports this module (the writer process runs its writes).
        from portico.store.sqlite_process import ProcessWriter

        return await ProcessWriter.start(self._path, self._wal_size_limit)

    async def _supervise(self, writer: ProcessWriter) -> None:
        """Start the writer process again whenever it dies (OOM-killed, say): the writes
        it had not answered failed with StoreError, as do those sent until the next one
        greets; none waits. Each write is one transaction, so a write that failed was
        either committed whole or not at all (the client's retry of a message finds it
        by its client id)."""
        while True:
            reason = await writer.stopped()
            log.error("%s; a new one starts in %.1f s", reason, self._respawn_delay)
            writer = await self._restarted_process()
            self._writer = writer
            log.info("the archive writer process started again pid=%d", writer.pid)

    async def _restarted_process(self) -> ProcessWriter:
        """A new writer process, tried every `respawn_delay` until one starts."""
        while True:
            await asyncio.sleep(self._respawn_delay)
            try:
                return await self._start_process()
            except (StoreError, OSError) as exc:
                log.error("%s; tried again in %.1f s", exc, self._respawn_delay)

    @property
    def writer_pid(self) -> int | None:
        """The writer process's id while open (None: writes run in this process)."""
        return None if self._writer is None else self._writer.pid

    async def health(self, within: float) -> Health:
        """A file beside this process: ready once open and while its writer runs (a
        failing disk fails the writes)."""
        if self._writer is None:
            return Health(False, "not open")
        return self._writer.health()

    async def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.cancel()
            await asyncio.gather(self._checkpoints, return_exceptions=True)
        if self._committer is not None:
            await self._committer
        await self._close_connections()
        self._executor.shutdown(wait=True)
        self._checkpointer.shutdown(wait=True)
        self._unlock()

    async def _close_connections(self) -> None:
        if self._readers is not None:
            readers, self._readers = self._readers, None
            await readers.close()
        if self._supervisor is not None:  # closing the writer is not its death
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self._writer is not None:
            writer, self._writer = self._writer, None
            await writer.close()

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases its lock
            self._lock = None

    # -- sessions ---------------------------------------------------------------

    async def create_session(self, session: Session) -> Session:
        stored: Session = await self._write(CreateSession(session))
        return stored

    async def get_session(self, session_id: str) -> Session | None:
        cached = self._sessions.get(session_id)
        if cached is not None:
            return cached

        def select(conn: Archive) -> Session | None:
            row = conn.execute(SQL.select_session, (session_id,)).fetchone()
            return None if row is None else _session_from_row(row)

        generation = self._sessions.generation
        found = await self._read(select)
        if found is not None:
            self._sessions.offer(found, generation)
        return found

    async def list_sessions(
        self, owner: str, *, limit: int, cursor: str = "", include_deleted: bool = True
    ) -> list[Session]:
        statement = sql.list_sessions(sql.SQLITE, include_deleted, bool(cursor))
        args = sql.page_args(owner, limit, cursor)

        def select(conn: Archive) -> list[Session]:
            return [_session_from_row(row) for row in conn.execute(statement, args).fetchall()]

        return await self._read(select)

    async def touch_session(self, session_id: str, now: float) -> None:
        await self._write(TouchSession(session_id, now))

    async def update_session(self, session: Session) -> Session:
        stored: Session = await self._write(UpdateSession(session))
        return stored

    async def fork_session(self, session: Session, messages: Sequence[Message]) -> list[Message]:
        stored: list[Message] = await self._write(ForkSession(session, tuple(messages)))
        return stored

    # -- messages ---------------------------------------------------------------

    async def append_message(self, message: Message) -> Message:
        stored: Message = await self._write(AppendMessage(message))
        return stored

    async def update_message(self, message: Message) -> Message:
        stored: Message = await self._write(UpdateMessage(message))
        return stored

    async def get_message(self, message_id: str) -> Message | None:
        def select(conn: Archive) -> Message | None:
            row = conn.execute(SQL.get_message, (message_id,)).fetchone()
            return None if row is None else _message_from_row(row)

        return await self._read(select)

    async def find_message_by_client_id(self, owner: str, client_id: str) -> Message | None:
        if not client_id:
            return None

        def select(conn: Archive) -> Message | None:
            row = conn.execute(SQL.find_by_client_id, (client_id, owner)).fetchone()
            return None if row is None else _message_from_row(row)

        return await self._read(select)

    async def begin_turn(
        self,
        turn: Turn,
        message: Message,
        *,
        reply: Message | None = None,
        unique_client_id: bool = False,
        started: Turn | None = None,
    ) -> Message:
        # One write, one hop to the writer, and all or nothing (each write is a savepoint).
        stored: Message = await self._write(
            BeginTurn(turn, message, reply, unique_client_id, started)
        )
        return stored

    async def list_messages(
        self, session_id: str, *, after_offset: int = 0, limit: int | None = None
    ) -> list[Message]:
        def select(conn: Archive) -> list[Message]:
            # A negative LIMIT is none in SQLite.
            args = (session_id, after_offset, -1 if limit is None else limit)
            found = conn.execute(SQL.list_messages, args).fetchall()
            return [_message_from_row(row) for row in found]

        return await self._read(select)

    # -- turns ------------------------------------------------------------------

    async def create_turn(self, turn: Turn) -> None:
        await self._write(CreateTurn(turn))

    async def save_turn(self, turn: Turn) -> None:
        await self._write(SaveTurn(turn))

    async def end_turn(self, turn: Turn, reply: Message | None) -> None:
        await self._write(EndTurn(turn, reply))

    async def get_turn(self, turn_id: str) -> Turn | None:
        def select(conn: Archive) -> Turn | None:
            row = conn.execute(SQL.get_turn, (turn_id,)).fetchone()
            return None if row is None else _turn_from_row(row)

        return await self._read(select)

    async def list_turns(self, session_id: str) -> list[Turn]:
        def select(conn: Archive) -> list[Turn]:
            found = conn.execute(SQL.list_turns, (session_id,)).fetchall()
            return [_turn_from_row(row) for row in found]

        return await self._read(select)

    async def page_turns(self, session_id: str, *, limit: int, cursor: str = "") -> list[Turn]:
        statement = sql.page(sql.SQLITE, "turns", bool(cursor))
        args = sql.page_args(session_id, limit, cursor)

        def select(conn: Archive) -> list[Turn]:
            return [_turn_from_row(row) for row in conn.execute(statement, args).fetchall()]

        return await self._read(select)

    # -- tool calls -------------------------------------------------------------

    async def save_tool_call(self, call: ToolCallRecord) -> None:
        await self._write(SaveToolCall(call))

    async def get_tool_call(self, call_id: str) -> ToolCallRecord | None:
        def select(conn: Archive) -> ToolCallRecord | None:
            row = conn.execute(SQL.get_tool_call, (call_id,)).fetchone()
            return None if row is None else _tool_call_from_row(row)

        return await self._read(select)

    async def list_tool_calls(self, session_id: str) -> list[ToolCallRecord]:
        def select(conn: Archive) -> list[ToolCallRecord]:
            found = conn.execute(SQL.list_tool_calls, (session_id,)).fetchall()
            return [_tool_call_from_row(row) for row in found]

        return await self._read(select)

    async def page_tool_calls(
        self, session_id: str, *, limit: int, cursor: str = ""
    ) -> list[ToolCallRecord]:
        statement = sql.page(sql.SQLITE, "tool_calls", bool(cursor))
        args = sql.page_args(session_id, limit, cursor)

        def select(conn: Archive) -> list[ToolCallRecord]:
            return [_tool_call_from_row(row) for row in conn.execute(statement, args).fetchall()]

        return await self._read(select)

    async def renew_replica(self, replica_id: str, now: float) -> None:
        await self._write(RenewReplica(replica_id, now))

    async def interrupt_orphaned_turns(
        self, now: float, *, replica_id: str, lease: float, include_own: bool = False
    ) -> int:
        interrupted: int = await self._write(
            InterruptOrphanedTurns(now, replica_id, lease, include_own)
        )
        return interrupted

    # -- agent memory -------------------------------------------------------------

    async def save_memory(self, entry: MemoryEntry, *, max_entries: int) -> bool:
        saved: bool = await self._write(SaveMemory(entry, max_entries))
        return saved

    async def search_memory(self, key: MemoryKey, query: str, *, limit: int) -> list[MemoryEntry]:
        def select(conn: Archive) -> list[MemoryEntry]:
            found = conn.execute(SQL.search_memory, (*astuple(key), query, limit)).fetchall()
            return [rows.memory_from_row(_row_dict(row)) for row in found]

        return await self._read(select)

    async def forget_memory(self, key: MemoryKey, memory_id: str) -> bool:
        forgotten: bool = await self._write(ForgetMemory(key, memory_id))
        return forgotten

    # -- session traces -----------------------------------------------------------

    async def append_trace(self, event: TraceEvent) -> None:
        await self._write(AppendTrace(event))

    async def list_trace(self, session_id: str, owner: str, *, limit: int) -> list[TraceEvent]:
        def select(conn: Archive) -> list[TraceEvent]:
            found = conn.execute(SQL.select_trace, (session_id, owner, limit)).fetchall()
            return [rows.trace_from_row(_row_dict(row)) for row in found]

        return await self._read(select)

    # -- the update log ---------------------------------------------------------

    async def update_log(self, owner: str) -> UpdateLog:
        def select(conn: Archive) -> tuple[int, int | None]:
            last, first = conn.execute(_UPDATE_LOG, (owner,)).fetchone()
            return last, first

        return rows.update_log(self._epoch, *await self._read(select))

    async def list_updates(self, owner: str, *, after_offset: int, limit: int) -> list[Update]:
        def select(conn: Archive) -> list[Update]:
            found = conn.execute(SQL.select_updates, (owner, after_offset, limit)).fetchall()
            return [rows.update_from_row(row) for row in found]

        return await self._read(select)

    async def prune_updates(self, older_than: float) -> int:
        pruned: int = await self._write(PruneUpdates(older_than))
        return pruned
