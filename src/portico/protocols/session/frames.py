"""Every `/v1/session` frame as an immutable type (spec/sessions-protocol.md).

Numbered messages carry `seq`; `hello`, `ready`, `ack`, `ping`, `pong` and a
connection-level `error` (one without `seq`, before a close) are not numbered.
The AsyncAPI document docs/asyncapi/session.json is generated from these types.
"""

from __future__ import annotations

from typing import Any

import msgspec

from portico.domain.model import ContentPart

PROTOCOL_VERSION = 1
# A spoken agent turn's `turn_id` starts `vturn-`: it answers no `message`, so a
# client routes it to its own stream (docs/voice.md).
VOICE_TURN_PREFIX = "vturn"


class _Frame(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="type"):
    pass


class ToolSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """A client-side tool declared in `hello`."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class AudioFormat(msgspec.Struct, frozen=True, omit_defaults=True):
    """One audio format: a `codec` (`pcm16`, `wav`, `mp3`, `opus`) and/or a `mime_type`."""

    codec: str | None = None
    sample_rate: int | None = None  # Hz
    channels: int | None = None
    mime_type: str | None = None


class AudioOffer(msgspec.Struct, frozen=True, omit_defaults=True):
    """`hello.audio`: the formats the client accepts, in order of preference."""

    input: tuple[AudioFormat, ...] = ()
    output: tuple[AudioFormat, ...] = ()


class AudioChoice(msgspec.Struct, frozen=True):
    """`ready.audio`: the format chosen per direction; null where there is none."""

    input: AudioFormat | None = None
    output: AudioFormat | None = None


class ErrorInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    code: str
    message: str
    details: dict[str, Any] | None = None


# -- unnumbered, both directions ---------------------------------------------------------


class Hello(_Frame, frozen=True, tag="hello"):
    """`session_id` (with `last_seq`) resumes a session the server still holds.
    `continue` (`continue_session` in Python) names an archived session of the same
    principal instead: a new numbering on that conversation (seq from 1 both ways,
    nothing replayed; `ready.resumed` false, same `session_id`). An unknown or foreign
    id gets `RESUME_FAILED`, close 4404; with `session_id` or `last_seq`, 4400."""

    protocol: int = PROTOCOL_VERSION
    session_id: str | None = None
    last_seq: int = 0
    continue_session: str | None = msgspec.field(default=None, name="continue")
    credential: str | None = None
    agent: str | None = None
    tools: tuple[ToolSpec, ...] = ()
    audio: AudioOffer | None = None
    context: dict[str, Any] | None = None
    capabilities: tuple[str, ...] = ()


class Ready(_Frame, frozen=True, tag="ready"):
    session_id: str
    resumed: bool
    last_seq: int
    capabilities: tuple[str, ...]
    heartbeat_ms: int
    resume_window_ms: int
    audio: AudioChoice | None = None
    # The agent's `requires_ai_disclosure` (spec/identity.md); absent when unset.
    ai_disclosure: bool | None = None


class Ack(_Frame, frozen=True, tag="ack"):
    seq: int


class Ping(_Frame, frozen=True, tag="ping"):
    pass


class Pong(_Frame, frozen=True, tag="pong"):
    pass


# -- numbered, client to server ----------------------------------------------------------


class Message(_Frame, frozen=True, tag="message"):
    """`client_id`: the client's idempotency key for this message (at most 128
    characters, unique per principal, as on RPC `v1.message.send`). A key the archive
    already holds is not archived or answered again: the reply is a numbered `error`
    `DUPLICATE_MESSAGE` with `ref_seq`, whose `details` name the earlier message
    (`session_id`, `message_id`, `turn_id`, `turn_state`, the `reply` text so far)."""

    seq: int
    content: str | None = None
    parts: tuple[ContentPart, ...] | None = None
    metadata: dict[str, str] | None = None
    client_id: str | None = None


class ToolCallAck(_Frame, frozen=True, tag="tool_call_ack"):
    seq: int
    call_id: str


class ToolCallNack(_Frame, frozen=True, tag="tool_call_nack"):
    seq: int
    call_id: str
    reason: str


class ClientToolResult(_Frame, frozen=True, tag="tool_result"):
    seq: int
    call_id: str
    result: Any = None
    error: str | None = None


class Context(_Frame, frozen=True, tag="context"):
    seq: int
    context: dict[str, Any]


class Interrupt(_Frame, frozen=True, tag="interrupt"):
    seq: int


class End(_Frame, frozen=True, tag="end"):
    seq: int


# -- numbered, server to client ----------------------------------------------------------


class Chunk(_Frame, frozen=True, tag="chunk"):
    seq: int
    turn_id: str
    content: str


class Done(_Frame, frozen=True, tag="done"):
    seq: int
    turn_id: str
    content: str | None = None
    parts: tuple[ContentPart, ...] | None = None
    cancelled: bool = False


class ToolCallInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    id: str
    name: str
    arguments: dict[str, Any]
    consent_message: str | None = None
    categories: tuple[str, ...] | None = None


class ToolCall(_Frame, frozen=True, tag="tool_call"):
    seq: int
    turn_id: str
    tool_call: ToolCallInfo


class ServerToolResult(_Frame, frozen=True, tag="tool_result"):
    """The server ended a call the client never answered."""

    seq: int
    call_id: str
    error: str


class Transcript(_Frame, frozen=True, tag="transcript"):
    """Recognised speech of the caller (`role` "user"); `final` false: a partial
    transcript of an utterance still being heard, which the final one replaces."""

    seq: int
    role: str
    text: str
    final: bool = True


class AudioStart(_Frame, frozen=True, tag="audio_start"):
    """A media item begins; its bytes follow in binary frames whose MediaID is `item_id`."""

    seq: int
    turn_id: str
    item_id: str
    format: AudioFormat


class AudioEnd(_Frame, frozen=True, tag="audio_end"):
    """The item is over. `lost`: some of its binary frames never reached the client
    (a dropped connection, a full send queue, a cancelled turn); discard it."""

    seq: int
    turn_id: str
    item_id: str
    lost: bool = False


class Credential(_Frame, frozen=True, tag="credential"):
    """Unnumbered: a fresh token for this connection (spec identity.md, Expiry and
    refresh). No reply; ignored unless it is for the same principal (and session
    binding) and expires later than the current one."""

    credential: str


class Error(_Frame, frozen=True, tag="error"):
    """Numbered when it answers a message or ends a turn; unnumbered before a close."""

    error: ErrorInfo
    seq: int | None = None
    turn_id: str | None = None
    ref_seq: int | None = None


ClientFrame = (
    Hello
    | Credential
    | Error  # only unnumbered: the client explains the close it is about to make
    | Ack
    | Ping
    | Pong
    | Message
    | ToolCallAck
    | ToolCallNack
    | ClientToolResult
    | Context
    | Interrupt
    | End
)
ServerFrame = (
    Ready
    | Ack
    | Ping
    | Pong
    | Chunk
    | Done
    | ToolCall
    | ServerToolResult
    | Transcript
    | AudioStart
    | AudioEnd
    | Error
)
ClientNumbered = Message | ToolCallAck | ToolCallNack | ClientToolResult | Context | Interrupt | End
ServerNumbered = (
    Chunk | Done | ToolCall | ServerToolResult | Transcript | AudioStart | AudioEnd | Error
)

client_frame_decoder = msgspec.json.Decoder(ClientFrame)
server_frame_decoder = msgspec.json.Decoder(ServerFrame)
encode = msgspec.json.Encoder().encode
