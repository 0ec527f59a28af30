"""The SQLite archive's writes and the batches they run in, on the one writing connection.

The store (store/sqlite.py) runs these batches on a thread of its own or on the event
loop's thread; the writer process (store/sqlite_process.py) runs the same ones in a
process of its own. This module is what the writing side needs and none of the store's
own machinery (threads, readers, the writer process's handle), so the writer process
imports little and starts fast.

Each write is a `Write` struct (its name and arguments), so it can cross to the writer
process as data. Writes are grouped: every write queued while the previous batch was
committing goes into the next single transaction (group commit, `commit_batch`), and one
failing write fails alone. Each write appends its updates to the owner's log inside its
own savepoint, so a write that rolls back leaves no update and takes no offset; the
updates are handed on only after the commit.
"""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

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
)
from portico.domain.trace import TraceEvent
from portico.errors import DuplicateClientId, StoreError
from portico.store import rows, sql
from portico.store.base import as_store_error, is_orphaned

# Sessions and owners whose last offsets the writer remembers; past this it forgets all.
HEADS_SIZE = 50_000


class Heads:
    """The last message offset of each session and update offset of each owner.

    The archive has one writer (the store's thread or writer process; the store's lock
    on the archive keeps other processes out), so it can number the next message and
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
LAST_OFFSET_OF = (
    "MAX(COALESCE((SELECT MAX(log_offset) FROM updates WHERE owner = {0}), 0), "
    "COALESCE((SELECT last_offset FROM update_heads WHERE owner = {0}), 0))"
)
# The owner's next offset, by owner or by session id (no row when the session is
# missing). A separate read: an INSERT ... RETURNING buffers through a temporary
# table and measured slower than the two statements.
_NEXT_OFFSET = f"SELECT ?1, 1 + {LAST_OFFSET_OF.format('?1')}"
_NEXT_OFFSET_OF_SESSION = (
    f"SELECT s.owner, 1 + {LAST_OFFSET_OF.format('s.owner')} FROM sessions s WHERE s.id = ?"
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


def row_dict(row: sqlite3.Row) -> dict[str, Any]:
    return dict(zip(row.keys(), tuple(row), strict=True))


def session_from_row(row: sqlite3.Row) -> Session:
    return rows.session_from_data(row_dict(row))


def message_from_row(row: sqlite3.Row) -> Message:
    return rows.message_from_data(row_dict(row))


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


# -- writes (run on the writing connection) ------------------------------------------


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
    session = session_from_row(touched.fetchone())
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
    return None if row is None else message_from_row(row)


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
    created = session_from_row(conn.execute(SQL.select_session, (session.id,)).fetchone())
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
        owner, data = rows.owned(row_dict(row))
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
        for owner, data in map(rows.owned, map(row_dict, conn.execute(_ORPHANED_REPLIES)))
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
    stored = session_from_row(conn.execute(SQL.select_session, (session.id,)).fetchone())
    if inserted:
        _log_for_owner(conn, out, stored.owner, *rows.changes(("created", stored)))
    return stored


def _touch_session(conn: Archive, out: list[Update], session_id: str, now: float) -> None:
    row = conn.execute(SQL.touch_session, (session_id, now)).fetchone()
    if row is not None:  # touching a missing session changes nothing
        session = session_from_row(row)
        _log_for_owner(conn, out, session.owner, *rows.changes(("updated", session)))


def _update_session(conn: Archive, out: list[Update], session: Session) -> Session:
    row = conn.execute(SQL.replace_session, rows.session_row(session)).fetchone()
    if row is None:
        raise StoreError(f"no session {session.id}")
    stored = session_from_row(row)
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


# How long a write waits for the checkpoint connection's locks.
WRITER_BUSY_TIMEOUT_MS = 5000
# How long a WAL restart waits for the reads on the WAL to end (`restart_wal`).
RESTART_BUSY_TIMEOUT_MS = 20


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
