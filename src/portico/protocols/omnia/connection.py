"""The `/ws` protocol core, sans-I/O.

Feed it what the socket received (`receive_text`, `receive_binary`,
`receive_control`) and what the engine produced (`send_turn_event`,
`send_error`); drain `data_to_send()` for text frames to write and act on the
events it returns. Time arrives as a `now` argument (the adapter's monotonic
clock; the wall-clock time at one `now` is given once, to stamp every frame's
`timestamp`); the adapter owns timers and asks `keepalive(now)` what is due.
"""

from __future__ import annotations

import base64
import re
from enum import Enum
from typing import Any

import msgspec

from portico.auth.base import Identity
from portico.core.events import (
    TurnChunk,
    TurnCompleted,
    TurnEvent,
    TurnFailed,
    TurnMediaChunk,
    TurnToolCall,
    TurnToolCallTimedOut,
)
from portico.domain.limits import TokenBucket
from portico.domain.memory import NO_FACET, valid_facet
from portico.domain.model import ContentPart
from portico.domain.validation import (
    base64_decoded_size,
    check_parts,
    declare_fits,
    split_metadata,
)
from portico.errors import (
    BinaryFrameError,
    CredentialExpired,
    FacetRefused,
    InvalidMessage,
    MediaNotEnabled,
    PorticoError,
    RateLimited,
)
from portico.protocols.credential import clock_for
from portico.protocols.omnia import frames as f
from portico.protocols.omnia.binary import decode_frame
from portico.protocols.omnia.voice import (
    CallAudio,
    CallHungUp,
    CallRequested,
    Outbound,
    VoiceLimits,
    VoiceWire,
)
from portico.protocols.outbox import BinaryData, Outbox
from portico.protocols.timestamps import Timestamps
from portico.runtime.duplex.base import AudioFormat, AudioOut, DuplexEvent

PROTOCOL_VERSION = 1
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
CLOSE_KEEPALIVE_TIMEOUT = 1011
CLOSE_SLOW_CONSUMER = 4008  # the client stopped reading and its send queue filled

_encode = msgspec.json.Encoder().encode


class MessageReceived(msgspec.Struct, frozen=True, kw_only=True):
    """A valid `message` frame, resolved to the session it is for."""

    session_id: str
    own_session: bool
    content: str
    parts: tuple[ContentPart, ...]
    metadata: dict[str, str]
    directives: dict[str, str]
    declare: dict[str, Any] | None
    # Over 16 KiB: refused only if this message opens its session, which the core
    # cannot know (the archive can); on any later message declare is ignored.
    declare_too_large: bool = False


class ToolReply(msgspec.Struct, frozen=True):
    """A client's `tool_call_ack`, `tool_call_nack` or `tool_result`, for the broker."""

    call_id: str
    frame: f.ToolResultFrame | f.ToolCallAckFrame | f.ToolCallNackFrame


class UploadRequested(msgspec.Struct, frozen=True):
    session_id: str
    request: f.UploadRequest


class DisclosureAcknowledged(msgspec.Struct, frozen=True):
    """`disclosure_ack`: the client says it showed the AI disclosure (no reply)."""

    session_id: str


class LimitHit(msgspec.Struct, frozen=True):
    """Input was shed by a rate limit (the client already has its RATE_LIMITED)."""

    limit: str  # "messages", "media_bytes" or "audio_bytes"


class RefreshOffered(msgspec.Struct, frozen=True):
    """A `credential_refresh`: the adapter verifies the token and calls `refresh`."""

    token: str


Event = (
    MessageReceived
    | ToolReply
    | UploadRequested
    | DisclosureAcknowledged
    | LimitHit
    | RefreshOffered
    | CallRequested
    | CallAudio
    | CallHungUp
)


class ConnectionLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Per-connection limits; every one a setting (see config.Settings)."""

    max_payload_size: int
    ping_interval: float
    pong_timeout: float
    messages_per_second: float = 50.0
    message_burst: int = 100
    media_bytes_per_second: int = 2 * 1024 * 1024
    media_burst_bytes: int = 16 * 1024 * 1024  # one maximal frame of media at once
    max_send_queue_bytes: int = 4 * 1024 * 1024  # backlog bound; past it close 4008
    credential_margin: float = 30.0  # close 4401 this long before the token's exp


class Keepalive(Enum):
    PING = "ping"
    CLOSE = "close"


class _MediaRateExceeded(RateLimited):
    def __init__(self) -> None:
        super().__init__("media byte rate exceeded")


def memory_facet_of(values: list[str], fixed: str | None) -> str:
    """The connection's memory facet from the upgrade's `memory_facet` values and the
    agent's fixed facet: `InvalidMessage` (400) for a malformed, empty or repeated
    parameter, `FacetRefused` (403) for one other than the agent's."""
    if len(values) > 1:
        raise InvalidMessage("memory_facet is given more than once")
    if values and not valid_facet(values[0]):
        raise InvalidMessage(
            "memory_facet must be 1 to 128 ASCII letters, digits and . _ : / -, "
            "starting with a letter or digit"
        )
    named = values[0] if values else None
    if fixed is not None and named is not None and named != fixed:
        raise FacetRefused("this agent's memory facet is fixed; another is refused")
    return named or fixed or NO_FACET


class OmniaConnection:
    # One per `/ws` connection, most of them idle: slots, not a dict (docs/performance.md).
    __slots__ = (
        "_clock",
        "_last_received",
        "_limits",
        "_media_bytes",
        "_messages",
        "_next_ping",
        "_outbox",
        "_told_no_audio",
        "credential",
        "session_id",
        "voice",
    )

    def __init__(
        self,
        *,
        session_id: str,
        binary: bool,
        limits: ConnectionLimits,
        now: float,
        wall: float,
        memory_facet: str = NO_FACET,
        ai_disclosure: bool | None = None,
        identity: Identity | None = None,
        voice: VoiceLimits | None = None,
        resumed: bool | None = None,
    ) -> None:
        """`wall` is the wall-clock time (Unix seconds) at `now`; `identity` the
        connection's verified credential (its `expires_at` is the deadline); `voice`
        the call limits when the agent takes calls (None: binary media is refused);
        `resumed` is `connected.resumed` (None: the client asked for no resume)."""
        self.session_id = session_id
        self.credential = clock_for(
            identity or Identity(principal=""), margin=limits.credential_margin, now=now, wall=wall
        )
        self._clock: Timestamps | float = Timestamps(now=now, wall=wall)
        self._limits = limits
        self._last_received = now
        self._next_ping = now + limits.ping_interval
        self._outbox = Outbox(limits.max_send_queue_bytes)
        self._told_no_audio = False
        self.voice = (
            None if voice is None else VoiceWire(session_id=session_id, binary=binary, limits=voice)
        )
        # Made at the first frame that spends from them: a bucket starts full, so one
        # made then is the one made now (an idle connection holds neither).
        self._messages: TokenBucket | None = None
        self._media_bytes: TokenBucket | None = None
        # `connected` is the first frame and is sent once per connection.
        self._queue(
            f.ConnectedFrame(
                session_id=session_id,
                connected=f.ConnectedInfo(
                    capabilities=f.Capabilities(
                        binary_frames=binary,
                        max_payload_size=limits.max_payload_size,
                        protocol_version=PROTOCOL_VERSION,
                    ),
                    resumed=resumed,
                    memory_facet=memory_facet or None,
                    ai_disclosure=ai_disclosure,
                ),
                timestamp=self._stamps.at(now),
            )
        )
        # Most connections then wait: an idle one keeps only the clock's offset, no
        # `Timestamps` (made again at the next frame, `_stamps`).
        self._clock = self._stamps.offset

    @property
    def _stamps(self) -> Timestamps:
        clock = self._clock
        if not isinstance(clock, Timestamps):  # an offset (a number: int is a float here)
            self._clock = clock = Timestamps(now=0.0, wall=clock)
        return clock

    # -- output -----------------------------------------------------------------

    def _queue(self, frame: f.ServerFrame) -> None:
        self._outbox.put(_encode(frame))

    @property
    def overflowed(self) -> bool:
        """The client stopped reading and its send queue filled."""
        return self._outbox.overflowed

    def next_frame(self) -> bytes | None:
        """The next encoded text frame to write, or None when the outbox is empty."""
        return self._outbox.pop()

    def data_to_send(self) -> list[bytes]:
        """Every queued text frame, in order; draining empties the outbox."""
        return self._outbox.drain()

    def send_error(self, error: PorticoError, session_id: str | None = None, *, now: float) -> None:
        info = f.ErrorInfo(code=error.code, message=error.message, details=error.details)
        self._queue(f.ErrorFrame(error=info, session_id=session_id, timestamp=self._stamps.at(now)))

    def send_upload_ready(self, session_id: str, ready: f.UploadReady, *, now: float) -> None:
        frame = f.UploadReadyFrame(
            upload_ready=ready, session_id=session_id, timestamp=self._stamps.at(now)
        )
        self._queue(frame)

    def send_turn_event(self, event: TurnEvent, now: float) -> None:
        # _queue and the stamp's cache hit, inlined: this runs once per chunk.
        stamps = self._stamps
        stamp = stamps.text if stamps.since <= now < stamps.until else stamps.at(now)
        self._outbox.put(_encode(turn_event_frame(event, stamp)))

    # -- input ------------------------------------------------------------------

    def receive_text(self, data: str | bytes, now: float) -> list[Event]:
        self._last_received = now
        if not self._message_bucket(now).allow(now):
            self.send_error(RateLimited("too many messages; slow down"), now=now)
            return [LimitHit("messages")]
        try:
            frame = f.client_frame_decoder.decode(data)
        except msgspec.DecodeError as exc:
            self.send_error(InvalidMessage(f"Failed to parse message: {exc}"), now=now)
            return []
        except RecursionError:
            # msgspec refuses pathological nesting this way, even inside ignored fields.
            self.send_error(InvalidMessage("Failed to parse message: nested too deeply"), now=now)
            return []
        if isinstance(frame, f.CredentialRefreshFrame):
            return [RefreshOffered(frame.token)]
        if isinstance(frame, f.MessageFrame | f.UploadRequestFrame) and self.credential.expired(
            now
        ):
            # New work after the deadline is refused; tool replies still end a running turn.
            session_id = frame.session_id or None
            self.send_error(CredentialExpired(), session_id, now=now)
            return []
        try:
            return self._dispatch(frame)
        except _MediaRateExceeded as exc:
            self.send_error(exc, getattr(frame, "session_id", None) or None, now=now)
            return [LimitHit("media_bytes")]
        except InvalidMessage as exc:
            self.send_error(exc, getattr(frame, "session_id", None) or None, now=now)
            return []

    def receive_binary(self, data: bytes, now: float) -> list[Event]:
        """Decode an inbound binary frame; without an audio session it has nowhere to go."""
        self._last_received = now
        if not self._media_bucket(now).allow(now, len(data)):
            self.send_error(RateLimited("media byte rate exceeded"), now=now)
            return [LimitHit("media_bytes")]
        try:
            frame = decode_frame(data)
        except BinaryFrameError as exc:
            self.send_error(exc, now=now)
            return []
        if self.voice is not None:
            voice_events, errors = self.voice.receive(frame, now)
            if not errors:
                return list(voice_events)  # a call's every frame: no any(), no unpacking
            for error in errors:
                self.send_error(error, self.session_id, now=now)
            limited = any(isinstance(error, RateLimited) for error in errors)
            return [*voice_events, *([LimitHit("audio_bytes")] if limited else [])]
        if not self._told_no_audio:
            # One refusal per connection, not one per frame of a stream.
            self._told_no_audio = True
            refusal = MediaNotEnabled("no audio session: binary media is not accepted")
            self.send_error(refusal, now=now)
        return []

    def _message_bucket(self, now: float) -> TokenBucket:
        if self._messages is None:
            limits = self._limits
            self._messages = TokenBucket(
                rate=limits.messages_per_second, burst=limits.message_burst, now=now
            )
        return self._messages

    def _media_bucket(self, now: float) -> TokenBucket:
        """A burst as large as one frame's inline attachment; beyond that the rate holds."""
        if self._media_bytes is None:
            limits = self._limits
            self._media_bytes = TokenBucket(
                rate=limits.media_bytes_per_second, burst=limits.media_burst_bytes, now=now
            )
        return self._media_bytes

    def receive_control(self, now: float) -> None:
        """A ping or pong arrived: the peer is alive."""
        self._last_received = now

    def _dispatch(self, frame: f.ClientFrame) -> list[Event]:
        match frame:
            case f.MessageFrame():
                return [self._message(frame)]
            case f.ToolResultFrame():
                return [ToolReply(frame.tool_result.call_id, frame)]
            case f.ToolCallAckFrame():
                return [ToolReply(frame.tool_call_ack.call_id, frame)]
            case f.ToolCallNackFrame():
                return [ToolReply(frame.tool_call_nack.call_id, frame)]
            case f.UploadRequestFrame():
                session_id, _ = self._resolve_session(frame.session_id)
                return [UploadRequested(session_id, frame.upload_request)]
            case f.DisclosureAckFrame():
                return [DisclosureAcknowledged(self.session_id)]
            case f.HangupFrame():
                return list(self.voice.hangup()) if self.voice is not None else []
        return []

    # -- voice calls ----------------------------------------------------------------

    def send_duplex_event(self, event: DuplexEvent, now: float) -> None:
        """Queue what one runtime event of this connection's call becomes."""
        voice = self.voice
        if voice is None:
            return
        audio = type(event) is AudioOut
        # Binary agent audio carries no timestamp: not formatted for each of its frames.
        stamp = "" if audio and voice.binary else self._stamps.at(now)
        self._put_voice(voice.on_event(event, stamp), lossy=audio)

    def refuse_call(self, error: PorticoError, now: float) -> None:
        """The call asked for by `CallRequested` could not start."""
        if self.voice is not None:
            self._put_voice(self.voice.refuse(error, self._stamps.at(now)), lossy=False)

    def call_ended(self) -> None:
        if self.voice is not None:
            self.voice.ended()

    def call_resumed(self, fmt: AudioFormat | None, now: float) -> None:
        """This connection reclaimed a parked call in `fmt` (the runtime's format; None
        when its `Hello` is still to come)."""
        if self.voice is not None:
            self._put_voice(self.voice.resumed(fmt, self._stamps.at(now)), lossy=False)

    def _put_voice(self, frames: list[Outbound], *, lossy: bool) -> None:
        for frame in frames:
            data = frame if isinstance(frame, BinaryData) else _encode(frame)
            if lossy and not self._outbox.has_room(len(data)):
                # Speech for a client that does not keep up is dropped, not queued.
                assert self.voice is not None
                self.voice.audio_dropped += 1
                continue
            self._outbox.put(data)

    # -- credential ---------------------------------------------------------------

    def refresh(self, identity: Identity, *, now: float, wall: float) -> bool:
        """A verified `credential_refresh` token: taken, or ignored; never a reply."""
        if self.credential.expired(now):
            return False  # too late: the connection is closing for its expired credential
        return self.credential.refresh(identity, now=now, wall=wall)

    def expiry_due(self, now: float, *, turn_running: bool) -> bool:
        """Whether to close with 4401 "credential expired" now."""
        return self.credential.close_due(now, turn_running=turn_running)

    def _resolve_session(self, session_id: str | None) -> tuple[str, bool]:
        if not session_id or session_id == self.session_id:
            return self.session_id, True
        if not SESSION_ID_PATTERN.fullmatch(session_id):
            raise InvalidMessage(
                "session_id must be 1 to 128 characters of letters, digits, '_', '.', ':' or '-'"
            )
        return session_id, False

    def _message(self, frame: f.MessageFrame) -> MessageReceived:
        session_id, own = self._resolve_session(frame.session_id)
        parts = frame.parts or ()
        if not frame.content and not parts:
            raise InvalidMessage("a message needs `content` or `parts`")
        check_parts(parts)
        # Media bytes, as binary frames count them: decoded, not their base64 text.
        inline = sum(
            base64_decoded_size(p.media.data) for p in parts if p.media is not None and p.media.data
        )
        now = self._last_received
        if inline and not self._media_bucket(now).allow(now, inline):
            raise _MediaRateExceeded()
        forwarded, directives = split_metadata(frame.metadata or {})
        return MessageReceived(
            session_id=session_id,
            own_session=own,
            content=frame.content or "",
            parts=parts,
            metadata=forwarded,
            directives=directives,
            declare=frame.declare,
            declare_too_large=frame.declare is not None and not declare_fits(frame.declare),
        )

    # -- keepalive --------------------------------------------------------------

    def keepalive(self, now: float) -> Keepalive | None:
        """What is due now: a ping, a close for silence, or nothing."""
        if now - self._last_received >= self._limits.pong_timeout:
            return Keepalive.CLOSE
        if now >= self._next_ping:
            self._next_ping = now + self._limits.ping_interval
            return Keepalive.PING
        return None

    def next_deadline(self) -> float:
        return min(
            self._next_ping,
            self._last_received + self._limits.pong_timeout,
            self.credential.next_deadline(),
        )


def turn_event_frame(event: TurnEvent, timestamp: str) -> f.ServerFrame:
    """The `/ws` frame for one engine event, sent at `timestamp`."""
    session_id = event.session_id
    if type(event) is TurnChunk:  # most events by far: skip the match below
        return f.ChunkFrame(content=event.text, session_id=session_id, timestamp=timestamp)
    match event:
        case TurnChunk(text=text):
            return f.ChunkFrame(content=text, session_id=session_id, timestamp=timestamp)
        case TurnCompleted(content=content, parts=parts):
            return f.DoneFrame(
                content=content, parts=parts, session_id=session_id, timestamp=timestamp
            )
        case TurnFailed(code=code, message=message):
            return f.ErrorFrame(
                error=f.ErrorInfo(code=code, message=message),
                session_id=session_id,
                timestamp=timestamp,
            )
        case TurnMediaChunk(chunk=chunk):
            info = f.MediaChunkInfo(
                media_id=chunk.media_id,
                sequence=chunk.sequence,
                is_last=chunk.is_last,
                data=base64.b64encode(chunk.data).decode("ascii"),
                mime_type=chunk.mime_type,
            )
            return f.MediaChunkFrame(media_chunk=info, session_id=session_id, timestamp=timestamp)
        case TurnToolCall(call=call):
            info_call = f.ToolCallInfo(
                id=call.id,
                name=call.name,
                arguments=call.arguments,
                consent_message=call.consent_message,
                categories=call.categories or None,
            )
            return f.ToolCallFrame(tool_call=info_call, session_id=session_id, timestamp=timestamp)
        case TurnToolCallTimedOut(call_id=call_id, error=error):
            result = f.ServerToolResult(id=call_id, error=error)
            return f.ToolResultServerFrame(
                tool_result=result, session_id=session_id, timestamp=timestamp
            )
    raise AssertionError(f"unhandled turn event {type(event).__name__}")
