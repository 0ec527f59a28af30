"""In-memory archive: for tests and throwaway servers; lost on exit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeVar

import msgspec

from portico.domain.memory import MemoryEntry, MemoryKey, ascii_lower
from portico.domain.model import (
    Entity,
    Message,
    Session,
    ToolCallRecord,
    Turn,
    Update,
    UpdateItem,
    UpdateLog,
    new_id,
)
from portico.domain.states import TERMINAL_TURN_STATES
from portico.domain.trace import TraceEvent
from portico.errors import DuplicateClientId, StoreError
from portico.health import IN_PROCESS, Health
from portico.store import rows
from portico.store.base import UpdateListener, current_collector, is_orphaned, publish

Change = tuple[Literal["created", "updated"], Entity]
T = TypeVar("T", Turn, ToolCallRecord)
P = TypeVar("P", Session, Turn, ToolCallRecord)


class MemoryStore:
    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._messages: dict[str, list[Message]] = {}
        self._message_index: dict[str, Message] = {}
        # (owner, client id) -> the id of the first message stored with it: every
        # `/v1/session` message is looked up by its key, so no scan of all messages.
        self._by_client_id: dict[tuple[str, str], str] = {}
        self._turns: dict[str, Turn] = {}
        self._tool_calls: dict[str, ToolCallRecord] = {}
        self._epoch = new_id("epoch")
        self._updates: dict[str, list[Update]] = {}
        self._heads: dict[str, int] = {}
        self._listener: UpdateListener | None = None
        self._replicas: dict[str, float] = {}  # replica id -> when it last renewed its lease
        self._memories: dict[MemoryKey, list[MemoryEntry]] = {}  # oldest first
        self._traces: dict[str, list[TraceEvent]] = {}  # session id -> its events

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def health(self, within: float) -> Health:
        return IN_PROCESS

    def set_update_listener(self, listener: UpdateListener | None) -> None:
        self._listener = listener

    def _log(self, session_id: str, *changes: Change) -> None:
        """Append one update to the log of the session's owner and announce it."""
        self._log_for_owner(self._owner_of(session_id), *rows.changes(*changes))

    def _owner_of(self, session_id: str) -> str:
        return self._sessions[session_id].owner

    def _log_for_owner(
        self, owner: str, items: tuple[UpdateItem, ...], data_list: tuple[Entity, ...]
    ) -> None:
        offset = self._heads.get(owner, 0) + 1
        self._heads[owner] = offset
        update = rows.new_update(owner, offset, items, data_list)
        self._updates.setdefault(owner, []).append(update)
        publish((update,), current_collector(), self._listener)

    # -- sessions -----------------------------------------------------------------

    async def create_session(self, session: Session) -> Session:
        if session.id in self._sessions:
            return self._sessions[session.id]
        self._sessions[session.id] = session
        self._log(session.id, ("created", session))
        return session

    async def get_session(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    async def list_sessions(
        self, owner: str, *, limit: int, cursor: str = "", include_deleted: bool = True
    ) -> list[Session]:
        owned = [
            s
            for s in self._sessions.values()
            if s.owner == owner and (include_deleted or s.deleted_at is None)
        ]
        owned.sort(key=lambda s: (s.created_at, s.id), reverse=True)
        return _page(owned, cursor, limit)

    async def touch_session(self, session_id: str, now: float) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            touched = msgspec.structs.replace(session, last_activity_at=now, updated_at=now)
            self._sessions[session_id] = touched
            self._log(session_id, ("updated", touched))

    async def update_session(self, session: Session) -> Session:
        if session.id not in self._sessions:
            raise StoreError(f"no session {session.id}")
        self._sessions[session.id] = session
        self._log(session.id, ("updated", session))
        return session

    async def fork_session(self, session: Session, messages: Sequence[Message]) -> list[Message]:
        if session.id in self._sessions:
            raise StoreError(f"session {session.id} exists")
        if any(m.session_id != session.id for m in messages):
            raise StoreError("a forked message belongs to another session")
        self._check_new(*messages)
        self._sessions[session.id] = session
        stored = [self._append(m) for m in messages]
        self._log(session.id, ("created", session), *(("created", m) for m in stored))
        return stored

    # -- messages -----------------------------------------------------------------

    def _check_new(self, *messages: Message) -> None:
        """A write checks every id first: like a rolled-back transaction, it changes nothing."""
        ids = [message.id for message in messages]
        if len(set(ids)) < len(ids) or any(i in self._message_index for i in ids):
            raise StoreError("a message with this id exists")

    def _append(self, message: Message) -> Message:
        if message.session_id not in self._sessions:
            raise StoreError(f"no session {message.session_id}")
        self._check_new(message)
        messages = self._messages.setdefault(message.session_id, [])
        stored = msgspec.structs.replace(message, global_offset=len(messages) + 1)
        messages.append(stored)
        self._message_index[stored.id] = stored
        if stored.client_id:
            owner = self._sessions[stored.session_id].owner
            self._by_client_id.setdefault((owner, stored.client_id), stored.id)
        return stored

    async def append_message(self, message: Message) -> Message:
        stored = self._append(message)
        self._log(stored.session_id, ("created", stored))
        return stored

    async def update_message(self, message: Message) -> Message:
        if message.id not in self._message_index:
            raise StoreError(f"no message {message.id}")
        stored = self._changed(message)
        self._log(stored.session_id, ("updated", stored))
        return stored

    def _changed(self, message: Message) -> Message:
        """Replace the stored message's content (its ids and offsets stay)."""
        old = self._message_index[message.id]
        stored = msgspec.structs.replace(
            old,
            content=message.content,
            parts=message.parts,
            status=message.status,
            metadata=message.metadata,
            updated_at=message.updated_at,
        )
        self._replace_message(stored)
        return stored

    def _replace_message(self, message: Message) -> None:
        self._message_index[message.id] = message
        self._messages[message.session_id][message.global_offset - 1] = message

    async def get_message(self, message_id: str) -> Message | None:
        return self._message_index.get(message_id)

    async def find_message_by_client_id(self, owner: str, client_id: str) -> Message | None:
        message_id = self._by_client_id.get((owner, client_id)) if client_id else None
        return None if message_id is None else self._message_index[message_id]

    async def list_messages(
        self, session_id: str, *, after_offset: int = 0, limit: int | None = None
    ) -> list[Message]:
        selected = self._messages.get(session_id, [])[after_offset:]
        return selected if limit is None else selected[:limit]

    # -- turns --------------------------------------------------------------------

    async def create_turn(self, turn: Turn) -> None:
        await self.save_turn(turn)

    async def begin_turn(
        self,
        turn: Turn,
        message: Message,
        *,
        reply: Message | None = None,
        unique_client_id: bool = False,
        started: Turn | None = None,
    ) -> Message:
        owner = (
            self._sessions[message.session_id].owner if message.session_id in self._sessions else ""
        )
        if unique_client_id and (
            taken := await self.find_message_by_client_id(owner, message.client_id)
        ):
            raise DuplicateClientId(
                message.client_id, session_id=taken.session_id, message_id=taken.id
            )
        self._check_new(message, *(() if reply is None else (reply,)))
        stored = self._append(message)  # raises before any change
        self._turns[turn.id] = turn
        session = msgspec.structs.replace(
            self._sessions[message.session_id],
            last_activity_at=message.created_at,
            updated_at=message.created_at,
        )
        self._sessions[session.id] = session
        changes: list[Change] = [("created", stored), ("created", turn), ("updated", session)]
        if reply is not None:
            changes.append(("created", self._append(reply)))
        self._log(session.id, *changes)
        if started is not None:
            self._turns[started.id] = started
            self._log(session.id, ("updated", started))
        return stored

    async def save_turn(self, turn: Turn) -> None:
        self._save(self._turns, turn)

    async def end_turn(self, turn: Turn, reply: Message | None) -> None:
        if turn.session_id not in self._sessions:
            raise StoreError(f"no session {turn.session_id}")
        changes: list[Change] = []
        if reply is not None:
            if reply.id in self._message_index:
                changes.append(("updated", self._changed(reply)))
            else:
                changes.append(("created", self._append(reply)))
        changes.append(("updated" if turn.id in self._turns else "created", turn))
        self._turns[turn.id] = turn
        self._log(turn.session_id, *changes)

    def _save(self, table: dict[str, T], entity: T) -> None:
        if entity.session_id not in self._sessions:
            raise StoreError(f"no session {entity.session_id}")
        action: Literal["created", "updated"] = "updated" if entity.id in table else "created"
        table[entity.id] = entity
        self._log(entity.session_id, (action, entity))

    async def get_turn(self, turn_id: str) -> Turn | None:
        return self._turns.get(turn_id)

    async def list_turns(self, session_id: str) -> list[Turn]:
        turns = [t for t in self._turns.values() if t.session_id == session_id]
        return sorted(turns, key=lambda t: t.created_at)

    async def page_turns(self, session_id: str, *, limit: int, cursor: str = "") -> list[Turn]:
        return _newest_page(self._turns, session_id, limit, cursor)

    # -- tool calls ---------------------------------------------------------------

    async def save_tool_call(self, call: ToolCallRecord) -> None:
        self._save(self._tool_calls, call)

    async def get_tool_call(self, call_id: str) -> ToolCallRecord | None:
        return self._tool_calls.get(call_id)

    async def list_tool_calls(self, session_id: str) -> list[ToolCallRecord]:
        return [c for c in self._tool_calls.values() if c.session_id == session_id]

    async def page_tool_calls(
        self, session_id: str, *, limit: int, cursor: str = ""
    ) -> list[ToolCallRecord]:
        return _newest_page(self._tool_calls, session_id, limit, cursor)

    # -- agent memory -------------------------------------------------------------

    async def save_memory(self, entry: MemoryEntry, *, max_entries: int) -> bool:
        entries = self._memories.setdefault(entry.key, [])
        if len(entries) >= max_entries:
            return False
        entries.append(entry)
        return True

    async def search_memory(self, key: MemoryKey, query: str, *, limit: int) -> list[MemoryEntry]:
        needle = ascii_lower(query)
        found = [e for e in self._memories.get(key, []) if needle in ascii_lower(e.content)]
        found.sort(key=lambda entry: (entry.created_at, entry.id), reverse=True)
        return found[:limit]

    async def forget_memory(self, key: MemoryKey, memory_id: str) -> bool:
        entries = self._memories.get(key, [])
        kept = [entry for entry in entries if entry.id != memory_id]
        self._memories[key] = kept
        return len(kept) < len(entries)

    # -- session traces -----------------------------------------------------------

    async def append_trace(self, event: TraceEvent) -> None:
        self._traces.setdefault(event.session_id, []).append(event)

    async def list_trace(self, session_id: str, owner: str, *, limit: int) -> list[TraceEvent]:
        mine = [event for event in self._traces.get(session_id, []) if event.owner == owner]
        return mine[:limit]

    # -- replicas -----------------------------------------------------------------

    async def renew_replica(self, replica_id: str, now: float) -> None:
        self._replicas[replica_id] = now

    async def interrupt_orphaned_turns(
        self, now: float, *, replica_id: str, lease: float, include_own: bool = False
    ) -> int:
        orphans = [
            rows.interrupted(turn, now)
            for turn in self._turns.values()
            if turn.state not in TERMINAL_TURN_STATES
            and is_orphaned(
                turn.replica,
                self._replicas.get(turn.replica),
                replica_id=replica_id,
                lease=lease,
                now=now,
                include_own=include_own,
            )
        ]
        self._turns.update((turn.id, turn) for turn in orphans)
        running = {t.id for t in self._turns.values() if t.state not in TERMINAL_TURN_STATES}
        replies = [
            rows.failed(message, now)
            for message in self._message_index.values()
            if message.status in rows.OPEN_REPLY_STATUSES and message.turn_id not in running
        ]
        for reply in replies:
            self._replace_message(reply)
        owned_turns = [(self._owner_of(turn.session_id), turn) for turn in orphans]
        owned_replies = [(self._owner_of(reply.session_id), reply) for reply in replies]
        for owner, (items, entities) in rows.interruption(owned_turns, owned_replies):
            self._log_for_owner(owner, items, entities)
        return len(orphans)

    # -- the update log -----------------------------------------------------------

    async def update_log(self, owner: str) -> UpdateLog:
        last = self._heads.get(owner, 0)
        retained = self._updates.get(owner, [])
        first = retained[0].offset if retained else last + 1
        return UpdateLog(epoch=self._epoch, last_offset=last, first_offset=first)

    async def list_updates(self, owner: str, *, after_offset: int, limit: int) -> list[Update]:
        return [u for u in self._updates.get(owner, []) if u.offset > after_offset][:limit]

    async def prune_updates(self, older_than: float) -> int:
        dropped = 0
        for owner, updates in self._updates.items():
            kept = [u for u in updates if u.created_at >= older_than]
            dropped += len(updates) - len(kept)
            self._updates[owner] = kept
        return dropped


def _page(ordered: list[P], cursor: str, limit: int) -> list[P]:
    """At most `limit` items after the one whose id is `cursor` (none for an unknown one)."""
    if cursor:
        ids = [item.id for item in ordered]
        ordered = ordered[ids.index(cursor) + 1 :] if cursor in ids else []
    return ordered[:limit]


def _newest_page(table: dict[str, T], session_id: str, limit: int, cursor: str) -> list[T]:
    # Dicts keep insertion order, which stands in for SQLite's rowid on ties.
    rows = [
        (e.created_at, i, e) for i, e in enumerate(table.values()) if e.session_id == session_id
    ]
    rows.sort(key=lambda row: (row[0], row[1]), reverse=True)
    return _page([e for _, _, e in rows], cursor, limit)
