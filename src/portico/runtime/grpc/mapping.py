"""The sans-I/O half of the `grpc` runtime: contract messages to and from runtime events.

`TurnReader` is fed the `ServerMessage`s of one turn in arrival order (and the
transport's failures: a broken stream, a timeout) and answers with the runtime
events they mean. Whatever it is fed, it produces exactly one terminal event
(`Done` or `Failure`) and nothing after it. Decisions are in docs/runtime-grpc.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from portico.contract import runtime_pb2 as pb
from portico.domain.coalesce import merge_adjacent_text
from portico.domain.memory_calls import OFFER_KEY, OFFERED, is_memory_call
from portico.domain.model import ContentPart, MediaContent
from portico.domain.validation import check_parts
from portico.errors import InternalError, InvalidMessage
from portico.runtime.base import (
    Chunk,
    Done,
    Failure,
    MediaChunk,
    RuntimeEvent,
    ToolCall,
    ToolOutcome,
    TurnInput,
    Usage,
    consent_grants,
    contract_metadata,
)

INTERNAL = InternalError.code
_encode = msgspec.json.Encoder().encode


class MemoryCall(msgspec.Struct, frozen=True):
    """A client tool call under a reserved name (`portico.memory.*`): the facade
    answers it from the turn's agent memory; it never reaches the engine or a client.
    Its arguments are checked by whoever answers it, so bad ones get a rejection."""

    id: str
    name: str
    arguments_json: str


class Reading(NamedTuple):
    """What one input meant: events for the engine (and memory calls for the facade),
    and a note for the log (or "")."""

    events: tuple[RuntimeEvent | MemoryCall, ...] = ()
    note: str = ""


class TurnReader:
    """One turn's `ServerMessage`s to runtime events; exactly one terminal event."""

    def __init__(self) -> None:
        self.ended = False
        # True when the runtime ended the turn with its `done`: its stream is in step
        # with the facade and may carry the next turn. After an `error` it is not kept,
        # so nothing the runtime still sends (a stray `done`) can reach the next turn.
        self.clean = False
        self.broken = False  # the transport failed (not a timeout, not the runtime's message)
        self._media: dict[str, tuple[int, str]] = {}  # media id -> (next sequence, mime type)
        self._finished_media: set[str] = set()

    def receive(self, message: pb.ServerMessage) -> Reading:
        if self.ended:
            late = message.WhichOneof("message") or "empty message"
            return Reading(note=f"{late} after the turn's terminal message ignored")
        kind = message.WhichOneof("message")
        try:
            match kind:
                case "chunk":
                    return self._chunk(message.chunk)
                case "tool_call":
                    return self._tool_call(message.tool_call)
                case "done":
                    return self._done(message.done)
                case "error":
                    self._end(clean=False)
                    code = message.error.code or INTERNAL
                    # The code only: the message may quote what the turn was about.
                    note = f"the runtime ended the turn with error code={code[:64]!r}"
                    return Reading((Failure(code=code, message=message.error.message),), note)
                case "media_chunk":
                    return self._media_chunk(message.media_chunk)
                case "tool_result":
                    return Reading(note="server tool result (the runtime's own) not forwarded")
                case "interruption" | "runtime_hello":
                    return Reading(note=f"{kind} outside a duplex stream ignored")
        except Malformed as exc:
            return self.fail(f"malformed {kind}: {exc}")
        return self.fail("a message with no known member (empty or from a newer contract)")

    def receive_ready(self, messages: Sequence[pb.ServerMessage]) -> Reading:
        """`receive` of messages read together, their consecutive text as one `Chunk`
        (chunk boundaries carry no meaning): never across any other event."""
        events: list[RuntimeEvent | MemoryCall] = []
        notes: list[str] = []
        for message in messages:
            reading = self.receive(message)
            events.extend(reading.events)
            if reading.note:
                notes.append(reading.note)
        return Reading(tuple(merge_adjacent_text(events, _chunk_text, Chunk)), "; ".join(notes))

    def fail(self, why: str, *, broken: bool = False) -> Reading:
        """The transport or the runtime broke the turn: one `INTERNAL_ERROR`, once."""
        if self.ended:
            return Reading(note=f"{why} after the turn ended")
        self._end(clean=False)
        self.broken = broken
        return Reading((Failure(code=INTERNAL, message=why),), note=why)

    def _end(self, *, clean: bool) -> None:
        self.ended = True
        self.clean = clean

    def _chunk(self, chunk: pb.Chunk) -> Reading:
        if chunk.role == "user":
            return Reading(note="a transcript chunk outside a duplex stream ignored")
        return Reading((Chunk(chunk.content),) if chunk.content else ())

    def _tool_call(self, call: pb.ToolCall) -> Reading:
        if call.execution != pb.TOOL_EXECUTION_CLIENT:
            # The runtime runs it: never forwarded; its name only is logged.
            return Reading(note=f"server tool call name={call.name[:64]!r} not forwarded")
        if not call.id or not call.name:
            raise Malformed("a client tool call needs id and name")
        if is_memory_call(call.name):
            return Reading((MemoryCall(call.id, call.name, call.arguments_json),))
        return Reading(
            (
                ToolCall(
                    id=call.id,
                    name=call.name,
                    arguments=_arguments(call.arguments_json),
                    consent_message=call.consent_message or None,
                    categories=tuple(call.categories),
                ),
            )
        )

    def _done(self, done: pb.Done) -> Reading:
        parts = tuple(_part(part, index) for index, part in enumerate(done.parts))
        self._end(clean=True)
        events: list[RuntimeEvent] = []
        if done.HasField("usage"):
            usage = done.usage
            events.append(Usage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens))
        events.append(Done(content=done.final_content or None, parts=parts or None))
        return Reading(tuple(events))

    def _media_chunk(self, chunk: pb.MediaChunk) -> Reading:
        media_id = chunk.media_id
        if not media_id:
            raise Malformed("media_id is empty")
        if media_id in self._finished_media:
            raise Malformed("a chunk after the stream's last one")
        expected, mime_type = self._media.get(media_id, (0, chunk.mime_type))
        if chunk.sequence != expected:
            raise Malformed(f"sequence {chunk.sequence} where {expected} was due")
        mime_type = mime_type or chunk.mime_type
        if not mime_type:
            raise Malformed("the stream's first chunk has no mime_type")
        if chunk.is_last:
            self._media.pop(media_id, None)
            self._finished_media.add(media_id)
        else:
            self._media[media_id] = (expected + 1, mime_type)
        event = MediaChunk(
            media_id=media_id,
            mime_type=mime_type,
            data=chunk.data,
            sequence=chunk.sequence,
            is_last=chunk.is_last,
        )
        return Reading((event,))


def _chunk_text(event: RuntimeEvent | MemoryCall) -> str | None:
    return event.text if isinstance(event, Chunk) else None


class Malformed(Exception):
    """A message the contract does not allow; the text names the defect, never a value."""


def _arguments(text: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        arguments = json.loads(text)
    except ValueError:
        raise Malformed("arguments_json is not JSON") from None
    if not isinstance(arguments, dict):
        raise Malformed("arguments_json is not a JSON object")
    return arguments


def _part(part: pb.ContentPart, index: int) -> ContentPart:
    raw: dict[str, Any] = {"type": part.type}
    if part.text or part.type == "text":
        raw["text"] = part.text
    if part.HasField("media"):
        media = part.media
        fields = ("data", "url", "mime_type", "storage_ref")
        raw["media"] = {name: getattr(media, name) for name in fields if getattr(media, name)}
    try:
        converted = msgspec.convert(raw, ContentPart)
        check_parts((converted,))
    except (msgspec.ValidationError, InvalidMessage):
        raise Malformed(f"done.parts[{index}] is not a valid content part") from None
    return converted


# -- facade to runtime ------------------------------------------------------------------


def client_message(turn: TurnInput) -> pb.ClientMessage:
    """The `ClientMessage` that opens a turn: text, parts, metadata (reserved keys too,
    and Portico's offer to answer memory calls when the turn has agent memory)."""
    message = turn.message
    metadata = contract_metadata(turn)
    metadata.pop(OFFER_KEY, None)  # the facade's to say, not a client's
    if turn.memory is not None:
        metadata[OFFER_KEY] = OFFERED
    return pb.ClientMessage(
        session_id=turn.session_id,
        content=message.content,
        metadata=metadata,
        parts=[_contract_part(part) for part in message.parts],
        consent_grants=consent_grants(metadata),
    )


def _contract_part(part: ContentPart) -> pb.ContentPart:
    converted = pb.ContentPart(type=part.type, text=part.text or "")
    if part.media is not None:
        converted.media.CopyFrom(_contract_media(part.media))
    return converted


def _contract_media(media: MediaContent) -> pb.MediaContent:
    return pb.MediaContent(
        data=media.data or "",
        url=media.url or "",
        mime_type=media.mime_type,
        storage_ref=media.storage_ref or "",
    )


def tool_result(call_id: str, outcome: ToolOutcome | None) -> pb.ClientMessage:
    """A client tool call's outcome as `client_tool_result`: a denial is `is_rejected`."""
    if outcome is None or outcome.status == "denied":
        reason = "" if outcome is None else outcome.error or ""
        result = pb.ClientToolResult(call_id=call_id, is_rejected=True, rejection_reason=reason)
    elif outcome.status == "error":
        body = _encode({"error": outcome.error or ""}).decode()
        result = pb.ClientToolResult(call_id=call_id, result_json=body)
    else:
        result = pb.ClientToolResult(call_id=call_id, result_json=_encode(outcome.result).decode())
    return pb.ClientMessage(client_tool_result=result)
