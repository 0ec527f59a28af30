"""In-memory archive: for tests and throwaway servers; lost on exit."""

from __future__ import annotations

import msgspec

from portico.core.model import Message, Session, ToolCallRecord, Turn
from portico.core.states import TERMINAL_TURN_STATES, TurnState
from portico.errors import StoreError


class MemoryStore:
    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._messages: dict[str, list[Message]] = {}
        self._turns: dict[str, Turn] = {}
        self._tool_calls: dict[str, ToolCallRecord] = {}

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def create_session(self, session: Session) -> Session:
        return self._sessions.setdefault(session.id, session)

    async def get_session(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    async def list_sessions(self, owner: str, *, limit: int) -> list[Session]:
        owned = [s for s in self._sessions.values() if s.owner == owner]
        owned.sort(key=lambda s: (s.created_at, s.id), reverse=True)
        return owned[:limit]

    async def touch_session(self, session_id: str, now: float) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            self._sessions[session_id] = msgspec.structs.replace(
                session, last_activity_at=now, updated_at=now
            )

    async def append_message(self, message: Message) -> Message:
        if message.session_id not in self._sessions:
            raise StoreError(f"no session {message.session_id}")
        messages = self._messages.setdefault(message.session_id, [])
        stored = msgspec.structs.replace(message, global_offset=len(messages) + 1)
        messages.append(stored)
        return stored

    async def list_messages(
        self, session_id: str, *, after_offset: int = 0, limit: int | None = None
    ) -> list[Message]:
        selected = self._messages.get(session_id, [])[after_offset:]
        return selected if limit is None else selected[:limit]

    async def create_turn(self, turn: Turn) -> None:
        self._turns[turn.id] = turn

    async def begin_turn(self, turn: Turn, message: Message) -> Message:
        stored = await self.append_message(message)  # raises before any change
        self._turns[turn.id] = turn
        await self.touch_session(message.session_id, message.created_at)
        return stored

    async def save_turn(self, turn: Turn) -> None:
        self._turns[turn.id] = turn

    async def get_turn(self, turn_id: str) -> Turn | None:
        return self._turns.get(turn_id)

    async def list_turns(self, session_id: str) -> list[Turn]:
        turns = [t for t in self._turns.values() if t.session_id == session_id]
        return sorted(turns, key=lambda t: t.created_at)

    async def save_tool_call(self, call: ToolCallRecord) -> None:
        self._tool_calls[call.id] = call

    async def get_tool_call(self, call_id: str) -> ToolCallRecord | None:
        return self._tool_calls.get(call_id)

    async def list_tool_calls(self, session_id: str) -> list[ToolCallRecord]:
        return [c for c in self._tool_calls.values() if c.session_id == session_id]

    async def interrupt_unfinished_turns(self, now: float) -> int:
        unfinished = [t for t in self._turns.values() if t.state not in TERMINAL_TURN_STATES]
        for turn in unfinished:
            self._turns[turn.id] = msgspec.structs.replace(
                turn, state=TurnState.INTERRUPTED, ended_at=now
            )
        return len(unfinished)
