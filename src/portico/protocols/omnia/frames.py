"""Every `/ws` frame as an immutable type; one union per direction.

Field names and shapes follow spec/omnia-websocket-protocol.md. Unknown fields
from a client are ignored (forward compatibility); wrong types are refused.
The AsyncAPI document docs/asyncapi/omnia.json is generated from these types.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from portico.domain.model import ContentPart

# -- client -> server ------------------------------------------------------------


class MessageFrame(msgspec.Struct, frozen=True, tag="message", tag_field="type"):
    content: str | None = None
    parts: tuple[ContentPart, ...] | None = None
    session_id: str | None = None
    metadata: dict[str, str] | None = None
    declare: dict[str, Any] | None = None


class UploadRequest(msgspec.Struct, frozen=True):
    filename: str
    mime_type: str
    size_bytes: int


class UploadRequestFrame(msgspec.Struct, frozen=True, tag="upload_request", tag_field="type"):
    upload_request: UploadRequest
    session_id: str | None = None


class ClientToolResult(msgspec.Struct, frozen=True):
    call_id: str
    result: Any = None
    error: str | None = None


class ToolResultFrame(msgspec.Struct, frozen=True, tag="tool_result", tag_field="type"):
    tool_result: ClientToolResult


class CallRef(msgspec.Struct, frozen=True):
    call_id: str


class ToolCallAckFrame(msgspec.Struct, frozen=True, tag="tool_call_ack", tag_field="type"):
    tool_call_ack: CallRef


class Nack(msgspec.Struct, frozen=True):
    call_id: str
    reason: str


class ToolCallNackFrame(msgspec.Struct, frozen=True, tag="tool_call_nack", tag_field="type"):
    tool_call_nack: Nack


class HangupFrame(msgspec.Struct, frozen=True, tag="hangup", tag_field="type"):
    pass


class DisclosureAckFrame(msgspec.Struct, frozen=True, tag="disclosure_ack", tag_field="type"):
    pass


class CredentialRefreshFrame(
    msgspec.Struct, frozen=True, tag="credential_refresh", tag_field="type"
):
    token: str


ClientFrame = (
    MessageFrame
    | UploadRequestFrame
    | ToolResultFrame
    | ToolCallAckFrame
    | ToolCallNackFrame
    | HangupFrame
    | DisclosureAckFrame
    | CredentialRefreshFrame
)

# -- server -> client ------------------------------------------------------------


class Capabilities(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    binary_frames: bool
    max_payload_size: int
    protocol_version: int


class ConnectedInfo(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    capabilities: Capabilities
    resumed: bool | None = None
    ai_disclosure: bool | None = None
    memory_facet: str | None = None


# Omnia's facade and AsyncAPI document put one on every server message; its
# dashboard dates each bubble from it.
Timestamp = Annotated[
    str,
    msgspec.Meta(
        extra_json_schema={
            "format": "date-time",
            "description": "When the server sent the frame: RFC 3339, UTC, to the millisecond",
        }
    ),
]


class _ServerFrame(
    msgspec.Struct,
    frozen=True,
    omit_defaults=True,
    tag_field="type",
    forbid_unknown_fields=True,
    kw_only=True,
):
    timestamp: Timestamp


class ConnectedFrame(_ServerFrame, frozen=True, tag="connected"):
    session_id: str
    connected: ConnectedInfo


class ChunkFrame(_ServerFrame, frozen=True, tag="chunk"):
    content: str
    session_id: str | None = None
    role: str | None = None


class DoneFrame(_ServerFrame, frozen=True, tag="done"):
    content: str | None = None
    parts: tuple[ContentPart, ...] | None = None
    session_id: str | None = None


class ToolCallInfo(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    id: str
    name: str
    arguments: dict[str, Any]
    consent_message: str | None = None
    categories: tuple[str, ...] | None = None


class ToolCallFrame(_ServerFrame, frozen=True, tag="tool_call"):
    tool_call: ToolCallInfo
    session_id: str | None = None


class ServerToolResult(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    id: str
    result: Any = None
    error: str | None = None


class ToolResultServerFrame(_ServerFrame, frozen=True, tag="tool_result"):
    tool_result: ServerToolResult
    session_id: str | None = None


class UploadReady(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    upload_id: str
    upload_url: str
    storage_ref: str
    expires_at: str
    method: str | None = None
    headers: dict[str, str] | None = None


class UploadReadyFrame(_ServerFrame, frozen=True, tag="upload_ready"):
    upload_ready: UploadReady
    session_id: str | None = None


class MediaChunkInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    media_id: str
    sequence: int
    is_last: bool
    data: str
    mime_type: str


class MediaChunkFrame(_ServerFrame, frozen=True, tag="media_chunk"):
    media_chunk: MediaChunkInfo
    session_id: str | None = None


class InterruptFrame(_ServerFrame, frozen=True, tag="interrupt"):
    session_id: str | None = None


class SessionConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    codec: str
    sample_rate: int
    channels: int


class SessionConfigFrame(_ServerFrame, frozen=True, tag="session_config"):
    session_config: SessionConfig
    session_id: str | None = None


class ErrorInfo(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    code: str
    message: str
    details: dict[str, Any] | None = None


class ErrorFrame(_ServerFrame, frozen=True, tag="error"):
    error: ErrorInfo
    session_id: str | None = None


ServerFrame = (
    ConnectedFrame
    | ChunkFrame
    | DoneFrame
    | ToolCallFrame
    | ToolResultServerFrame
    | UploadReadyFrame
    | MediaChunkFrame
    | InterruptFrame
    | SessionConfigFrame
    | ErrorFrame
)

client_frame_decoder = msgspec.json.Decoder(ClientFrame)
server_frame_decoder = msgspec.json.Decoder(ServerFrame)
