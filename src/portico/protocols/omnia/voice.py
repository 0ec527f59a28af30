"""A `/ws` connection's side of a voice call, sans-I/O (spec/realtime-audio.md).

`VoiceWire` turns decoded inbound OMNI frames into call events for the adapter
(`CallRequested` on the first frame, then `CallAudio`), and the duplex runtime's
events into `/ws` frames: `session_config`, agent audio (binary OMNI frames for a
`binary=true` client, base64 `media_chunk` for the others), `chunk` (agent text;
the caller's transcript with `role: "user"`), `interrupt`, `done` per spoken turn,
and one error per failed call.

States of the connection's call:

    IDLE     no call: the next valid frame starts one (its metadata names the format)
    LIVE     frames go to the call in order; a frame with IsLast moves to ENDING
    ENDING   the caller sent its last frame; the agent may still finish speaking
    REFUSED  the call failed or was refused: its later frames are dropped without a
             word (the client has its one error); `hangup` or an IsLast frame ends it

Decisions the spec leaves open:

- A client without `binary=true` may still send audio as OMNI frames; `binary`
  selects only how audio comes back (as the spec's "Fallback behavior" reads).
- The first frame must name `sample_rate` (or a `rate=` MIME parameter); `codec`
  defaults to pcm16 (`pcm` is read as pcm16) and `channels` to 1.
- Chunked transfers are reassembled in order (Sequence 0..total_chunks-1, one MediaID)
  up to `audio_burst_bytes`, which the rate limit would refuse beyond anyway; any
  break in the transfer discards it whole with one INVALID_MESSAGE.
- Inbound audio is rate limited per call (a token bucket over payload bytes); a run
  of refused frames gets one RATE_LIMITED, and audio is dropped, never queued.
- Agent audio is lossy on a slow client: a frame that does not fit the send queue is
  dropped (counted), so a slow reader loses speech instead of the connection.
"""

from __future__ import annotations

import base64
import re
from enum import Enum
from typing import Final

import msgspec

from portico.domain.limits import TokenBucket
from portico.errors import (
    GENERIC_INTERNAL_MESSAGE,
    RUNTIME_PASSTHROUGH_CODES,
    InvalidMessage,
    PorticoError,
    RateLimited,
)
from portico.protocols.omnia import frames as f
from portico.protocols.omnia.binary import (
    DEFAULT_SPLIT_ABOVE,
    BinaryFrame,
    BinaryMetadata,
    encode_media,
    encode_metadata,
    media_frames,
    media_id_bytes,
)
from portico.protocols.outbox import BinaryData
from portico.runtime.duplex.base import (
    PCM16,
    AgentText,
    AudioFormat,
    AudioIn,
    AudioOut,
    DuplexEvent,
    DuplexFailure,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)

UNSATISFIABLE_FORMAT: Final = "UNSATISFIABLE_FORMAT"
DUPLEX_ERROR: Final = "DUPLEX_ERROR"
MIN_SAMPLE_RATE: Final = 8000  # Hz; telephone audio
MAX_SAMPLE_RATE: Final = 192_000  # Hz
MAX_CHANNELS: Final = 8
MAX_CODEC_LENGTH: Final = 32
MAX_TOTAL_CHUNKS: Final = 65536

# The exact messages of the refusals, so a client can tell them apart.
NEEDS_FORMAT: Final = "the first audio frame's metadata must name sample_rate (and codec, channels)"
BAD_FORMAT: Final = "the audio format is out of range"
CHUNK_START: Final = "a chunked transfer must start at chunk 0 with total_chunks"
CHUNK_ORDER: Final = "chunked transfer broken: chunks must arrive in order, one transfer at a time"
CHUNK_TOO_LARGE: Final = "chunked transfer larger than audio_burst_bytes"
AUDIO_AFTER_LAST: Final = "the audio call is ending: its last frame was already sent"
AUDIO_RATE: Final = "audio byte rate exceeded"

_RATE_PARAMETER = re.compile(r";\s*rate=(\d+)")
_CHANNELS_PARAMETER = re.compile(r";\s*channels=(\d+)")


class VoiceLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Per-call limits (settings `max_audio_bytes_per_second`, `audio_burst_bytes`)."""

    bytes_per_second: int = 256 * 1024
    burst_bytes: int = 512 * 1024


class CallRequested(msgspec.Struct, frozen=True):
    """The first frame of a call: start it in `format`, then hand it `audio`."""

    format: AudioFormat
    audio: AudioIn


class CallAudio(msgspec.Struct, frozen=True):
    """The next frame of the live call's caller audio."""

    audio: AudioIn


class CallHungUp(msgspec.Struct, frozen=True):
    """`hangup`: end the call on purpose; it is not parked."""


VoiceEvent = CallRequested | CallAudio | CallHungUp
Outbound = f.ServerFrame | BinaryData


class CallState(Enum):
    IDLE = "idle"
    LIVE = "live"
    ENDING = "ending"
    REFUSED = "refused"


class _Assembly:
    def __init__(self, media_id: str, total: int) -> None:
        self.media_id = media_id
        self.total = total
        self.parts: list[bytes] = []
        self.size = 0


def caller_format(metadata: BinaryMetadata) -> AudioFormat:
    """The caller's format from a first frame's metadata; InvalidMessage when unusable."""
    mime = metadata.mime_type or ""
    rate = metadata.sample_rate
    if rate is None and (found := _RATE_PARAMETER.search(mime)):
        rate = int(found.group(1))
    channels = metadata.channels
    if channels is None and (found := _CHANNELS_PARAMETER.search(mime)):
        channels = int(found.group(1))
    if rate is None:
        raise InvalidMessage(NEEDS_FORMAT)
    codec = (metadata.codec or PCM16).lower()
    codec = PCM16 if codec == "pcm" else codec
    channels = 1 if channels is None else channels
    if not (
        MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE
        and 1 <= channels <= MAX_CHANNELS
        and 0 < len(codec) <= MAX_CODEC_LENGTH
    ):
        raise InvalidMessage(BAD_FORMAT)
    return AudioFormat(codec=codec, sample_rate=rate, channels=channels)


def failure_error(failure: DuplexFailure) -> f.ErrorInfo:
    """The one error a failed call gets. UNSATISFIABLE_FORMAT is its own code; every
    other failure is DUPLEX_ERROR, with the runtime's code as `details.reason` when it
    is a spec code (others are hidden, as on the text path)."""
    if failure.code == UNSATISFIABLE_FORMAT:
        return f.ErrorInfo(code=UNSATISFIABLE_FORMAT, message=failure.message)
    if failure.code in RUNTIME_PASSTHROUGH_CODES:
        return f.ErrorInfo(
            code=DUPLEX_ERROR, message=failure.message, details={"reason": failure.code}
        )
    return f.ErrorInfo(code=DUPLEX_ERROR, message=GENERIC_INTERNAL_MESSAGE)


class VoiceWire:
    """One connection's call, as the wire sees it. Pure: stamps come in as text."""

    def __init__(self, *, session_id: str, binary: bool, limits: VoiceLimits) -> None:
        self.session_id = session_id
        self.binary = binary
        self._limits = limits
        self.state = CallState.IDLE
        self._bucket: TokenBucket | None = None
        self._rate_told = False  # one RATE_LIMITED per run of refused frames
        self._ending_told = False
        self._assembly: _Assembly | None = None
        self._format: AudioFormat | None = None  # the runtime's (Hello), once known
        self._plain_metadata = b""  # the metadata of agent audio frames but an item's first
        self._pending_format = AudioFormat()  # the caller's, read from the call's first frame
        self._items = 0  # agent audio items sent, for their MediaIDs
        self._item: str | None = None  # the open item's MediaID
        self._item_id = b""  # the open item's MediaID as the header holds it (checked once)
        self._item_sequence = 0
        self._spoken: list[str] = []  # the agent text of the spoken turn so far
        self.audio_dropped = 0  # agent frames a slow client's queue had no room for

    # -- inbound ----------------------------------------------------------------------

    def receive(
        self, frame: BinaryFrame, now: float
    ) -> tuple[list[VoiceEvent], list[PorticoError]]:
        """A decoded inbound frame: the events for the adapter and the errors to send."""
        if self.state is CallState.REFUSED:
            if frame.is_last:
                self._reset()
            return [], []
        if self.state is CallState.ENDING:
            if self._ending_told:
                return [], []
            self._ending_told = True
            return [], [InvalidMessage(AUDIO_AFTER_LAST)]
        if self.state is CallState.IDLE and self._assembly is None:
            try:
                self._pending_format = caller_format(frame.metadata)
            except InvalidMessage as exc:
                return [], [exc]
            self._bucket = None  # a new call, a full bucket
        if self._bucket is None:
            self._bucket = TokenBucket(
                rate=self._limits.bytes_per_second, burst=self._limits.burst_bytes, now=now
            )
        if not self._bucket.allow(now, len(frame.payload)):
            self._assembly = None  # never half-applied
            if self._rate_told:
                return [], []
            self._rate_told = True
            return [], [RateLimited(AUDIO_RATE)]
        self._rate_told = False
        try:
            audio = self._payload(frame)
        except InvalidMessage as exc:
            return [], [exc]
        if audio is None:
            return [], []  # a chunk of a transfer still arriving
        return [self._deliver(audio)], []

    def _deliver(self, audio: AudioIn) -> VoiceEvent:
        if self.state is CallState.IDLE:
            self.state = CallState.ENDING if audio.is_last else CallState.LIVE
            return CallRequested(self._pending_format, audio)
        if audio.is_last:
            self.state = CallState.ENDING
        return CallAudio(audio)

    def _payload(self, frame: BinaryFrame) -> AudioIn | None:
        """The frame's payload as caller audio, reassembling chunked transfers."""
        if not frame.chunked:
            if self._assembly is not None:
                self._assembly = None
                raise InvalidMessage(CHUNK_ORDER)
            return AudioIn(frame.payload, frame.sequence, frame.is_last)
        assembly = self._assembly
        if assembly is None:
            total = frame.metadata.total_chunks
            if frame.sequence != 0 or total is None or not 1 <= total <= MAX_TOTAL_CHUNKS:
                raise InvalidMessage(CHUNK_START)
            assembly = self._assembly = _Assembly(frame.media_id, total)
        elif (
            frame.media_id != assembly.media_id
            or frame.sequence != len(assembly.parts)
            or frame.metadata.total_chunks not in (None, assembly.total)
        ):
            self._assembly = None
            raise InvalidMessage(CHUNK_ORDER)
        last_chunk = len(assembly.parts) == assembly.total - 1
        if frame.is_last and not last_chunk:
            self._assembly = None
            raise InvalidMessage(CHUNK_ORDER)
        assembly.size += len(frame.payload)
        if assembly.size > self._limits.burst_bytes:
            self._assembly = None
            raise InvalidMessage(CHUNK_TOO_LARGE)
        assembly.parts.append(frame.payload)
        if not last_chunk:
            return None
        self._assembly = None
        return AudioIn(b"".join(assembly.parts), frame.sequence, frame.is_last)

    def hangup(self) -> list[VoiceEvent]:
        """`hangup`: the live call ends on purpose; a refused one is forgotten."""
        live = self.state in (CallState.LIVE, CallState.ENDING)
        self._reset()
        return [CallHungUp()] if live else []

    # -- the adapter's answers ------------------------------------------------------

    def refuse(self, error: PorticoError, stamp: str) -> list[Outbound]:
        """The call could not start (a limit, the runtime): one error, later frames dropped."""
        self.state = CallState.REFUSED
        self._assembly = None
        info = f.ErrorInfo(code=error.code, message=error.message, details=error.details)
        return [f.ErrorFrame(error=info, session_id=self.session_id, timestamp=stamp)]

    def ended(self) -> None:
        """The call's events ended without a failure: the next frame starts a new call."""
        if self.state is not CallState.REFUSED:
            self._reset()

    def resumed(self, fmt: AudioFormat | None, stamp: str) -> list[Outbound]:
        """This connection reclaimed a parked call: it gets the format again, first
        (or when the runtime's `Hello` comes, if it had not come yet)."""
        self.state = CallState.LIVE
        self._bucket = None
        return [] if fmt is None else self._hello(Hello(format=fmt), stamp)

    def _reset(self) -> None:
        self.state = CallState.IDLE
        self._assembly = None
        self._ending_told = self._rate_told = False
        self._format = None
        self._plain_metadata = b""
        self._item = None
        self._spoken = []

    # -- outbound -------------------------------------------------------------------

    def on_event(self, event: DuplexEvent, stamp: str) -> list[Outbound]:
        """The frames one runtime event becomes on this connection."""
        if self.state is CallState.REFUSED:
            return []  # nothing follows the call's one error
        if type(event) is AudioOut and self._format is not None:
            return self._audio(event, stamp)  # 50 a second per call: before the match
        if self._format is None and not isinstance(event, Hello | DuplexFailure):
            return []  # no audio or text before `session_config` (the call rules see to it)
        session_id = self.session_id
        match event:
            case Hello():
                return self._hello(event, stamp)
            case AudioOut():
                return self._audio(event, stamp)
            case AgentText(text=text):
                self._spoken.append(text)
                return [f.ChunkFrame(content=text, session_id=session_id, timestamp=stamp)]
            case Transcript(text=text):
                if not text:
                    return []
                return [
                    f.ChunkFrame(content=text, session_id=session_id, role="user", timestamp=stamp)
                ]
            case Interruption():
                self._item, self._spoken = None, []
                return [f.InterruptFrame(session_id=session_id, timestamp=stamp)]
            case SpokenTurnDone(content=content):
                said = "".join(self._spoken) if content is None else content
                self._item, self._spoken = None, []
                return [f.DoneFrame(content=said, session_id=session_id, timestamp=stamp)]
            case DuplexFailure():
                self.state = CallState.REFUSED
                self._assembly = None
                return [
                    f.ErrorFrame(error=failure_error(event), session_id=session_id, timestamp=stamp)
                ]
        raise AssertionError(f"unhandled duplex event {type(event).__name__}")

    def _hello(self, hello: Hello, stamp: str) -> list[Outbound]:
        if self._format is not None:
            return []  # sent once per connection and call
        self._format = hello.format
        config = f.SessionConfig(
            codec=hello.format.codec,
            sample_rate=hello.format.sample_rate,
            channels=hello.format.channels,
        )
        return [
            f.SessionConfigFrame(session_config=config, session_id=self.session_id, timestamp=stamp)
        ]

    def _audio(self, out: AudioOut, stamp: str) -> list[Outbound]:
        fmt = self._format
        assert fmt is not None
        first = self._item is None
        if first:
            self._items += 1
            self._item, self._item_sequence = f"a{self._items}", 0
            self._item_id = b""  # checked when first encoded as binary
        assert self._item is not None
        media_id, sequence = self._item, self._item_sequence
        self._item_sequence += 1
        if out.is_last:
            self._item = None
        if not self.binary:
            info = f.MediaChunkInfo(
                media_id=media_id,
                sequence=sequence,
                is_last=out.is_last,
                data=base64.b64encode(out.data).decode("ascii"),
                mime_type=fmt.mime_type,
            )
            return [
                f.MediaChunkFrame(media_chunk=info, session_id=self.session_id, timestamp=stamp)
            ]
        if len(out.data) > DEFAULT_SPLIT_ABOVE:
            # A chunked transfer numbers its own chunks: it gets a MediaID of its own.
            self._items += 1
            return [
                BinaryData(frame)
                for frame in media_frames(
                    media_id=f"a{self._items}",
                    mime_type=fmt.mime_type,
                    payload=out.data,
                    session_id=self.session_id,
                    sample_rate=fmt.sample_rate,
                    channels=fmt.channels,
                    codec=fmt.codec,
                    is_last_of_stream=out.is_last,
                )
            ]
        if first:
            metadata = BinaryMetadata(
                session_id=self.session_id,
                mime_type=fmt.mime_type,
                sample_rate=fmt.sample_rate,
                channels=fmt.channels,
                codec=fmt.codec,
            )
            encoded = encode_metadata(metadata)
        else:
            # The item's later frames all carry the same metadata: encoded once a call.
            encoded = self._plain_metadata or self._encode_plain_metadata(fmt)
        return [
            BinaryData(
                encode_media(
                    encoded,
                    out.data,
                    sequence=sequence % 2**32,
                    media_id=self._item_id or self._check_item_id(media_id),
                    is_last=out.is_last,
                )
            )
        ]

    def _check_item_id(self, media_id: str) -> bytes:
        self._item_id = media_id_bytes(media_id)
        return self._item_id

    def _encode_plain_metadata(self, fmt: AudioFormat) -> bytes:
        metadata = BinaryMetadata(session_id=self.session_id, mime_type=fmt.mime_type)
        self._plain_metadata = encode_metadata(metadata)
        return self._plain_metadata
