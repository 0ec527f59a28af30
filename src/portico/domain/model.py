"""Typed, immutable records of the archive: sessions, messages, turns, content."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Literal

import msgspec

from portico.domain.states import ToolCallState, TurnState

PartType = Literal["text", "image", "audio", "video", "file"]
Role = Literal["user", "assistant", "tool", "system"]
ContentType = Literal[
    "markdown", "text", "thinking", "summary", "toolcall_input", "toolcall_output"
]
MessageStatus = Literal["pending", "streaming", "completed", "failed"]
SessionStatus = Literal["idle", "active", "closed"]


class MediaContent(msgspec.Struct, frozen=True, omit_defaults=True):
    """A media item of a content part; exactly one of data, url, storage_ref."""

    mime_type: str
    data: str | None = None
    url: str | None = None
    storage_ref: str | None = None
    filename: str | None = None
    size_bytes: int | None = None
    width: int | None = None
    height: int | None = None
    detail: Literal["low", "high", "auto"] | None = None
    duration_ms: int | None = None
    sample_rate: int | None = None
    channels: int | None = None


class ContentPart(msgspec.Struct, frozen=True, omit_defaults=True):
    type: PartType
    text: str | None = None
    media: MediaContent | None = None


def text_of_parts(parts: tuple[ContentPart, ...]) -> str:
    """The text a runtime reads from parts: text parts joined by a blank line."""
    return "\n\n".join(part.text for part in parts if part.type == "text" and part.text)


_ID_BYTES = 10  # 80 random bits after a 48-bit millisecond clock (UUIDv7's layout)
_POOL_BYTES = 4000  # read from the OS at once: one system call per 400 ids


class _RandomPool(threading.local):
    """Cryptographically random bytes, read in blocks: `uuid4` makes one system call
    per id, which the stream profile showed at 5 % of the event loop (several ids a turn).
    Per thread, because the archive's thread makes ids too."""

    def __init__(self) -> None:
        self.block = b""
        self.used = 0

    def take(self) -> bytes:
        if self.used + _ID_BYTES > len(self.block):
            self.block, self.used = os.urandom(_POOL_BYTES), 0
        start, self.used = self.used, self.used + _ID_BYTES
        return self.block[start : self.used]


_random = _RandomPool()


def new_id(prefix: str) -> str:
    """`prefix-` and 32 hex digits: Unix milliseconds (48 bits), then 80 random bits.

    Time-ordered, so the archive's id indexes grow at their end: random ids put each
    insert on a random page, which slowed writes and bloated the WAL as the archive
    grew (throughput fell 20 % over the first 250 MB). 80 random bits per millisecond
    keep ids unguessable and collision-free.
    """
    return f"{prefix}-{int(time.time() * 1000):012x}{_random.take().hex()}"


class Session(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    owner: str
    agent: str
    created_at: float
    updated_at: float
    last_activity_at: float
    title: str = ""
    status: SessionStatus = "idle"
    closed_at: float | None = None
    deleted_at: float | None = None
    client_session_id: str = ""
    parent_session_id: str = ""
    root_session_id: str = ""
    forked_from_message_id: str = ""
    # The session-binding claim's value (`jwt_session_claim`) of the token that opened
    # it: only a token with the same value may resume it. "" when unbound.
    binding: str = ""
    declare: dict[str, Any] | None = None


class Message(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    session_id: str
    role: Role
    content: str
    created_at: float
    updated_at: float
    turn_id: str = ""
    client_id: str = ""
    content_type: ContentType = "text"
    parts: tuple[ContentPart, ...] = ()
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    status: MessageStatus = "completed"
    # Assigned by the store on append: 1, 2, 3... per session, without gaps.
    global_offset: int = 0
    turn_offset: int = 0
    parent_message_id: str = ""


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    session_id: str
    state: TurnState
    created_at: float
    started_at: float | None = None
    ended_at: float | None = None
    error_code: str = ""
    error_message: str = ""
    merged_into: str = ""
    # Model tokens the turn used (all rounds), as the runtime reported them.
    input_tokens: int = 0
    output_tokens: int = 0
    # The replica running the turn (the engine's `replica_id`); empty in archives from
    # before replicas, and such a turn counts as orphaned (docs/storage.md).
    replica: str = ""


class ToolCallRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A client-side tool call and its outcome, archived with its turn."""

    id: str
    session_id: str
    turn_id: str
    name: str
    arguments: dict[str, Any]
    state: ToolCallState
    created_at: float
    updated_at: float
    consent_message: str | None = None
    categories: tuple[str, ...] = ()
    result: Any = None
    error: str = ""
    message_id: str = ""
    client_id: str = ""

    @property
    def outcome(self) -> Literal["completed", "error", "denied"] | None:
        """The Omnia record: a nack, a timeout or a stopped turn are all `denied`."""
        return _OUTCOMES.get(self.state)


_OUTCOMES: dict[ToolCallState, Literal["completed", "error", "denied"]] = {
    ToolCallState.COMPLETED: "completed",
    ToolCallState.FAILED: "error",
    ToolCallState.TIMEOUT: "denied",
    ToolCallState.REJECTED: "denied",
}


def message_text(message: Message) -> str:
    """What a runtime reads: the text parts when any carry text, else `content`."""
    return text_of_parts(message.parts) or message.content


# -- the per-user update log (RPC `update` frames) ------------------------------------

EntityKind = Literal["session", "turn", "message", "rtc"]
Entity = Session | Message | Turn | ToolCallRecord
ENTITY_KINDS: dict[type[Any], EntityKind] = {
    Session: "session",
    Message: "message",
    Turn: "turn",
    ToolCallRecord: "rtc",
}


class UpdateItem(msgspec.Struct, frozen=True):
    entity: EntityKind
    action: Literal["created", "updated"]
    entity_id: str


class Update(msgspec.Struct, frozen=True, kw_only=True):
    """One archived change of a user's data, numbered per user (`offset` 1, 2, ...).

    Written in the same transaction as the change, so a client that replays the
    log from its last offset sees exactly what the archive holds.
    """

    id: str
    owner: str
    offset: int
    items: tuple[UpdateItem, ...]
    data_list: tuple[Entity, ...]  # the entities as stored, one per item
    created_at: float


class UpdateLog(msgspec.Struct, frozen=True, kw_only=True):
    """Where a user's update log stands."""

    epoch: str  # changes when the log is reset; offsets of another epoch mean nothing
    last_offset: int  # 0 before the first update
    first_offset: int  # the oldest retained update; last_offset + 1 when none is retained
