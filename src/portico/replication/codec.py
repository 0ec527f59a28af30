"""Bus payloads: turn events and control messages as msgpack, each tagged with its kind.

The events keep their types (core/events.py); an envelope names the kind and the
replica that published it, so a decoder picks the event's own type and a reader skips
what its own replica published.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from portico.core.events import (
    TurnChunk,
    TurnCompleted,
    TurnEvent,
    TurnFailed,
    TurnMediaChunk,
    TurnToolCall,
    TurnToolCallTimedOut,
)
from portico.core.tools import ClientReply, RtcStep


class UpdateNotice(msgspec.Struct, frozen=True):
    """An archive update another replica committed: its offset; the archive has it."""

    owner: str
    offset: int


_KINDS: dict[type[Any], str] = {
    UpdateNotice: "update",
    TurnChunk: "chunk",
    TurnMediaChunk: "media",
    TurnToolCall: "tool_call",
    TurnToolCallTimedOut: "tool_timeout",
    TurnCompleted: "completed",
    TurnFailed: "failed",
}
_DECODERS: dict[str, msgspec.msgpack.Decoder[Any]] = {
    kind: msgspec.msgpack.Decoder(event_type) for event_type, kind in _KINDS.items()
}


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    origin: str  # the replica that published it
    kind: str
    body: msgspec.Raw


class Published(msgspec.Struct, frozen=True):
    origin: str
    event: TurnEvent | UpdateNotice


_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(Envelope)


def encode_event(origin: str, event: TurnEvent | UpdateNotice) -> bytes:
    body = msgspec.Raw(_encoder.encode(event))
    return _encoder.encode(Envelope(origin, _KINDS[type(event)], body))


def decode_event(payload: bytes) -> Published:
    """Raises `msgspec.ValidationError`/`DecodeError` or `KeyError` on a foreign payload."""
    envelope = _envelope.decode(payload)
    return Published(envelope.origin, _DECODERS[envelope.kind].decode(envelope.body))


# -- control --------------------------------------------------------------------------------


class Request(msgspec.Struct, frozen=True, kw_only=True, tag="request"):
    id: str
    reply_to: str  # the asking replica's inbox
    op: Literal["stop", "tool", "rtc", "call"]
    session_id: str = ""
    principal: str = ""
    call_id: str = ""  # op "call": the token of the voice call to let go of
    reply: ClientReply | None = None
    rtc: RtcStep | None = None


class Reply(msgspec.Struct, frozen=True, kw_only=True, tag="reply"):
    id: str
    value: bool = False
    error_code: str = ""  # "" when the request succeeded
    error_message: str = ""


Control = Request | Reply
_control = msgspec.msgpack.Decoder(Control)


def encode_control(message: Control) -> bytes:
    return _encoder.encode(message)


def decode_control(payload: bytes) -> Control:
    return _control.decode(payload)
