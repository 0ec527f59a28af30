"""Which b-trees the SQLite archive's per-turn statements write: each is a page of WAL
per commit, and the WAL's fsyncs are the tail of a turn's `done` on a slow disk
(docs/performance.md, "The WAL's fsyncs")."""

from __future__ import annotations

import sqlite3

from portico.store import rows, sqlite_writes


def written_indexes(conn: sqlite3.Connection, statement: str, params: int) -> set[int]:
    """The root pages of the indexes `statement` inserts into or deletes from (EXPLAIN:
    the cursors of `IdxInsert`/`IdxDelete`, opened by `OpenWrite` on their root page),
    bound as the store binds it (`params` values)."""
    program = list(conn.execute(f"EXPLAIN {statement}", [None] * params))
    roots = {row[2]: row[3] for row in program if row[1] == "OpenWrite"}  # cursor: root
    return {
        roots[row[2]] for row in program if row[1] in ("IdxInsert", "IdxDelete") and row[2] in roots
    }


def index_roots(conn: sqlite3.Connection, table: str) -> dict[str, int]:
    query = "SELECT name, rootpage FROM sqlite_master WHERE type = 'index' AND tbl_name = ?"
    return dict(conn.execute(query, (table,)))


def test_a_turns_end_does_not_rewrite_its_per_session_index_entry() -> None:
    conn = sqlite_writes.connect_writer(":memory:", 1 << 20)
    try:
        roots = index_roots(conn, "turns")
        # Bound with a whole turn row, as `_save_turn` binds it.
        written = written_indexes(conn, sqlite_writes._REPLACE_TURN, len(rows.TURN_COLUMNS))
    finally:
        conn.close()
    # A turn's session and creation time never change: (session_id, created_at) stays.
    assert roots["turns_session"] not in written
    # Its state does: an ended turn leaves the index of unfinished turns.
    assert roots["turns_unfinished"] in written


def test_logging_an_update_writes_no_index_but_its_key() -> None:
    conn = sqlite_writes.connect_writer(":memory:", 1 << 20)
    try:
        roots = index_roots(conn, "updates")
        statement = sqlite_writes.SQL.insert_update
        written = written_indexes(conn, statement, len(rows.UPDATE_COLUMNS))
    finally:
        conn.close()
    # The log's primary key (owner, log_offset) alone: the prune walks the rowid order.
    assert set(roots) == {"sqlite_autoindex_updates_1"}
    assert written == {roots["sqlite_autoindex_updates_1"]}
