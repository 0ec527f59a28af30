"""The Store port. Every backend passes tests/contract/test_store_contract.py."""

from __future__ import annotations

from typing import Protocol

from portico.core.model import Message, Session, ToolCallRecord, Turn


class Store(Protocol):
    async def open(self) -> None:
        """Connect, create or migrate the schema. Readiness waits on this."""

    async def close(self) -> None: ...

    async def create_session(self, session: Session) -> Session:
        """Insert unless the id exists; return what is stored under that id either way."""

    async def get_session(self, session_id: str) -> Session | None: ...

    async def list_sessions(self, owner: str, *, limit: int) -> list[Session]:
        """The owner's sessions, newest first."""

    async def touch_session(self, session_id: str, now: float) -> None:
        """Record activity: sets `last_activity_at` and `updated_at`."""

    async def append_message(self, message: Message) -> Message:
        """Store a message, assigning the session's next `global_offset` (1, 2, ...).

        The session must exist; otherwise `StoreError`.
        """

    async def list_messages(
        self, session_id: str, *, after_offset: int = 0, limit: int | None = None
    ) -> list[Message]:
        """Messages with `global_offset` above `after_offset`, oldest first."""

    async def create_turn(self, turn: Turn) -> None: ...

    async def begin_turn(self, turn: Turn, message: Message) -> Message:
        """Atomically create `turn`, append its user `message` and touch the session.

        Returns the stored message with its `global_offset`; the session must exist
        (otherwise `StoreError`, and nothing is written).
        """

    async def save_turn(self, turn: Turn) -> None:
        """Replace the stored turn with this one (same id)."""

    async def get_turn(self, turn_id: str) -> Turn | None: ...

    async def list_turns(self, session_id: str) -> list[Turn]:
        """A session's turns, oldest first."""

    async def save_tool_call(self, call: ToolCallRecord) -> None:
        """Insert or replace the stored call with this one (same id)."""

    async def get_tool_call(self, call_id: str) -> ToolCallRecord | None: ...

    async def list_tool_calls(self, session_id: str) -> list[ToolCallRecord]:
        """A session's tool calls, oldest first."""

    async def interrupt_unfinished_turns(self, now: float) -> int:
        """Mark turns left pending or running by a stopped server `interrupted`."""
