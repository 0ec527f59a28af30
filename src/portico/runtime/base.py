"""The Runtime port.

A runtime turns one user message (plus the session's history) into an async
stream of events. It asks for a client-side tool by yielding a `ToolCall`; the
engine sends the call's `ToolOutcome` back into the generator (``asend``), so a
runtime reads like straight-line code: ``outcome = yield ToolCall(...)``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Literal, Protocol

import msgspec

from portico.core.model import ContentPart, Message


class Chunk(msgspec.Struct, frozen=True):
    text: str


class Done(msgspec.Struct, frozen=True):
    """The end of the reply. `content` None means: the concatenated chunks."""

    content: str | None = None
    parts: tuple[ContentPart, ...] | None = None


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: dict[str, Any]
    consent_message: str | None = None
    categories: tuple[str, ...] = ()


class MediaChunk(msgspec.Struct, frozen=True):
    media_id: str
    mime_type: str
    data: bytes
    sequence: int
    is_last: bool


class Failure(msgspec.Struct, frozen=True):
    """The turn failed. `code` reaches the client only when it is a spec code."""

    code: str
    message: str


RuntimeEvent = Chunk | Done | ToolCall | MediaChunk | Failure


class ToolOutcome(msgspec.Struct, frozen=True):
    """How a client tool call ended: `denied` covers nacks, rejections and timeouts."""

    status: Literal["completed", "error", "denied"]
    result: Any = None
    error: str | None = None


class TurnInput(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    turn_id: str
    agent: str
    owner: str  # the principal the session belongs to
    message: Message
    history: tuple[Message, ...]
    # Reserved metadata keys (`mock_scenario`, `content_type`, `omnia.*`): for the runtime only.
    directives: dict[str, str] = msgspec.field(default_factory=dict)
    declare: dict[str, Any] | None = None


TurnStream = AsyncGenerator[RuntimeEvent, ToolOutcome | None]


class Runtime(Protocol):
    def run(self, turn: TurnInput) -> TurnStream:
        """Start the turn; the engine iterates the stream to its terminal event."""
