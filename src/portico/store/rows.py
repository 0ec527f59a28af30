"""Archive records as table rows and back, and the updates writes log: shared by
the SQL backends (SQLite, PostgreSQL), so both store and read exactly the same data.

A row holds a struct's fields in declaration order; nested values (parts, metadata,
a session's `declare`, a tool call's arguments, categories and result, an update's
items and entities) are JSON, encoded by msgspec. Reads hand in each row as a dict
of column name to value.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec

from portico.domain.memory import MemoryEntry
from portico.domain.model import (
    ENTITY_KINDS,
    ContentPart,
    Entity,
    EntityKind,
    Message,
    Session,
    ToolCallRecord,
    Turn,
    Update,
    UpdateItem,
    UpdateLog,
    new_id,
)
from portico.domain.states import ToolCallState, TurnState
from portico.domain.trace import TraceEvent

SESSION_COLUMNS = tuple(field.name for field in msgspec.structs.fields(Session))
MESSAGE_COLUMNS = tuple(field.name for field in msgspec.structs.fields(Message))
TURN_COLUMNS = tuple(field.name for field in msgspec.structs.fields(Turn))
TOOL_CALL_COLUMNS = tuple(field.name for field in msgspec.structs.fields(ToolCallRecord))
MEMORY_COLUMNS = tuple(field.name for field in msgspec.structs.fields(MemoryEntry))
TRACE_COLUMNS = tuple(field.name for field in msgspec.structs.fields(TraceEvent))
UPDATE_COLUMNS = ("owner", "log_offset", "id", "items", "data_list", "created_at")

json_encode = msgspec.json.encode
_parts_decoder = msgspec.json.Decoder(tuple[ContentPart, ...])
_metadata_decoder = msgspec.json.Decoder(dict[str, str])
_trace_data_decoder = msgspec.json.Decoder(dict[str, Any])
_declare_decoder = msgspec.json.Decoder(dict[str, Any] | None)
_any_decoder = msgspec.json.Decoder()
_JSON_TOOL_COLUMNS = ("arguments", "categories", "result")
Action = Literal["created", "updated"]

# Struct fields are bound positionally (astuple), in declaration order; these are the
# positions that need encoding first.
_MESSAGE_PARTS = MESSAGE_COLUMNS.index("parts")
_MESSAGE_METADATA = MESSAGE_COLUMNS.index("metadata")
_TURN_STATE = TURN_COLUMNS.index("state")
_TOOL_STATE = TOOL_CALL_COLUMNS.index("state")
_TOOL_JSON = tuple(TOOL_CALL_COLUMNS.index(column) for column in _JSON_TOOL_COLUMNS)

_items_decoder = msgspec.json.Decoder(tuple[UpdateItem, ...])
# data_list mixes entity types without a tag: each is decoded by its item's kind.
_raw_list_decoder = msgspec.json.Decoder(tuple[msgspec.Raw, ...])
_ENTITY_DECODERS: dict[EntityKind, msgspec.json.Decoder[Any]] = {
    "session": msgspec.json.Decoder(Session),
    "message": msgspec.json.Decoder(Message),
    "turn": msgspec.json.Decoder(Turn),
    "rtc": msgspec.json.Decoder(ToolCallRecord),
}


def session_row(session: Session) -> tuple[Any, ...]:
    values = msgspec.structs.astuple(session)
    return (*values[:-1], None if session.declare is None else json_encode(session.declare))


def session_from_data(data: dict[str, Any]) -> Session:
    data["declare"] = _declare_decoder.decode(data["declare"]) if data["declare"] else None
    return Session(**data)


def message_row(message: Message) -> list[Any]:
    row = list(msgspec.structs.astuple(message))
    row[_MESSAGE_PARTS] = json_encode(message.parts)
    row[_MESSAGE_METADATA] = json_encode(message.metadata)
    return row


def message_from_data(data: dict[str, Any]) -> Message:
    data["parts"] = _parts_decoder.decode(data["parts"])
    data["metadata"] = _metadata_decoder.decode(data["metadata"])
    return Message(**data)


def message_change(message: Message) -> tuple[Any, ...]:
    """What replacing a stored message sets: content, parts, status, metadata, updated_at."""
    return (
        message.content,
        json_encode(message.parts),
        message.status,
        json_encode(message.metadata),
        message.updated_at,
    )


def turn_row(turn: Turn) -> list[Any]:
    row = list(msgspec.structs.astuple(turn))
    row[_TURN_STATE] = turn.state.value
    return row


def turn_from_data(data: dict[str, Any]) -> Turn:
    data["state"] = TurnState(data["state"])
    return Turn(**data)


def tool_call_row(call: ToolCallRecord) -> list[Any]:
    row = list(msgspec.structs.astuple(call))
    row[_TOOL_STATE] = call.state.value
    for index in _TOOL_JSON:
        row[index] = json_encode(row[index])
    return row


def tool_call_from_data(data: dict[str, Any]) -> ToolCallRecord:
    for column in _JSON_TOOL_COLUMNS:
        data[column] = _any_decoder.decode(data[column])
    data["state"] = ToolCallState(data["state"])
    data["categories"] = tuple(data["categories"])
    return ToolCallRecord(**data)


# -- the update log ---------------------------------------------------------------------


def new_update(
    owner: str, offset: int, items: tuple[UpdateItem, ...], data_list: tuple[Entity, ...]
) -> Update:
    return Update(
        id=new_id("upd"),
        owner=owner,
        offset=offset,
        items=items,
        data_list=data_list,
        created_at=time.time(),
    )


def update_row(update: Update) -> tuple[Any, ...]:
    """The values of `UPDATE_COLUMNS`."""
    return (
        update.owner,
        update.offset,
        update.id,
        json_encode(update.items),
        json_encode(update.data_list),
        update.created_at,
    )


def update_from_row(row: Sequence[Any]) -> Update:
    """An update from the values of `UPDATE_COLUMNS`."""
    owner, offset, update_id, items_json, data_json, created_at = row
    items = _items_decoder.decode(items_json)
    raws = _raw_list_decoder.decode(data_json)
    data_list = tuple(
        _ENTITY_DECODERS[item.entity].decode(raw) for item, raw in zip(items, raws, strict=True)
    )
    return Update(
        id=update_id,
        owner=owner,
        offset=offset,
        items=items,
        data_list=data_list,
        created_at=created_at,
    )


Change = tuple[tuple[UpdateItem, ...], tuple[Entity, ...]]  # one update's items and entities


def updated_items(entities: Iterable[Entity]) -> tuple[UpdateItem, ...]:
    """One `updated` item per entity, in order."""
    return tuple(UpdateItem(ENTITY_KINDS[type(e)], "updated", e.id) for e in entities)


def changes(*pairs: tuple[Action, Entity]) -> Change:
    """One update's items and entities from (action, entity) pairs, in order; an item's
    kind is its entity's."""
    items = tuple(UpdateItem(ENTITY_KINDS[type(e)], action, e.id) for action, e in pairs)
    return items, tuple(entity for _, entity in pairs)


def owned(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A row that leads with its session's owner: the owner, and the entity's columns."""
    return data.pop("owner"), data


def begun_turn(
    stored: Message, action: Action, turn: Turn, session: Session, replies: Sequence[Message]
) -> Change:
    """What `begin_turn` logs: the user's message, the turn, the touched session, then
    the reply created with them, if any."""
    return changes(
        ("created", stored),
        (action, turn),
        ("updated", session),
        *(("created", created) for created in replies),
    )


def ended_turn(turn: Turn, action: Action, reply: tuple[Action, Message] | None) -> Change:
    """What `end_turn` logs: the reply (stored or appended), when given, then the turn."""
    return changes(*(() if reply is None else (reply,)), (action, turn))


def forked(session: Session, messages: Sequence[Message]) -> Change:
    """What `fork_session` logs: the session, then each message."""
    return changes(("created", session), *(("created", message) for message in messages))


# -- interrupting orphaned turns ---------------------------------------------------------

# Turns no replica will run again, spelled out because the SQL backends' partial index
# of unfinished turns repeats this predicate, and a query uses that index only when its
# WHERE says the same (tests check it against TERMINAL_TURN_STATES).
UNFINISHED_TURN = "state NOT IN ('cancelled', 'completed', 'failed', 'interrupted', 'merged')"
OPEN_REPLY_STATUSES = ("pending", "streaming")  # replies still being written
OPEN_REPLY = "status IN ('pending', 'streaming')"  # the predicate of the index of open replies


def interrupted(turn: Turn, now: float) -> Turn:
    return msgspec.structs.replace(turn, state=TurnState.INTERRUPTED, ended_at=now)


def failed(reply: Message, now: float) -> Message:
    """An open reply nobody will finish: failed, keeping what it had."""
    return msgspec.structs.replace(reply, status="failed", updated_at=now)


def interruption(
    turns: Iterable[tuple[str, Entity]], replies: Iterable[tuple[str, Entity]]
) -> list[tuple[str, Change]]:
    """What interrupting orphaned turns logs, from (owner, entity) pairs in creation
    order: one update per owner, its turns then its replies. Owners come sorted, the
    order PostgreSQL locks their counters in, so two such writes cannot deadlock."""
    changed: dict[str, list[Entity]] = {}
    for owner, entity in (*turns, *replies):
        changed.setdefault(owner, []).append(entity)
    return [
        (owner, (updated_items(changed[owner]), tuple(changed[owner]))) for owner in sorted(changed)
    ]


def update_log(epoch: str, last: int | None, first: int | None) -> UpdateLog:
    """The log position from the last offset handed out (None: none yet) and the oldest
    retained (None: nothing retained)."""
    last = last or 0
    return UpdateLog(
        epoch=epoch, last_offset=last, first_offset=last + 1 if first is None else first
    )


def memory_row(entry: MemoryEntry) -> tuple[Any, ...]:
    return msgspec.structs.astuple(entry)


def memory_from_row(data: dict[str, Any]) -> MemoryEntry:
    return MemoryEntry(**data)


def trace_row(event: TraceEvent) -> tuple[Any, ...]:
    """The values of `TRACE_COLUMNS`: `data` as JSON."""
    return (*msgspec.structs.astuple(event)[:-1], json_encode(event.data))


def trace_from_row(data: dict[str, Any]) -> TraceEvent:
    data["data"] = _trace_data_decoder.decode(data["data"])
    return TraceEvent(**data)
