"""The SQL both SQL backends run, written once for a dialect (SQLite, PostgreSQL).

Parameters are numbered in both (`?1` in SQLite, `$1` in PostgreSQL), so one statement
text takes the same arguments on either backend, and a parameter can be used twice.
Every SELECT names its columns (the structs' fields, `store/rows.py`), so a row reads
the same on both, whatever else the table holds (PostgreSQL's `seq`). What only one
backend runs (its schema, how it numbers messages and updates, SQLite's multi-row
insert, PostgreSQL's upserts and locks) stays in that backend's module.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from portico.store import rows


@dataclass(frozen=True, slots=True)
class Dialect:
    mark: str  # what a numbered parameter starts with
    order: str  # the column that keeps creation order among equal timestamps
    contains: str  # "{0} contains {1}" (both text expressions) as a predicate

    def p(self, number: int) -> str:
        """Parameter `number` (from 1)."""
        return f"{self.mark}{number}"

    def params(self, count: int, start: int = 1) -> str:
        return ", ".join(self.p(n) for n in range(start, start + count))


SQLITE = Dialect(mark="?", order="rowid", contains="instr({0}, {1}) > 0")
# `seq` identity columns stand for SQLite's rowid (docs/storage.md).
POSTGRES = Dialect(mark="$", order="seq", contains="strpos({0}, {1}) > 0")


def columns(names: Sequence[str], alias: str = "") -> str:
    return ", ".join(f"{alias}{name}" for name in names)


def insert(d: Dialect, table: str, names: Sequence[str], verb: str = "INSERT") -> str:
    """An insert binding `names` in order."""
    return f"{verb} INTO {table} ({columns(names)}) VALUES ({d.params(len(names))})"


def replace(d: Dialect, table: str, names: Sequence[str], fixed: Sequence[str] = ()) -> str:
    """Set every column but `id` (the first) and `fixed`: binds a whole row, as `insert`
    does. `fixed` columns never change once a row is stored; leaving them out of the SET
    spares the indexes on them (SQLite rewrites an index entry whenever an UPDATE assigns
    one of its columns, even to the same value). Their parameters then go unused, which
    SQLite's numbered parameters allow and PostgreSQL's do not: SQLite only."""
    assignments = ", ".join(
        f"{name} = {d.p(n)}" for n, name in enumerate(names[1:], start=2) if name not in fixed
    )
    return f"UPDATE {table} SET {assignments} WHERE id = {d.p(1)}"


S = columns(rows.SESSION_COLUMNS)
M = columns(rows.MESSAGE_COLUMNS)
T = columns(rows.TURN_COLUMNS)
C = columns(rows.TOOL_CALL_COLUMNS)
U = columns(rows.UPDATE_COLUMNS)


class Statements:
    """The statements of one dialect, built once (both drivers cache prepared
    statements by their text)."""

    def __init__(self, d: Dialect) -> None:
        p1, p2, p3 = d.p(1), d.p(2), d.p(3)
        self.insert_session = insert(d, "sessions", rows.SESSION_COLUMNS)
        self.select_session = f"SELECT {S} FROM sessions WHERE id = {p1}"
        # args: rows.session_row
        self.replace_session = f"{replace(d, 'sessions', rows.SESSION_COLUMNS)} RETURNING {S}"
        # args: session id, the time
        self.touch_session = (
            f"UPDATE sessions SET last_activity_at = {p2}, updated_at = {p2} "
            f"WHERE id = {p1} RETURNING {S}"
        )
        self.insert_message = insert(d, "messages", rows.MESSAGE_COLUMNS)
        # args: message id, *rows.message_change
        self.update_message = (
            f"UPDATE messages SET content = {p2}, parts = {p3}, status = {d.p(4)}, "
            f"metadata = {d.p(5)}, updated_at = {d.p(6)} WHERE id = {p1} RETURNING {M}"
        )
        self.get_message = f"SELECT {M} FROM messages WHERE id = {p1}"
        # args: session id, after offset, limit (`no_limit`: none)
        self.list_messages = (
            f"SELECT {M} FROM messages WHERE session_id = {p1} AND global_offset > {p2} "
            f"ORDER BY global_offset LIMIT {p3}"
        )
        # `client_id <> ''` lets the planner use the partial index. args: client id, owner
        self.find_by_client_id = (
            f"SELECT {columns(rows.MESSAGE_COLUMNS, 'm.')} FROM messages m "
            f"JOIN sessions s ON s.id = m.session_id "
            f"WHERE m.client_id = {p1} AND m.client_id <> '' AND s.owner = {p2} "
            f"ORDER BY m.{d.order} LIMIT 1"
        )
        # The owner of session $2 used client id $1 already: (session id, message id).
        self.owners_client_id = (
            "SELECT m.session_id, m.id FROM messages m JOIN sessions s ON s.id = m.session_id "
            f"WHERE m.client_id = {p1} AND m.client_id <> '' "
            f"AND s.owner = (SELECT owner FROM sessions WHERE id = {p2}) "
            f"ORDER BY m.{d.order} LIMIT 1"
        )
        self.insert_turn = insert(d, "turns", rows.TURN_COLUMNS)
        self.get_turn = f"SELECT {T} FROM turns WHERE id = {p1}"
        self.list_turns = (
            f"SELECT {T} FROM turns WHERE session_id = {p1} ORDER BY created_at, {d.order}"
        )
        self.insert_tool_call = insert(d, "tool_calls", rows.TOOL_CALL_COLUMNS)
        self.replace_tool_call = replace(d, "tool_calls", rows.TOOL_CALL_COLUMNS)
        self.get_tool_call = f"SELECT {C} FROM tool_calls WHERE id = {p1}"
        self.list_tool_calls = (
            f"SELECT {C} FROM tool_calls WHERE session_id = {p1} ORDER BY created_at, {d.order}"
        )
        key = f"principal = {p1} AND agent = {p2} AND facet = {p3}"  # a MemoryKey's fields
        self.count_memories = f"SELECT COUNT(*) FROM memories WHERE {key}"
        self.insert_memory = insert(d, "memories", rows.MEMORY_COLUMNS)
        # lower() folds ASCII letters only in both (PostgreSQL: under COLLATE "C").
        self.search_memory = (
            f"SELECT {columns(rows.MEMORY_COLUMNS)} FROM memories WHERE {key} "
            f"AND {d.contains.format('lower(content)', f'lower({d.p(4)})')} "
            f"ORDER BY created_at DESC, id DESC LIMIT {d.p(5)}"
        )
        self.forget_memory = f"DELETE FROM memories WHERE {key} AND id = {d.p(4)}"
        self.insert_trace = insert(d, "traces", rows.TRACE_COLUMNS)
        self.select_trace = (
            f"SELECT {columns(rows.TRACE_COLUMNS)} FROM traces "
            f"WHERE session_id = {p1} AND owner = {p2} ORDER BY seq LIMIT {p3}"
        )
        self.insert_update = insert(d, "updates", rows.UPDATE_COLUMNS)
        self.select_updates = (
            f"SELECT {U} FROM updates WHERE owner = {p1} AND log_offset > {p2} "
            f"ORDER BY log_offset LIMIT {p3}"
        )
        self.renew_replica = (
            f"INSERT INTO replicas (id, last_seen) VALUES ({p1}, {p2}) "
            "ON CONFLICT (id) DO UPDATE SET last_seen = excluded.last_seen"
        )


@functools.cache
def list_sessions(d: Dialect, include_deleted: bool, after_cursor: bool) -> str:
    """args: `page_args(owner, limit, cursor)`."""
    deleted = "" if include_deleted else " AND deleted_at IS NULL"
    # A cursor unknown to this owner compares as NULL: an empty page.
    after = (
        f" AND (created_at, id) < "
        f"(SELECT created_at, id FROM sessions WHERE id = {d.p(3)} AND owner = {d.p(1)})"
        if after_cursor
        else ""
    )
    return (
        f"SELECT {S} FROM sessions WHERE owner = {d.p(1)}{deleted}{after} "
        f"ORDER BY created_at DESC, id DESC LIMIT {d.p(2)}"
    )


@functools.cache
def page(d: Dialect, table: str, after_cursor: bool) -> str:
    """A session's turns or tool calls, newest first; args: `page_args(session id, limit,
    cursor)`."""
    names = C if table == "tool_calls" else T
    after = (
        f" AND (created_at, {d.order}) < (SELECT created_at, {d.order} FROM {table} "
        f"WHERE id = {d.p(3)} AND session_id = {d.p(1)})"
        if after_cursor
        else ""
    )
    return (
        f"SELECT {names} FROM {table} WHERE session_id = {d.p(1)}{after} "
        f"ORDER BY created_at DESC, {d.order} DESC LIMIT {d.p(2)}"
    )


def page_args(key: str, limit: int, cursor: str) -> tuple[Any, ...]:
    """The arguments of `list_sessions` and `page`: no cursor, no third parameter."""
    return (key, limit, cursor) if cursor else (key, limit)
