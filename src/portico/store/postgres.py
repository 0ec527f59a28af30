"""PostgreSQL archive, the scale-out backend: several replicas share one database.

Nothing is numbered or cached in the process. A session's next message offset and
an owner's next update offset live in counter rows (`message_heads`, `update_heads`)
that a write bumps with an upsert inside its own transaction: the row stays locked
until that transaction ends, so writers of one session (or one owner), on any
replica, take consecutive numbers one after the other, and a write that rolls back
gives its number back.

Writes go through one writer task per process (group commit): every write queued while
a batch commits goes into the next transaction, in queue order; `begin_turn` and
`end_turn` of distinct sessions are merged into set-wise statements, one round trip
each for the whole run of them. A write's updates are published after its batch's
commit and before it returns. Reads are one statement at READ COMMITTED. Decisions and
what replicas do not share yet: docs/storage.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import asyncpg
import msgspec
from asyncpg.pool import PoolConnectionProxy

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
from portico.domain.states import TurnState
from portico.domain.trace import TraceEvent
from portico.errors import DuplicateClientId, StoreError
from portico.health import Health, probe
from portico.store import rows, sql
from portico.store.base import (
    UpdateListener,
    as_store_error,
    current_collector,
    detached,
    is_orphaned,
    publish,
)

log = logging.getLogger("portico.store")

T = TypeVar("T")
# Strings: asyncpg's classes are generic only in its stubs.
Connection: TypeAlias = "PoolConnectionProxy[asyncpg.Record]"
# A write runs inside its transaction and appends the updates it logged to the list.
Operation: TypeAlias = "Callable[[Connection, list[Update]], Awaitable[T]]"
POOL_SIZE = 10  # connections per process (each write holds one for its transaction)
# What a broken or unreachable database raises, besides errors the server reports.
_DRIVER_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)

# Each entry upgrades the schema by one version (recorded in `schema_migrations`).
# Ids compare bytewise (COLLATE "C"), as in SQLite, so pages keep the same order
# whatever the database's locale. JSON is `json`, which keeps the text msgspec wrote:
# `jsonb` would rewrite numbers (1e20 comes back an integer) and refuse \u0000.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE meta (
        id integer PRIMARY KEY CHECK (id = 1),
        epoch text NOT NULL
    );
    INSERT INTO meta (id, epoch) VALUES (1, 'epoch-' || replace(gen_random_uuid()::text, '-', ''));
    CREATE TABLE sessions (
        id text COLLATE "C" PRIMARY KEY,
        owner text COLLATE "C" NOT NULL,
        agent text NOT NULL,
        created_at double precision NOT NULL,
        updated_at double precision NOT NULL,
        last_activity_at double precision NOT NULL,
        title text NOT NULL,
        status text NOT NULL,
        closed_at double precision,
        deleted_at double precision,
        client_session_id text NOT NULL,
        parent_session_id text NOT NULL,
        root_session_id text NOT NULL,
        forked_from_message_id text NOT NULL,
        declare json
    );
    CREATE INDEX sessions_owner_created ON sessions (owner, created_at, id);
    CREATE TABLE message_heads (
        session_id text COLLATE "C" PRIMARY KEY REFERENCES sessions (id),
        last_offset bigint NOT NULL
    );
    CREATE TABLE messages (
        seq bigint GENERATED ALWAYS AS IDENTITY,
        id text COLLATE "C" PRIMARY KEY,
        session_id text COLLATE "C" NOT NULL REFERENCES sessions (id),
        role text NOT NULL,
        content text NOT NULL,
        created_at double precision NOT NULL,
        updated_at double precision NOT NULL,
        turn_id text NOT NULL,
        client_id text NOT NULL,
        content_type text NOT NULL,
        parts json NOT NULL,
        metadata json NOT NULL,
        status text NOT NULL,
        global_offset bigint NOT NULL,
        turn_offset bigint NOT NULL,
        parent_message_id text NOT NULL,
        UNIQUE (session_id, global_offset)
    );
    CREATE INDEX messages_client_id ON messages (client_id) WHERE client_id <> '';
    CREATE INDEX messages_open ON messages (status) WHERE status IN ('pending', 'streaming');
    CREATE TABLE turns (
        seq bigint GENERATED ALWAYS AS IDENTITY,
        id text COLLATE "C" PRIMARY KEY,
        session_id text COLLATE "C" NOT NULL REFERENCES sessions (id),
        state text NOT NULL,
        created_at double precision NOT NULL,
        started_at double precision,
        ended_at double precision,
        error_code text NOT NULL,
        error_message text NOT NULL,
        merged_into text NOT NULL,
        input_tokens bigint NOT NULL,
        output_tokens bigint NOT NULL
    );
    CREATE INDEX turns_session ON turns (session_id, created_at, seq);
    CREATE TABLE tool_calls (
        seq bigint GENERATED ALWAYS AS IDENTITY,
        id text COLLATE "C" PRIMARY KEY,
        session_id text COLLATE "C" NOT NULL REFERENCES sessions (id),
        turn_id text NOT NULL,
        name text NOT NULL,
        arguments json NOT NULL,
        state text NOT NULL,
        created_at double precision NOT NULL,
        updated_at double precision NOT NULL,
        consent_message text,
        categories json NOT NULL,
        result json NOT NULL,
        error text NOT NULL,
        message_id text NOT NULL,
        client_id text NOT NULL
    );
    CREATE INDEX tool_calls_session ON tool_calls (session_id, created_at, seq);
    CREATE TABLE update_heads (
        owner text COLLATE "C" PRIMARY KEY,
        last_offset bigint NOT NULL
    );
    CREATE TABLE updates (
        owner text COLLATE "C" NOT NULL,
        log_offset bigint NOT NULL,
        id text NOT NULL,
        items json NOT NULL,
        data_list json NOT NULL,
        created_at double precision NOT NULL,
        PRIMARY KEY (owner, log_offset)
    );
    CREATE INDEX updates_created ON updates (created_at);
    """,
    # Turns name the replica running them; replicas hold leases (store/base.py). The
    # index keeps the orphan sweep to unfinished turns; its predicate is
    # rows.UNFINISHED_TURN.
    """
    ALTER TABLE turns ADD COLUMN replica text COLLATE "C" NOT NULL DEFAULT '';
    CREATE INDEX turns_unfinished ON turns (replica)
        WHERE state NOT IN ('cancelled', 'completed', 'failed', 'interrupted', 'merged');
    CREATE TABLE replicas (
        id text COLLATE "C" PRIMARY KEY,
        last_seen double precision NOT NULL
    );
    """,
    # The session-binding claim's value of the token that opened the session.
    """
    ALTER TABLE sessions ADD COLUMN binding text COLLATE "C" NOT NULL DEFAULT '';
    """,
    # Agent memory (domain/memory.py) and session traces (domain/trace.py). A trace may
    # start before its session is stored, so it references no session row.
    """
    CREATE TABLE memories (
        id text COLLATE "C" PRIMARY KEY,
        principal text COLLATE "C" NOT NULL,
        agent text COLLATE "C" NOT NULL,
        facet text COLLATE "C" NOT NULL,
        content text COLLATE "C" NOT NULL,
        created_at double precision NOT NULL
    );
    CREATE INDEX memories_key ON memories (principal, agent, facet, created_at);
    CREATE TABLE traces (
        seq bigserial PRIMARY KEY,
        session_id text COLLATE "C" NOT NULL,
        owner text COLLATE "C" NOT NULL,
        kind text NOT NULL,
        at double precision NOT NULL,
        data json NOT NULL
    );
    CREATE INDEX traces_session ON traces (session_id, seq);
    """,
)

_MIGRATIONS_TABLE = (
    "CREATE TABLE IF NOT EXISTS schema_migrations "
    "(version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
)
# Replicas starting together migrate one after the other (per schema).
_MIGRATION_LOCK = (
    "SELECT pg_advisory_xact_lock(hashtextextended('portico:' || current_schema(), 0))"
)


SQL = sql.Statements(sql.POSTGRES)
# By time, on `updates_created` (SQLite walks its log in rowid order instead: its
# commits write every page they touch in full, and the index cost a page per update).
_PRUNE_UPDATES = "DELETE FROM updates WHERE created_at < $1"


def _upsert_sql(table: str, columns: Sequence[str]) -> str:
    """Insert, or replace every column but `id` (the first); says which it did."""
    assignments = ", ".join(f"{column} = excluded.{column}" for column in columns[1:])
    return (
        f"{sql.insert(sql.POSTGRES, table, columns)} "
        f"ON CONFLICT (id) DO UPDATE SET {assignments} RETURNING (xmax = 0) AS created"
    )


_INSERT_SESSION = f"{SQL.insert_session} RETURNING {sql.S}"
_INSERT_SESSION_IF_ABSENT = f"{SQL.insert_session} ON CONFLICT (id) DO NOTHING RETURNING {sql.S}"
# The session's last offset moves on by the number of messages written ($2).
_BUMP_MESSAGES = (
    "INSERT INTO message_heads AS h (session_id, last_offset) VALUES ($1, $2) "
    "ON CONFLICT (session_id) DO UPDATE SET last_offset = h.last_offset + excluded.last_offset "
    "RETURNING last_offset"
)
# Savers of one memory key queue on this lock, so the count each checks is final.
_LOCK_MEMORY_KEY = (
    "SELECT pg_advisory_xact_lock(hashtextextended($1 || chr(31) || $2 || chr(31) || $3, 0))"
)
_UPSERT_TURN = _upsert_sql("turns", rows.TURN_COLUMNS)
_UPSERT_TOOL_CALL = _upsert_sql("tool_calls", rows.TOOL_CALL_COLUMNS)
# Two writers checking one owner's client id queue on this lock, so the second sees
# the first's message (READ COMMITTED reads what committed before each statement).
_LOCK_CLIENT_ID = (
    "SELECT pg_advisory_xact_lock(hashtextextended(owner || chr(31) || $2, 0)) "
    "FROM sessions WHERE id = $1"
)
# The owner's counter, bumped by one (by owner, or by the owner of session $1: no row
# when the session is missing), and the update stored under the number it returned.
_BUMP_OWNER = "VALUES ($1, 1)"
_BUMP_SESSION_OWNER = "SELECT owner, 1 FROM sessions WHERE id = $1"
_LOG = (
    "WITH head AS (INSERT INTO update_heads AS h (owner, last_offset) {source} "
    "ON CONFLICT (owner) DO UPDATE SET last_offset = h.last_offset + 1 "
    "RETURNING owner, last_offset) "
    f"INSERT INTO updates ({sql.U}) "
    "SELECT owner, last_offset, $2, $3, $4, $5 FROM head RETURNING owner, log_offset"
)
_LOG_FOR_OWNER = _LOG.format(source=_BUMP_OWNER)
_LOG_FOR_SESSION = _LOG.format(source=_BUMP_SESSION_OWNER)
_UPDATE_LOG = (
    "SELECT (SELECT last_offset FROM update_heads WHERE owner = $1), "
    "(SELECT MIN(log_offset) FROM updates WHERE owner = $1)"
)

# Unfinished turns with the lease of their replica (NULL: it holds none).
_UNFINISHED_TURNS = (
    "SELECT t.id, t.replica, r.last_seen FROM turns t "
    f"LEFT JOIN replicas r ON r.id = t.replica WHERE t.{rows.UNFINISHED_TURN}"
)
# Replies first, then turns: the order end_turn locks them in, so the two cannot
# deadlock. Open replies of the orphans ($2) or of no unfinished turn: nobody will
# write them again. Each UPDATE re-checks its row once a concurrent writer commits,
# so a turn its replica ended meanwhile, or another sweep took, is left alone.
_FAIL_ORPHANED_REPLIES = (
    "UPDATE messages m SET status = 'failed', updated_at = $1 FROM sessions s "
    f"WHERE s.id = m.session_id AND m.{rows.OPEN_REPLY} AND (m.turn_id = ANY($2::text[]) "
    f"OR NOT EXISTS (SELECT 1 FROM turns t WHERE t.id = m.turn_id AND t.{rows.UNFINISHED_TURN})) "
    f"RETURNING s.owner, m.seq, {sql.columns(rows.MESSAGE_COLUMNS, 'm.')}"
)
_INTERRUPT_TURNS = (
    "UPDATE turns t SET state = $1, ended_at = $2 FROM sessions s "
    f"WHERE s.id = t.session_id AND t.id = ANY($3::text[]) AND t.{rows.UNFINISHED_TURN} "
    f"RETURNING s.owner, t.seq, {sql.columns(rows.TURN_COLUMNS, 't.')}"
)


def _identity(value: bytes) -> bytes:
    return value


async def _init_connection(conn: asyncpg.Connection[asyncpg.Record]) -> None:
    # `json` travels as its text (its binary format), so the bytes msgspec encodes
    # go in as they are and come back as bytes for msgspec to decode.
    await conn.set_type_codec(
        "json", schema="pg_catalog", encoder=_identity, decoder=_identity, format="binary"
    )


async def _keep_session(conn: asyncpg.Connection[asyncpg.Record]) -> None:
    """A connection going back to the pool keeps its session as it is: no reset query.

    asyncpg's default sends `SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *;
    RESET ALL;` at every release, a round trip that each pooled read (a turn's
    session lookup) waited for after its answer. None of it has anything to undo
    here: the archive takes advisory locks per transaction only
    (`pg_advisory_xact_lock`), declares no cursors, listens on no pooled connection,
    and sets nothing per session but its type codec (`_init_connection`). asyncpg
    still rolls back a transaction left open before calling this."""


def _session(row: asyncpg.Record | None) -> Session:
    """A session from a row the write's own statement just read or wrote."""
    assert row is not None
    return rows.session_from_data(dict(row))


def _message(row: asyncpg.Record) -> Message:
    return rows.message_from_data(dict(row))


# -- the update log (run inside a write's transaction) --------------------------------


async def _log(
    conn: Connection,
    out: list[Update],
    sql: str,
    key: str,
    items: tuple[UpdateItem, ...],
    data_list: tuple[Entity, ...],
) -> None:
    """Number one update with its owner's next offset, store and report it."""
    draft = rows.new_update("", 0, items, data_list)
    _, _, update_id, items_json, data_json, created_at = rows.update_row(draft)
    head = await conn.fetchrow(sql, key, update_id, items_json, data_json, created_at)
    if head is None:  # no such session: no owner's data changed
        return
    out.append(msgspec.structs.replace(draft, owner=head[0], offset=head[1]))


async def _log_for_owner(
    conn: Connection,
    out: list[Update],
    owner: str,
    items: tuple[UpdateItem, ...],
    data_list: tuple[Entity, ...],
) -> None:
    await _log(conn, out, _LOG_FOR_OWNER, owner, items, data_list)


async def _log_for_session(
    conn: Connection,
    out: list[Update],
    session_id: str,
    items: tuple[UpdateItem, ...],
    data_list: tuple[Entity, ...],
) -> None:
    await _log(conn, out, _LOG_FOR_SESSION, session_id, items, data_list)


# -- writes ---------------------------------------------------------------------------


async def _insert_messages(conn: Connection, messages: Sequence[Message]) -> list[Message]:
    """Append messages of one session, numbered on from its last (1, 2, ... no gaps).

    The counter is bumped first: a missing session fails here, and the counter row
    keeps other writers of this session waiting until this transaction ends."""
    session_id = messages[0].session_id
    if any(message.session_id != session_id for message in messages):
        raise StoreError("messages of one write must belong to one session")
    last = await conn.fetchval(_BUMP_MESSAGES, session_id, len(messages))
    first = last - len(messages)
    stored = [
        msgspec.structs.replace(message, global_offset=first + n)
        for n, message in enumerate(messages, start=1)
    ]
    await conn.executemany(SQL.insert_message, [rows.message_row(message) for message in stored])
    return stored


async def _append_message(conn: Connection, out: list[Update], message: Message) -> Message:
    (stored,) = await _insert_messages(conn, (message,))
    await _log_for_session(conn, out, stored.session_id, *rows.changes(("created", stored)))
    return stored


async def _replace_message(conn: Connection, message: Message) -> Message | None:
    """The stored message after its content changed; None when there is none."""
    row = await conn.fetchrow(SQL.update_message, message.id, *rows.message_change(message))
    return None if row is None else _message(row)


async def _update_message(conn: Connection, out: list[Update], message: Message) -> Message:
    stored = await _replace_message(conn, message)
    if stored is None:
        raise StoreError(f"no message {message.id}")
    await _log_for_session(conn, out, stored.session_id, *rows.changes(("updated", stored)))
    return stored


async def _save_turn(conn: Connection, turn: Turn) -> rows.Action:
    created = await conn.fetchval(_UPSERT_TURN, *rows.turn_row(turn))
    return "created" if created else "updated"


async def _log_turn(conn: Connection, out: list[Update], turn: Turn) -> None:
    change = rows.changes((await _save_turn(conn, turn), turn))
    await _log_for_session(conn, out, turn.session_id, *change)


async def _refuse_taken_client_id(conn: Connection, message: Message) -> None:
    await conn.execute(_LOCK_CLIENT_ID, message.session_id, message.client_id)
    taken = await conn.fetchrow(SQL.owners_client_id, message.client_id, message.session_id)
    if taken is not None:
        raise DuplicateClientId(message.client_id, session_id=taken[0], message_id=taken[1])


async def _begin_turn(
    conn: Connection,
    out: list[Update],
    turn: Turn,
    message: Message,
    reply: Message | None,
    unique_client_id: bool,
    started: Turn | None = None,
) -> Message:
    if unique_client_id and message.client_id:
        await _refuse_taken_client_id(conn, message)
    stored, *reply_stored = await _insert_messages(
        conn, (message,) if reply is None else (message, reply)
    )
    action = await _save_turn(conn, turn)
    row = await conn.fetchrow(SQL.touch_session, message.session_id, message.created_at)
    session = _session(row)
    change = rows.begun_turn(stored, action, turn, session, reply_stored)
    await _log_for_owner(conn, out, session.owner, *change)
    if started is not None:
        started_change = rows.changes((await _save_turn(conn, started), started))
        await _log_for_owner(conn, out, session.owner, *started_change)
    return stored


async def _end_turn(conn: Connection, out: list[Update], turn: Turn, reply: Message | None) -> None:
    stored = None
    if reply is not None:
        stored = await _appended_unless(conn, await _replace_message(conn, reply), reply)
    change = rows.ended_turn(turn, await _save_turn(conn, turn), stored)
    await _log_for_session(conn, out, turn.session_id, *change)


async def _appended_unless(
    conn: Connection, replaced: Message | None, reply: Message
) -> tuple[rows.Action, Message]:
    """A turn's reply as its end stores it: replaced, or appended when none was stored."""
    if replaced is not None:
        return "updated", replaced
    (appended,) = await _insert_messages(conn, (reply,))
    return "created", appended


async def _save_tool_call(conn: Connection, out: list[Update], call: ToolCallRecord) -> None:
    created = await conn.fetchval(_UPSERT_TOOL_CALL, *rows.tool_call_row(call))
    change = rows.changes(("created" if created else "updated", call))
    await _log_for_session(conn, out, call.session_id, *change)


async def _fork_session(
    conn: Connection, out: list[Update], session: Session, messages: Sequence[Message]
) -> list[Message]:
    if any(message.session_id != session.id for message in messages):
        raise StoreError(f"a forked message does not belong to session {session.id}")
    # An existing id fails here.
    created = _session(await conn.fetchrow(_INSERT_SESSION, *rows.session_row(session)))
    stored = await _insert_messages(conn, messages) if messages else []
    await _log_for_owner(conn, out, created.owner, *rows.forked(created, stored))
    return stored


def _by_owner(
    found: list[asyncpg.Record], build: Callable[[dict[str, Any]], Entity]
) -> list[tuple[str, Entity]]:
    """(owner, entity) per returned row, in creation order (RETURNING has none)."""
    ordered = sorted(found, key=lambda row: row["seq"])
    result = []
    for row in ordered:
        owner, data = rows.owned(dict(row))
        del data["seq"]
        result.append((owner, build(data)))
    return result


async def _interrupt_orphaned_turns(
    conn: Connection,
    out: list[Update],
    now: float,
    replica_id: str,
    lease: float,
    include_own: bool,
) -> int:
    """Interrupt the orphaned turns and fail the replies left open without a turn to
    finish them; one update per owner."""
    orphans = [
        turn_id
        for turn_id, replica, last_seen in await conn.fetch(_UNFINISHED_TURNS)
        if is_orphaned(
            replica,
            last_seen,
            replica_id=replica_id,
            lease=lease,
            now=now,
            include_own=include_own,
        )
    ]
    replies = await conn.fetch(_FAIL_ORPHANED_REPLIES, now, orphans)
    turns = await conn.fetch(_INTERRUPT_TURNS, TurnState.INTERRUPTED.value, now, orphans)
    changes = rows.interruption(
        _by_owner(turns, rows.turn_from_data), _by_owner(replies, rows.message_from_data)
    )
    for owner, (items, entities) in changes:
        await _log_for_owner(conn, out, owner, items, entities)
    return len(turns)


# -- group commit ---------------------------------------------------------------------

MAX_BATCH = 256  # writes per transaction at most


@dataclass(frozen=True, slots=True)
class _BeginTurn:
    """A `begin_turn` (without the client-id check) as rows to merge."""

    turn: Turn
    messages: tuple[Message, ...]  # the user's message, then the reply when given

    @property
    def session_id(self) -> str:
        return self.messages[0].session_id


@dataclass(frozen=True, slots=True)
class _EndTurn:
    turn: Turn
    reply: Message | None

    @property
    def session_id(self) -> str:
        return self.turn.session_id


Merged: TypeAlias = "_BeginTurn | _EndTurn"


@dataclass(slots=True)
class _Pending:
    operation: Operation[Any]  # the write alone
    merge: Merged | None  # the same write as rows to merge, if it has that form
    future: asyncio.Future[Any]
    collector: list[Update] | None


def _one_session(turn: Turn, *messages: Message) -> bool:
    """Whether the write's rows are all of its turn's session (merged writes are grouped
    by session; others run alone, and fail as they should)."""
    return all(message.session_id == turn.session_id for message in messages)


def _fail(pending: _Pending, exc: Exception) -> None:
    if not pending.future.done():
        pending.future.set_exception(as_store_error(exc))


def _groups(batch: Sequence[_Pending]) -> Iterator[list[int]]:
    """The batch in order as groups of indexes: runs of mergeable writes of distinct
    sessions (so no write of a group reads what another of it writes), and each other
    write alone."""
    group: list[int] = []
    sessions: set[str] = set()
    for index, pending in enumerate(batch):
        merge = pending.merge
        if merge is None or merge.session_id in sessions:
            if group:
                yield group
            group, sessions = [], set()
            if merge is None:
                yield [index]
                continue
        group.append(index)
        sessions.add(merge.session_id)
    if group:
        yield group


# Set-wise forms of the counter bumps: one row per session (owner), locked in key order
# so that two batches cannot deadlock on them.
_BUMP_MESSAGES_OF = (
    "INSERT INTO message_heads AS h (session_id, last_offset) "
    "SELECT * FROM unnest($1::text[], $2::bigint[]) AS n(session_id, last_offset) "
    "ORDER BY session_id "
    "ON CONFLICT (session_id) DO UPDATE SET last_offset = h.last_offset + excluded.last_offset "
    "RETURNING session_id, last_offset"
)
_BUMP_UPDATES_OF = (
    "INSERT INTO update_heads AS h (owner, last_offset) "
    "SELECT * FROM unnest($1::text[], $2::bigint[]) AS n(owner, last_offset) ORDER BY owner "
    "ON CONFLICT (owner) DO UPDATE SET last_offset = h.last_offset + excluded.last_offset "
    "RETURNING owner, last_offset"
)
_OWNERS_OF = "SELECT id, owner FROM sessions WHERE id = ANY($1::text[])"


async def _run_merged(
    conn: Connection,
    writes: list[tuple[int, Merged]],
    results: list[Any],
    outs: list[list[Update]],
) -> None:
    """Run writes of distinct sessions as a few set-wise statements (each one round
    trip for all of them), in the order one write alone takes its locks: message
    counters, rows, sessions, update counters. `results` and `outs` get each write's
    result and update at its index."""
    begins = [(i, w) for i, w in writes if isinstance(w, _BeginTurn)]
    ends = [(i, e) for i, e in writes if isinstance(e, _EndTurn)]
    stored: dict[int, list[Message]] = {}
    if begins:
        found = await conn.fetch(
            _BUMP_MESSAGES_OF,
            [w.session_id for _, w in begins],
            [len(w.messages) for _, w in begins],
        )
        last = {row[0]: row[1] for row in found}
        for i, w in begins:
            first = last[w.session_id] - len(w.messages)
            stored[i] = [
                msgspec.structs.replace(message, global_offset=first + n)
                for n, message in enumerate(w.messages, start=1)
            ]
        await conn.executemany(
            SQL.insert_message, [rows.message_row(m) for i, _ in begins for m in stored[i]]
        )
    replies: dict[str, Message] = {}
    replaced = [e.reply for _, e in ends if e.reply is not None]
    if replaced:
        found = await conn.fetchmany(
            SQL.update_message, [(m.id, *rows.message_change(m)) for m in replaced]
        )
        replies = {row["id"]: _message(row) for row in found}
    actions: dict[int, rows.Action] = {}
    found = await conn.fetchmany(_UPSERT_TURN, [rows.turn_row(w.turn) for _, w in writes])
    for (i, _), row in zip(writes, found, strict=True):
        actions[i] = "created" if row[0] else "updated"
    drafts: list[tuple[int, str, rows.Change]] = []
    if begins:
        found = await conn.fetchmany(
            SQL.touch_session, [(w.session_id, w.messages[0].created_at) for _, w in begins]
        )
        sessions = {row["id"]: _session(row) for row in found}
        for i, w in begins:
            session = sessions[w.session_id]
            user, *reply = stored[i]
            results[i] = user
            change = rows.begun_turn(user, actions[i], w.turn, session, reply)
            drafts.append((i, session.owner, change))
    if ends:
        found = await conn.fetch(_OWNERS_OF, [e.session_id for _, e in ends])
        owners: dict[str, str] = {row[0]: row[1] for row in found}
        for i, e in ends:
            stored_reply = None
            if e.reply is not None:  # appended one by one: rare, no reply stored with the turn
                stored_reply = await _appended_unless(conn, replies.get(e.reply.id), e.reply)
            if e.session_id in owners:  # a missing session has no owner to log for
                change = rows.ended_turn(e.turn, actions[i], stored_reply)
                drafts.append((i, owners[e.session_id], change))
    await _log_merged(conn, sorted(drafts, key=lambda draft: draft[0]), outs)


async def _log_merged(
    conn: Connection, drafts: list[tuple[int, str, rows.Change]], outs: list[list[Update]]
) -> None:
    """Number the writes' updates (in batch order per owner) and store them."""
    if not drafts:
        return
    counts: dict[str, int] = {}
    for _, owner, _ in drafts:
        counts[owner] = counts.get(owner, 0) + 1
    found = await conn.fetch(_BUMP_UPDATES_OF, list(counts), list(counts.values()))
    offsets = {owner: last - counts[owner] for owner, last in found}
    updates = []
    for i, owner, (items, entities) in drafts:
        offsets[owner] += 1
        update = rows.new_update(owner, offsets[owner], items, entities)
        outs[i].append(update)
        updates.append(rows.update_row(update))
    await conn.executemany(SQL.insert_update, updates)


class PostgresStore:
    def __init__(self, dsn: str, *, pool_size: int = POOL_SIZE) -> None:
        """`dsn`: a libpq URL (postgresql://user:password@host:port/database); query
        parameters asyncpg does not know become server settings (e.g. search_path)."""
        self._dsn = dsn
        self._pool_size = pool_size
        self._pool: asyncpg.Pool[asyncpg.Record] | None = None
        self._epoch = ""
        self._listener: UpdateListener | None = None
        self._pending: list[_Pending] = []
        self._writer: asyncio.Task[None] | None = None

    # -- plumbing ---------------------------------------------------------------

    def _connected(self) -> asyncpg.Pool[asyncpg.Record]:
        if self._pool is None:
            raise StoreError("the archive is not open")
        return self._pool

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        pool = self._connected()
        try:
            return await pool.fetch(sql, *args)
        except _DRIVER_ERRORS as exc:
            raise StoreError("archive read failed") from exc

    async def _fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        found = await self._fetch(sql, *args)
        return found[0] if found else None

    async def _write(self, operation: Operation[T], merge: Merged | None = None) -> T:
        """Queue `operation` for the writer and wait for its commit (and publish).

        `merge`: the same write as rows the writer can put into set-wise statements
        with other writes of its batch (`_run_merged`); `operation` is what runs when
        the write runs alone. The write goes on when its caller is cancelled: once it
        may have committed, its updates must reach the listener."""
        self._connected()
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        # The collector is read here, in the caller's context: the writer task runs
        # in a context of its own.
        self._pending.append(_Pending(operation, merge, future, current_collector()))
        if self._writer is None or self._writer.done():
            self._writer = detached(self._drain(), name="portico-postgres-writer")
        return await future

    async def _drain(self) -> None:
        """The process's one writer: batches of queued writes, one transaction each.

        One connection is held while writes keep coming (giving it back to the pool
        costs a pool round of its own per batch).

        It starts one loop step after the write that woke it: what that step made
        ready goes first (a turn's first chunk, to its socket and to the bus, is
        emitted in the step that queues the turn's `running` record), and the
        writes queued meanwhile join the first batch."""
        await asyncio.sleep(0)
        while self._pending:
            pool = self._connected()
            try:
                conn = await pool.acquire()
            except Exception as exc:  # no connection: what is queued fails, as alone
                batch, self._pending = self._pending, []
                for pending in batch:
                    _fail(pending, exc)
                continue
            try:
                await self._drain_on(pool, conn)
            finally:
                try:
                    await pool.release(conn)
                except Exception:
                    log.exception("releasing the archive writer's connection failed")

    async def _drain_on(self, pool: asyncpg.Pool[asyncpg.Record], conn: Connection) -> None:
        """Commit batches on `conn` until the queue is empty or a batch failed. A failed
        batch is rolled back and its writes run again one transaction each, so a
        failing write fails alone; the next batch gets a fresh connection, in case
        this one broke."""
        while self._pending:
            batch = self._pending[:MAX_BATCH]
            del self._pending[:MAX_BATCH]
            error = await self._commit_batch(conn, batch)
            if error is None:
                continue
            if len(batch) == 1:
                _fail(batch[0], error)  # alone already: no second try
            else:
                await self._run_alone(pool, batch)
            return

    async def _commit_batch(self, conn: Connection, batch: list[_Pending]) -> Exception | None:
        """Run the batch in one transaction and settle its writes; the error when it
        failed (then nothing committed and nothing is settled)."""
        outs: list[list[Update]] = [[] for _ in batch]
        results: list[Any] = [None] * len(batch)
        try:
            async with conn.transaction():
                for group in _groups(batch):
                    merged = [(i, m) for i in group if (m := batch[i].merge) is not None]
                    if merged:
                        await _run_merged(conn, merged, results, outs)
                    else:
                        (index,) = group
                        results[index] = await batch[index].operation(conn, outs[index])
        except Exception as exc:
            return exc
        for pending, result, updates in zip(batch, results, outs, strict=True):
            self._settle(pending, result, updates)
        return None

    async def _run_alone(self, pool: asyncpg.Pool[asyncpg.Record], batch: list[_Pending]) -> None:
        for pending in batch:
            updates: list[Update] = []
            try:
                async with pool.acquire() as conn, conn.transaction():
                    result = await pending.operation(conn, updates)
            except Exception as exc:
                _fail(pending, exc)
                continue
            self._settle(pending, result, updates)

    def _settle(self, pending: _Pending, result: Any, updates: list[Update]) -> None:
        # Published before the future resolves: the caller reads its collector as soon
        # as the write it awaited returns.
        publish(updates, pending.collector, self._listener)
        if not pending.future.done():
            pending.future.set_result(result)

    def set_update_listener(self, listener: UpdateListener | None) -> None:
        self._listener = listener

    # -- lifecycle --------------------------------------------------------------

    async def open(self) -> None:
        try:
            pool = await asyncpg.create_pool(
                self._dsn,
                min_size=1,
                max_size=self._pool_size,
                init=_init_connection,
                reset=_keep_session,
            )
        except (*_DRIVER_ERRORS, ValueError) as exc:
            raise StoreError(f"cannot open the PostgreSQL archive: {exc}") from exc
        try:
            async with pool.acquire() as conn:
                self._epoch = await _migrate(conn)
        except BaseException as exc:
            await pool.close()
            if isinstance(exc, _DRIVER_ERRORS):
                raise StoreError(f"cannot migrate the PostgreSQL archive: {exc}") from exc
            raise
        self._pool = pool

    async def health(self, within: float) -> Health:
        """`SELECT 1` on a pooled connection (taking one counts in the deadline)."""
        if self._pool is None:
            return Health(False, "not open")
        return await probe(self._pool.fetchval("SELECT 1", timeout=within), within)

    async def close(self) -> None:
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()

    # -- sessions ---------------------------------------------------------------

    async def create_session(self, session: Session) -> Session:
        async def insert_or_get(conn: Connection, out: list[Update]) -> Session:
            row = await conn.fetchrow(_INSERT_SESSION_IF_ABSENT, *rows.session_row(session))
            if row is None:  # the id exists: what is stored under it
                return _session(await conn.fetchrow(SQL.select_session, session.id))
            stored = _session(row)
            await _log_for_owner(conn, out, stored.owner, *rows.changes(("created", stored)))
            return stored

        return await self._write(insert_or_get)

    async def get_session(self, session_id: str) -> Session | None:
        row = await self._fetchrow(SQL.select_session, session_id)
        return None if row is None else _session(row)

    async def list_sessions(
        self, owner: str, *, limit: int, cursor: str = "", include_deleted: bool = True
    ) -> list[Session]:
        statement = sql.list_sessions(sql.POSTGRES, include_deleted, bool(cursor))
        found = await self._fetch(statement, *sql.page_args(owner, limit, cursor))
        return [_session(row) for row in found]

    async def touch_session(self, session_id: str, now: float) -> None:
        async def update(conn: Connection, out: list[Update]) -> None:
            row = await conn.fetchrow(SQL.touch_session, session_id, now)
            if row is not None:  # touching a missing session changes nothing
                session = _session(row)
                await _log_for_owner(conn, out, session.owner, *rows.changes(("updated", session)))

        await self._write(update)

    async def update_session(self, session: Session) -> Session:
        async def update(conn: Connection, out: list[Update]) -> Session:
            row = await conn.fetchrow(SQL.replace_session, *rows.session_row(session))
            if row is None:
                raise StoreError(f"no session {session.id}")
            stored = _session(row)
            await _log_for_owner(conn, out, stored.owner, *rows.changes(("updated", stored)))
            return stored

        return await self._write(update)

    async def fork_session(self, session: Session, messages: Sequence[Message]) -> list[Message]:
        return await self._write(
            functools.partial(_fork_session, session=session, messages=tuple(messages))
        )

    # -- messages ---------------------------------------------------------------

    async def append_message(self, message: Message) -> Message:
        return await self._write(functools.partial(_append_message, message=message))

    async def update_message(self, message: Message) -> Message:
        return await self._write(functools.partial(_update_message, message=message))

    async def get_message(self, message_id: str) -> Message | None:
        row = await self._fetchrow(SQL.get_message, message_id)
        return None if row is None else _message(row)

    async def find_message_by_client_id(self, owner: str, client_id: str) -> Message | None:
        if not client_id:
            return None
        row = await self._fetchrow(SQL.find_by_client_id, client_id, owner)
        return None if row is None else _message(row)

    async def list_messages(
        self, session_id: str, *, after_offset: int = 0, limit: int | None = None
    ) -> list[Message]:
        # LIMIT NULL is none in PostgreSQL.
        found = await self._fetch(SQL.list_messages, session_id, after_offset, limit)
        return [_message(row) for row in found]

    # -- turns ------------------------------------------------------------------

    async def create_turn(self, turn: Turn) -> None:
        await self._write(functools.partial(_log_turn, turn=turn))

    async def begin_turn(
        self,
        turn: Turn,
        message: Message,
        *,
        reply: Message | None = None,
        unique_client_id: bool = False,
        started: Turn | None = None,
    ) -> Message:
        operation = functools.partial(
            _begin_turn,
            turn=turn,
            message=message,
            reply=reply,
            unique_client_id=unique_client_id,
            started=started,
        )
        # The client-id check reads other sessions' rows: that write runs alone.
        messages = (message,) if reply is None else (message, reply)
        merge = None
        alone = (unique_client_id and message.client_id) or started is not None
        if not alone and _one_session(turn, *messages):
            merge = _BeginTurn(turn, messages)
        return await self._write(operation, merge)

    async def save_turn(self, turn: Turn) -> None:
        await self._write(functools.partial(_log_turn, turn=turn))

    async def end_turn(self, turn: Turn, reply: Message | None) -> None:
        await self._write(
            functools.partial(_end_turn, turn=turn, reply=reply),
            _EndTurn(turn, reply) if reply is None or _one_session(turn, reply) else None,
        )

    async def get_turn(self, turn_id: str) -> Turn | None:
        row = await self._fetchrow(SQL.get_turn, turn_id)
        return None if row is None else rows.turn_from_data(dict(row))

    async def list_turns(self, session_id: str) -> list[Turn]:
        found = await self._fetch(SQL.list_turns, session_id)
        return [rows.turn_from_data(dict(row)) for row in found]

    async def page_turns(self, session_id: str, *, limit: int, cursor: str = "") -> list[Turn]:
        statement = sql.page(sql.POSTGRES, "turns", bool(cursor))
        found = await self._fetch(statement, *sql.page_args(session_id, limit, cursor))
        return [rows.turn_from_data(dict(row)) for row in found]

    # -- tool calls -------------------------------------------------------------

    async def save_tool_call(self, call: ToolCallRecord) -> None:
        await self._write(functools.partial(_save_tool_call, call=call))

    async def get_tool_call(self, call_id: str) -> ToolCallRecord | None:
        row = await self._fetchrow(SQL.get_tool_call, call_id)
        return None if row is None else rows.tool_call_from_data(dict(row))

    async def list_tool_calls(self, session_id: str) -> list[ToolCallRecord]:
        found = await self._fetch(SQL.list_tool_calls, session_id)
        return [rows.tool_call_from_data(dict(row)) for row in found]

    async def page_tool_calls(
        self, session_id: str, *, limit: int, cursor: str = ""
    ) -> list[ToolCallRecord]:
        statement = sql.page(sql.POSTGRES, "tool_calls", bool(cursor))
        found = await self._fetch(statement, *sql.page_args(session_id, limit, cursor))
        return [rows.tool_call_from_data(dict(row)) for row in found]

    # -- agent memory -------------------------------------------------------------

    async def save_memory(self, entry: MemoryEntry, *, max_entries: int) -> bool:
        key = msgspec.structs.astuple(entry.key)

        async def insert(conn: Connection, out: list[Update]) -> bool:
            await conn.execute(_LOCK_MEMORY_KEY, *key)
            if await conn.fetchval(SQL.count_memories, *key) >= max_entries:
                return False
            await conn.execute(SQL.insert_memory, *rows.memory_row(entry))
            return True

        return await self._write(insert)

    async def search_memory(self, key: MemoryKey, query: str, *, limit: int) -> list[MemoryEntry]:
        args = (*msgspec.structs.astuple(key), query, limit)
        return [
            rows.memory_from_row(dict(row)) for row in await self._fetch(SQL.search_memory, *args)
        ]

    async def forget_memory(self, key: MemoryKey, memory_id: str) -> bool:
        async def delete(conn: Connection, out: list[Update]) -> bool:
            status: str = await conn.execute(
                SQL.forget_memory, *msgspec.structs.astuple(key), memory_id
            )
            return status != "DELETE 0"

        return await self._write(delete)

    # -- session traces -----------------------------------------------------------

    async def append_trace(self, event: TraceEvent) -> None:
        async def insert(conn: Connection, out: list[Update]) -> None:
            await conn.execute(SQL.insert_trace, *rows.trace_row(event))

        await self._write(insert)

    async def list_trace(self, session_id: str, owner: str, *, limit: int) -> list[TraceEvent]:
        found = await self._fetch(SQL.select_trace, session_id, owner, limit)
        return [rows.trace_from_row(dict(row)) for row in found]

    # -- replicas ---------------------------------------------------------------

    async def renew_replica(self, replica_id: str, now: float) -> None:
        async def renew(conn: Connection, out: list[Update]) -> None:
            await conn.execute(SQL.renew_replica, replica_id, now)

        await self._write(renew)

    async def interrupt_orphaned_turns(
        self, now: float, *, replica_id: str, lease: float, include_own: bool = False
    ) -> int:
        return await self._write(
            functools.partial(
                _interrupt_orphaned_turns,
                now=now,
                replica_id=replica_id,
                lease=lease,
                include_own=include_own,
            )
        )

    # -- the update log ---------------------------------------------------------

    async def update_log(self, owner: str) -> UpdateLog:
        row = await self._fetchrow(_UPDATE_LOG, owner)
        assert row is not None  # a SELECT without FROM returns one row
        return rows.update_log(self._epoch, row[0], row[1])

    async def list_updates(self, owner: str, *, after_offset: int, limit: int) -> list[Update]:
        found = await self._fetch(SQL.select_updates, owner, after_offset, limit)
        return [rows.update_from_row(tuple(row)) for row in found]

    async def prune_updates(self, older_than: float) -> int:
        # The counters in update_heads keep each owner's last offset: nothing to save.
        async def delete(conn: Connection, out: list[Update]) -> int:
            status = await conn.execute(_PRUNE_UPDATES, older_than)
            return int(status.split()[-1])

        return await self._write(delete)


async def _migrate(conn: Connection) -> str:
    """Bring the schema to the newest version; returns the archive's epoch."""
    async with conn.transaction():
        await conn.execute(_MIGRATION_LOCK)
        await conn.execute(_MIGRATIONS_TABLE)
        version = await conn.fetchval("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
        if version > len(MIGRATIONS):
            raise StoreError(
                f"the archive's schema is version {version}, newer than this Portico knows "
                f"({len(MIGRATIONS)})"
            )
        for index, script in enumerate(MIGRATIONS[version:], start=version + 1):
            await conn.execute(script)
            await conn.execute("INSERT INTO schema_migrations (version) VALUES ($1)", index)
        epoch: str = await conn.fetchval("SELECT epoch FROM meta")
    return epoch
