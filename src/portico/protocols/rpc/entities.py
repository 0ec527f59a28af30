"""Archive records in the shapes of rpc-protocol.md section 4 (times as RFC 3339, UTC)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from portico.domain.model import (
    ContentPart,
    Entity,
    Message,
    Session,
    ToolCallRecord,
    Turn,
    Update,
)
from portico.domain.trace import TraceEvent
from portico.protocols.rpc.frames import UpdateItemWire, UpdateWire

# Content types whose `content_data` is a JSON value, archived as JSON text.
STRUCTURED_CONTENT = frozenset({"summary", "toolcall_input", "toolcall_output"})


def rfc3339(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    stamp = datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


class WireSession(msgspec.Struct, frozen=True):
    id: str
    client_session_id: str
    title: str
    status: str
    created_at: str | None
    updated_at: str | None
    closed_at: str | None
    deleted_at: str | None
    parent_session_id: str
    root_session_id: str
    forked_from_message_id: str
    agent: str


class WireMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    session_id: str
    turn_id: str
    client_id: str
    role: str
    content_type: str
    content_data: Any
    status: str
    global_offset: int
    turn_offset: int
    parent_message_id: str
    created_at: str | None
    updated_at: str | None
    # Portico additions, present only when set: media parts and the sender's metadata.
    parts: tuple[ContentPart, ...] = ()
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    # `message.list` of a reply being streamed now: `content_data` is its text so far,
    # which holds live chunks 0 ... streamed_chunks - 1 (docs/rpc.md).
    streamed_chunks: int = 0


class TurnError(msgspec.Struct, frozen=True):
    code: str
    message: str


class TurnUsage(msgspec.Struct, frozen=True):
    input_tokens: int
    output_tokens: int


class WireTurn(msgspec.Struct, frozen=True):
    id: str
    session_id: str
    status: str
    merged_into: str
    error: TurnError | None
    created_at: str | None
    started_at: str | None
    ended_at: str | None
    usage: TurnUsage  # Portico addition: model tokens of the turn


class WireRtc(msgspec.Struct, frozen=True):
    id: str
    session_id: str
    turn_id: str
    message_id: str
    name: str
    arguments: dict[str, Any]
    status: str
    result: Any
    error: str
    client_id: str
    created_at: str | None
    updated_at: str | None
    # Portico additions: what a client shows when it asks the user for consent.
    consent_message: str | None = None
    categories: tuple[str, ...] = ()


WireEntity = WireSession | WireMessage | WireTurn | WireRtc


class WireTraceEvent(msgspec.Struct, frozen=True):
    """One event of a session's trace (`v1.session.trace`)."""

    type: str
    at: str | None
    data: dict[str, Any]


def trace_wire(event: TraceEvent) -> WireTraceEvent:
    return WireTraceEvent(type=event.kind, at=rfc3339(event.at), data=event.data)


def session_wire(session: Session) -> WireSession:
    return WireSession(
        id=session.id,
        client_session_id=session.client_session_id,
        title=session.title,
        status=session.status,
        created_at=rfc3339(session.created_at),
        updated_at=rfc3339(session.updated_at),
        closed_at=rfc3339(session.closed_at),
        deleted_at=rfc3339(session.deleted_at),
        parent_session_id=session.parent_session_id,
        root_session_id=session.root_session_id or session.id,
        forked_from_message_id=session.forked_from_message_id,
        agent=session.agent,
    )


def content_data(message: Message) -> Any:
    if message.content_type in STRUCTURED_CONTENT and message.content:
        try:
            return msgspec.json.decode(message.content)
        except msgspec.DecodeError:
            return message.content
    return message.content


def message_wire(message: Message) -> WireMessage:
    return WireMessage(
        id=message.id,
        session_id=message.session_id,
        turn_id=message.turn_id,
        client_id=message.client_id,
        role=message.role,
        content_type=message.content_type,
        content_data=content_data(message),
        status=message.status,
        global_offset=message.global_offset,
        turn_offset=message.turn_offset,
        parent_message_id=message.parent_message_id,
        created_at=rfc3339(message.created_at),
        updated_at=rfc3339(message.updated_at),
        parts=message.parts,
        metadata=message.metadata,
    )


def turn_wire(turn: Turn) -> WireTurn:
    error = TurnError(turn.error_code, turn.error_message) if turn.error_code else None
    return WireTurn(
        id=turn.id,
        session_id=turn.session_id,
        status=turn.state.value,
        merged_into=turn.merged_into,
        error=error,
        created_at=rfc3339(turn.created_at),
        started_at=rfc3339(turn.started_at),
        ended_at=rfc3339(turn.ended_at),
        usage=TurnUsage(turn.input_tokens, turn.output_tokens),
    )


def rtc_wire(call: ToolCallRecord) -> WireRtc:
    return WireRtc(
        id=call.id,
        session_id=call.session_id,
        turn_id=call.turn_id,
        message_id=call.message_id,
        name=call.name,
        arguments=call.arguments,
        status=call.state.value,
        result=call.result,
        error=call.error,
        client_id=call.client_id,
        created_at=rfc3339(call.created_at),
        updated_at=rfc3339(call.updated_at),
        consent_message=call.consent_message,
        categories=call.categories,
    )


def entity_wire(entity: Entity) -> WireEntity:
    if isinstance(entity, Session):
        return session_wire(entity)
    if isinstance(entity, Message):
        return message_wire(entity)
    if isinstance(entity, Turn):
        return turn_wire(entity)
    return rtc_wire(entity)


def update_wire(update: Update) -> UpdateWire:
    return UpdateWire(
        id=update.id,
        items=tuple(UpdateItemWire(i.entity, i.action, i.entity_id) for i in update.items),
        data_list=tuple(entity_wire(e) for e in update.data_list),
        offset=update.offset,
    )
