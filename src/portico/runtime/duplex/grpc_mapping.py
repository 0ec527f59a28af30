"""The sans-I/O half of the `grpc` duplex runtime: the contract's duplex messages to and
from the port's events (spec/runtime-contract.md, docs/runtime-grpc.md "The voice half").

`CallReader` is fed one duplex stream's `ServerMessage`s in arrival order and the
transport's news (the stream ended, broke, went silent) and answers with port events.
Whatever it is fed: `Hello` comes first or not at all, at most one `DuplexFailure`
comes out, and nothing after it. It also says which silence is a failure next
(`wait()`): the agent owes its `runtime_hello`, owes the next message of a spoken
turn it started, owes the call's end after the caller's last audio; between spoken
turns silence is the caller's and the agent's right.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from portico.contract import runtime_pb2 as pb
from portico.errors import RUNTIME_PASSTHROUGH_CODES
from portico.runtime.duplex.base import (
    AgentText,
    AudioFormat,
    AudioIn,
    AudioOut,
    DuplexEvent,
    DuplexFailure,
    DuplexStart,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)

DUPLEX_ERROR = "DUPLEX_ERROR"
# What a client may read in a failure the facade noticed: the category, never the
# cause (that is the operator's, in the log).
UNREACHABLE = "the agent's runtime is unreachable"
BROKEN = "the agent's runtime broke the call"
SILENT = "the agent's runtime did not answer in time"
MALFORMED = "the agent's runtime sent a malformed message"
FAILED = "the agent's runtime failed the call"
NO_CLIENT_TOOLS = "client tools are not available in a voice call"

Wait = Literal["hello", "turn", "ending", "none"]


class Reading(NamedTuple):
    """What one input meant: port events, messages to answer with, a note for the log."""

    events: tuple[DuplexEvent, ...] = ()
    replies: tuple[pb.ClientMessage, ...] = ()
    note: str = ""


class Malformed(Exception):
    """A message the contract does not allow here; the text names the defect, never a value."""


def duplex_start(start: DuplexStart) -> pb.ClientMessage:
    """The stream's first message: the session and the caller's format."""
    fmt = start.format
    return pb.ClientMessage(
        session_id=start.session_id,
        duplex_start=pb.DuplexStart(
            codec=fmt.codec,
            sample_rate=fmt.sample_rate,
            channels=fmt.channels,
            system_instruction=start.system_instruction,
        ),
    )


def audio_input(session_id: str, audio: AudioIn) -> pb.ClientMessage:
    # `sequence` is uint32 on the wire: a caller's numbering wraps rather than breaks.
    return pb.ClientMessage(
        session_id=session_id,
        audio_input=pb.AudioInputChunk(
            data=audio.data, sequence=audio.sequence % 2**32, is_last=audio.is_last
        ),
    )


def counter_offer(hello: pb.RuntimeHello, caller: AudioFormat) -> AudioFormat:
    """The runtime's format; a field it left unset (proto3: 0 or empty) is the caller's."""
    media = hello.media
    return AudioFormat(
        codec=media.codec or caller.codec,
        sample_rate=media.sample_rate or caller.sample_rate,
        channels=media.channels or caller.channels,
        frame_rate=media.frame_rate,
        resolution=media.resolution,
    )


class CallReader:
    """One duplex stream's `ServerMessage`s to port events; at most one failure."""

    def __init__(self, caller: AudioFormat) -> None:
        self.caller = caller
        self.greeted = False  # the runtime_hello arrived
        self.speaking = False  # a spoken turn began (agent audio or text) and has not ended
        self.ending = False  # the caller's last audio went out: the runtime ends the call
        self.ended = False
        self.failed = False

    def wait(self) -> Wait:
        """Which silence of the runtime is a failure now (the adapter has the clock)."""
        if self.ended:
            return "none"
        if not self.greeted:
            return "hello"
        if self.speaking:
            return "turn"
        return "ending" if self.ending else "none"

    def receive(self, message: pb.ServerMessage) -> Reading:
        kind = message.WhichOneof("message")
        if self.ended:
            return Reading(note=f"{kind or 'empty message'} after the call ended ignored")
        try:
            if kind == "error":
                return self._error(message.error)
            if not self.greeted and kind != "runtime_hello":
                raise Malformed(f"{kind or 'an empty message'} before runtime_hello")
            return self._member(kind, message)
        except Malformed as exc:
            return self.fail(MALFORMED, f"malformed {kind or 'message'}: {exc}")

    def _member(self, kind: str | None, message: pb.ServerMessage) -> Reading:
        match kind:
            case "runtime_hello":
                return self._hello(message.runtime_hello)
            case "media_chunk":
                chunk = message.media_chunk
                self.speaking = True
                out = AudioOut(
                    data=chunk.data,
                    media_id=chunk.media_id,
                    sequence=chunk.sequence,
                    is_last=chunk.is_last,
                )
                return Reading((out,))
            case "chunk":
                return self._chunk(message.chunk)
            case "interruption":
                self.speaking = False  # that turn was cut: no done is owed for it
                return Reading((Interruption(),))
            case "done":
                self.speaking = False
                return Reading((SpokenTurnDone(message.done.final_content or None),))
            case "tool_call":
                return self._tool_call(message.tool_call)
            case "tool_result":
                return Reading(note="server tool result (the runtime's own) not forwarded")
        raise Malformed("no known member (empty, or from a newer contract)")

    def _hello(self, hello: pb.RuntimeHello) -> Reading:
        if self.greeted:
            # A second counter-offer would change the format of audio already relayed.
            raise Malformed("a second runtime_hello")
        self.greeted = True
        fmt = counter_offer(hello, self.caller)
        return Reading((Hello(format=fmt, capabilities=tuple(hello.capabilities)),))

    def _chunk(self, chunk: pb.Chunk) -> Reading:
        if not chunk.content:
            return Reading()
        if chunk.role == "user":
            return Reading((Transcript(chunk.content),))
        self.speaking = True
        return Reading((AgentText(chunk.content),))

    def _tool_call(self, call: pb.ToolCall) -> Reading:
        if call.execution != pb.TOOL_EXECUTION_CLIENT:
            return Reading(note=f"server tool call name={call.name[:64]!r} not forwarded")
        if not call.id:
            raise Malformed("a client tool call needs an id")
        # The port has no tool calls: the runtime gets its answer at once and goes on.
        result = pb.ClientToolResult(
            call_id=call.id, is_rejected=True, rejection_reason=NO_CLIENT_TOOLS
        )
        note = f"client tool call name={call.name[:64]!r} rejected: {NO_CLIENT_TOOLS}"
        return Reading(replies=(pb.ClientMessage(client_tool_result=result),), note=note)

    def _error(self, error: pb.Error) -> Reading:
        code = error.code
        # The code only in the log: the message may quote what the call was about.
        note = f"the runtime ended the call with error code={code[:64]!r}"
        if code in RUNTIME_PASSTHROUGH_CODES:
            return self._end(DuplexFailure(code, error.message), note)
        return self._end(DuplexFailure(DUPLEX_ERROR, FAILED), note)

    def stream_ended(self) -> Reading:
        """The runtime ended the stream with status OK: the agent hung up, unless it
        owed something."""
        if self.ended:
            return Reading()
        if not self.greeted:
            why = "stream broken: the runtime ended the stream before runtime_hello"
            return self.fail(BROKEN, why)
        if self.speaking:
            return self.fail(BROKEN, "stream broken: the runtime ended the stream mid-turn")
        self.ended = True
        return Reading(note="the runtime ended the call")

    def silence(self, seconds: float) -> Reading:
        """Nothing arrived within the timeout `wait()` named."""
        owed = {
            "hello": "no runtime_hello",
            "turn": "no next message of the spoken turn",
            "ending": "the call did not end after the caller's last audio",
        }.get(self.wait(), "nothing")
        return self.fail(SILENT, f"{owed} from the runtime within {seconds:g}s")

    def fail(self, message: str, why: str) -> Reading:
        """The transport or the runtime broke the call: one `DUPLEX_ERROR`, once."""
        if self.ended:
            return Reading(note=f"{why} after the call ended")
        return self._end(DuplexFailure(DUPLEX_ERROR, message), why)

    def caller_finished(self) -> None:
        """The caller's last audio (`is_last`) went out: the runtime owes the call's end."""
        self.ending = True

    def closed(self) -> None:
        """The facade ended the call (hangup, close): nothing is owed any more."""
        self.ended = True

    def _end(self, failure: DuplexFailure, note: str) -> Reading:
        self.ended = self.failed = True
        return Reading((failure,), note=note)
