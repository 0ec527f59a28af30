"""Every `/v1/rpc` frame and method parameter set as an immutable type (spec/rpc-protocol.md).

Requests carry no `type` (they are `{"id", "method", "params"}`), so a client frame is
first read into `ClientFrame` and then classified; each method's `params` are converted
into that method's struct, which validates them in the same pass.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec

from portico.domain.model import ContentPart

PROTOCOL_VERSION = 1

# Every number and string a client sends is bounded here, in the decoding, so what
# reaches the archive fits it (SQLite integers are 64-bit) and is `invalid_request`
# otherwise (docs/rpc.md, Limits).
MAX_INT64 = 2**63 - 1
MAX_ID_LENGTH = 128  # server ids, client ids, cursors, agent names, statuses
MAX_TITLE_LENGTH = 256
MAX_TEXT_LENGTH = 4 * 1024 * 1024  # message content, prompts, instructions, reasons
Int64 = Annotated[int, msgspec.Meta(ge=-MAX_INT64 - 1, le=MAX_INT64)]
Offset = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT64)]
Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_LENGTH)]
Title = Annotated[str, msgspec.Meta(max_length=MAX_TITLE_LENGTH)]
Cursor = Annotated[str, msgspec.Meta(max_length=MAX_TITLE_LENGTH)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_LENGTH)]
# RFC 3339 with a zone: a time without one has no single meaning.
Timestamp = Annotated[datetime, msgspec.Meta(tz=True)]


# -- client frames ----------------------------------------------------------------------


class ClientFrame(msgspec.Struct, frozen=True):
    """Any client frame: `connect` has `type`; a request has `id` and `method`."""

    type: str | None = None
    id: Any = None
    method: Any = None
    params: Any = None
    token: Any = None
    offset: Any = None
    epoch: Any = None
    credential: Any = None  # `{"type": "credential", "credential": "<token>"}`: a refresh


class Connect(msgspec.Struct, frozen=True, kw_only=True):
    token: str | None = None  # bounded by the frame size; the auth backend judges it
    offset: Offset | None = None
    epoch: Id | None = None


class Request(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    method: str
    params: msgspec.Struct


# -- method parameters (websocket-rpc.md; limits are ours, see docs/rpc.md) --------------


class _Params(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Unknown params are refused: a misspelt one (`session_id` for `server_session_id`)
    would otherwise be ignored silently and the call do something else."""


class SessionList(_Params, frozen=True, kw_only=True):
    cursor: Cursor = ""
    limit: Int64 = 20


class SessionRef(_Params, frozen=True, kw_only=True):
    session_id: Id


class SessionClose(SessionRef, frozen=True, kw_only=True):
    client_id: Id = ""  # accepted, not deduplicated (websocket-rpc.md)


class SessionUpdate(SessionRef, frozen=True, kw_only=True):
    title: Title | msgspec.UnsetType = msgspec.UNSET
    # Absent: unchanged; a time: soft-deleted; null: restored.
    deleted_at: Timestamp | msgspec.UnsetType | None = msgspec.UNSET


class SessionFork(_Params, frozen=True, kw_only=True):
    old_server_session_id: Id
    old_server_message_id: Id
    new_client_session_id: Id = ""
    new_client_message_id: Id = ""
    content_data: Text
    limit: Int64 = 200


class SessionCompact(SessionRef, frozen=True, kw_only=True):
    custom_instruction: Text = ""


class MessageSend(_Params, frozen=True, kw_only=True):
    content_data: Text
    client_id: Id
    # Portico addition: media parts as on /ws (uploads by `storage_ref`, `url`, `data`).
    parts: tuple[ContentPart, ...] = ()
    client_session_id: Id = ""
    server_session_id: Id = ""
    agent_prompt: Text = ""
    agent: Id = ""
    metadata: dict[Title, Text] | None = None


class MessageList(SessionRef, frozen=True, kw_only=True):
    cursor: Cursor | Offset = ""
    limit: Int64 = 50


class MessageRef(_Params, frozen=True, kw_only=True):
    message_id: Id


class TurnStop(SessionRef, frozen=True, kw_only=True):
    client_id: Id = ""  # accepted, not deduplicated


class PagedBySession(SessionRef, frozen=True, kw_only=True):
    cursor: Cursor = ""
    limit: Int64 = 50


class TurnRef(_Params, frozen=True, kw_only=True):
    turn_id: Id


class RtcRef(_Params, frozen=True, kw_only=True):
    rtc_id: Id


class RtcUpdateStatus(RtcRef, frozen=True, kw_only=True):
    status: Literal["executing", "rejected"]
    client_id: Id = ""
    reason: Text = ""


class RtcSubmitResult(RtcRef, frozen=True, kw_only=True):
    success: bool
    result: Any = None
    error: Text = ""
    client_id: Id = ""


class Method(msgspec.Struct, frozen=True):
    params: type[_Params]
    action: bool  # Action methods reply with `updates`; queries without the key
    max_limit: int | None = None  # `limit` above it is invalid_request
    min_limit: int = 1  # a fork may copy nothing (0); a page holds at least one item


METHODS: dict[str, Method] = {
    "v1.session.list": Method(SessionList, action=False, max_limit=100),
    "v1.session.get": Method(SessionRef, action=False),
    "v1.session.close": Method(SessionClose, action=True),
    "v1.session.open": Method(SessionRef, action=True),
    "v1.session.update": Method(SessionUpdate, action=True),
    "v1.session.fork": Method(SessionFork, action=True, max_limit=1000, min_limit=0),
    "v1.session.compact": Method(SessionCompact, action=True),
    # Portico addition (docs/rpc.md): the session's trace, oldest event first.
    "v1.session.trace": Method(SessionRef, action=False),
    "v1.message.send": Method(MessageSend, action=True),
    "v1.message.list": Method(MessageList, action=False, max_limit=200),
    "v1.message.get": Method(MessageRef, action=False),
    "v1.turn.stop": Method(TurnStop, action=True),
    "v1.turn.list": Method(PagedBySession, action=False, max_limit=200),
    "v1.turn.get": Method(TurnRef, action=False),
    "v1.rtc.update_status": Method(RtcUpdateStatus, action=True),
    "v1.rtc.submit_result": Method(RtcSubmitResult, action=True),
    "v1.rtc.list": Method(PagedBySession, action=False, max_limit=200),
    "v1.rtc.get": Method(RtcRef, action=False),
}


# -- server frames ----------------------------------------------------------------------


class ErrorBody(msgspec.Struct, frozen=True, omit_defaults=True):
    code: str
    message: str
    details: Any = None


class Connected(msgspec.Struct, frozen=True, tag_field="type", tag="connected"):
    user_id: str
    epoch: str
    offset: int
    recovered: bool


class UpdateItemWire(msgspec.Struct, frozen=True):
    entity: str
    action: str
    entity_id: str


class UpdateWire(msgspec.Struct, frozen=True):
    id: str
    items: tuple[UpdateItemWire, ...]
    data_list: tuple[Any, ...]  # the entities in their wire shapes
    offset: int


class UpdateFrame(msgspec.Struct, frozen=True, tag_field="type", tag="update"):
    update: UpdateWire


class GapFrame(msgspec.Struct, frozen=True, tag_field="type", tag="gap"):
    offset: int


class Live(msgspec.Struct, frozen=True):
    session_id: str
    turn_id: str
    message_id: str
    index: int
    delta: str


class LiveFrame(msgspec.Struct, frozen=True, tag_field="type", tag="live"):
    live: Live


class PongFrame(msgspec.Struct, frozen=True, tag_field="type", tag="pong"):
    """The answer to a client `ping` (Portico addition: browsers cannot send WebSocket
    pings, and a page must still find out that a connection died)."""


class ErrorFrame(msgspec.Struct, frozen=True, tag_field="type", tag="error"):
    """A frame-level error: no request id to answer (malformed frame, auth failure)."""

    error: ErrorBody


class Result(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    result: Any
    updates: tuple[UpdateWire, ...] | None = None


class Failed(msgspec.Struct, frozen=True):
    id: str
    error: ErrorBody


ServerFrame = (
    Connected | UpdateFrame | GapFrame | LiveFrame | PongFrame | ErrorFrame | Result | Failed
)


# -- the client frames as documented (decoding goes through `ClientFrame`) ----------------


class ConnectFrame(
    msgspec.Struct, frozen=True, omit_defaults=True, tag_field="type", tag="connect"
):
    token: str | None = None
    offset: int | None = None
    epoch: str | None = None


class PingFrame(msgspec.Struct, frozen=True, tag_field="type", tag="ping"):
    """Any time after `connected`; answered with `pong`, never rate-limited."""


class CredentialFrame(msgspec.Struct, frozen=True, tag_field="type", tag="credential"):
    """Any time after `connected`: a fresh token for this connection; no reply. Taken
    only for the same principal (and session binding) and a later `exp` (docs/rpc.md)."""

    credential: str


class RequestFrame(msgspec.Struct, frozen=True):
    """`params` follows the method's own schema (`x-rpc-methods` in the document)."""

    id: str
    method: str
    params: dict[str, Any] = msgspec.field(default_factory=dict)


# Requests, replies and failures carry no `type`: the documents list the frames as tuples.
DOCUMENTED_CLIENT_FRAMES = (ConnectFrame, PingFrame, CredentialFrame, RequestFrame)
SERVER_FRAMES = (
    Connected,
    UpdateFrame,
    GapFrame,
    LiveFrame,
    PongFrame,
    ErrorFrame,
    Result,
    Failed,
)
