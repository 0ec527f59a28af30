"""What the engine tells protocol adapters about a running turn."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from portico.domain.model import ContentPart
from portico.runtime.base import MediaChunk, ToolCall


class TurnChunk(msgspec.Struct, frozen=True):
    session_id: str
    turn_id: str
    text: str
    message_id: str = ""  # the assistant message the chunk belongs to
    index: int = 0  # the chunk's position in that message, from 0


class TurnMediaChunk(msgspec.Struct, frozen=True):
    session_id: str
    turn_id: str
    chunk: MediaChunk


class TurnToolCall(msgspec.Struct, frozen=True):
    session_id: str
    turn_id: str
    call: ToolCall


class TurnToolCallTimedOut(msgspec.Struct, frozen=True):
    """The server ended a tool call the client never answered; the client stops waiting."""

    session_id: str
    turn_id: str
    call_id: str
    error: str


class TurnCompleted(msgspec.Struct, frozen=True):
    session_id: str
    turn_id: str
    content: str
    parts: tuple[ContentPart, ...] | None = None
    cancelled: bool = False


class TurnFailed(msgspec.Struct, frozen=True):
    """The turn failed; `code` and `message` are safe to show a client."""

    session_id: str
    turn_id: str
    code: str
    message: str


TurnEvent = (
    TurnChunk | TurnMediaChunk | TurnToolCall | TurnToolCallTimedOut | TurnCompleted | TurnFailed
)
TERMINAL_EVENTS = (TurnCompleted, TurnFailed)

# Called synchronously by the turn's task; must not block or raise.
Listener = Callable[[TurnEvent], None]
