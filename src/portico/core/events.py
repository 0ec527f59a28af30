"""What the engine tells protocol adapters about a running turn.

Every event of a turn the engine runs carries its `step`: its place among the turn's
events, from 1. An adapter that takes a session over mid-turn on another replica
replays the bus's copy of the events after the last step its ledger recorded
(server/session_replay.py). 0: an event no turn runner counted (a voice call's own).
"""

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
    step: int = 0  # its place among the turn's events, from 1


class TurnMediaChunk(msgspec.Struct, frozen=True):
    session_id: str
    turn_id: str
    chunk: MediaChunk
    step: int = 0  # its place among the turn's events, from 1


class TurnToolCall(msgspec.Struct, frozen=True):
    session_id: str
    turn_id: str
    call: ToolCall
    step: int = 0  # its place among the turn's events, from 1


class TurnToolCallTimedOut(msgspec.Struct, frozen=True):
    """The server ended a tool call the client never answered; the client stops waiting."""

    session_id: str
    turn_id: str
    call_id: str
    error: str
    step: int = 0  # its place among the turn's events, from 1


class TurnCompleted(msgspec.Struct, frozen=True):
    session_id: str
    turn_id: str
    content: str
    parts: tuple[ContentPart, ...] | None = None
    cancelled: bool = False
    step: int = 0  # its place among the turn's events, from 1


class TurnFailed(msgspec.Struct, frozen=True):
    """The turn failed; `code` and `message` are safe to show a client."""

    session_id: str
    turn_id: str
    code: str
    message: str
    step: int = 0  # its place among the turn's events, from 1


TurnEvent = (
    TurnChunk | TurnMediaChunk | TurnToolCall | TurnToolCallTimedOut | TurnCompleted | TurnFailed
)
TERMINAL_EVENTS = (TurnCompleted, TurnFailed)

# Called synchronously by the turn's task; must not block or raise.
Listener = Callable[[TurnEvent], None]
