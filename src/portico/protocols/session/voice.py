"""A `/v1/session` voice call, sans-I/O (spec/realtime-audio.md, "On `/v1/session`").

Two halves, both session-scoped (they outlive connections, as the numbering does):

`CallerItems` reads the client's audio: OMNI binary frames (message type 1) whose
MediaID is the client's audio *item* id. An item starts with a frame of Sequence 0
(its metadata may name the format; it must be the one `ready.audio.input` chose),
goes on with Sequence 1, 2, ... and ends with the frame marked IsLast. One item is
open at a time. Every frame that breaks a rule is refused with one error and changes
nothing; the same error is not repeated until a frame is accepted, so a client that
keeps sending a broken stream gets one error, not a numbered error per frame. A
connection change loses the open item (audio in flight during a drop is lost): the
client's next audio starts a new item.

`SpokenTurns` turns the call's runtime events into the session's numbered stream:
the caller's recognised speech as `transcript` (with `transcripts` in effect), and
each spoken agent turn as a turn of its own, with a `turn_id` minted here: its text
as `chunk`s, its speech as an audio item (through `MediaItems`, as any turn's
media), and one `done` (`cancelled` after a barge-in) or one `error` at its end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import msgspec

from portico.core.events import TurnChunk, TurnCompleted, TurnMediaChunk
from portico.domain.limits import TokenBucket
from portico.domain.model import new_id
from portico.errors import (
    InvalidMessage,
    PorticoError,
    RateLimited,
    UnsatisfiableFormat,
)
from portico.protocols.omnia.binary import BinaryFrame, decode_frame
from portico.protocols.omnia.voice import AUDIO_RATE, VoiceLimits, failure_error
from portico.protocols.session import frames as f
from portico.runtime.base import MediaChunk
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

SPEECH_MEDIA_ID: Final = "speech"  # the runtime media id of speech that names none

# The exact messages of the refusals, so a client can tell them apart.
UNKNOWN_ITEM: Final = "binary frame for an unknown audio item: an item starts at Sequence 0"
ITEM_OPEN: Final = "another audio item is open: end it (IsLast) before starting the next"
ITEM_ORDER: Final = "audio item frames must arrive in order"
ITEM_FORMAT: Final = "the audio item's format is not the one ready.audio.input chose"
NO_ITEM_ID: Final = "an audio item needs a MediaID"


def runtime_format(fmt: f.AudioFormat) -> AudioFormat:
    """The duplex port's format for a chosen `ready.audio.input`."""
    return AudioFormat(
        codec=fmt.codec or PCM16, sample_rate=fmt.sample_rate or 16000, channels=fmt.channels or 1
    )


class _Item(msgspec.Struct):
    item_id: str
    next_sequence: int = 1
    refused: bool = False  # the call could not start: its frames are dropped silently


class CallerItems:
    """The client's audio items of one session (server role). Pure: time comes in."""

    def __init__(self, fmt: f.AudioFormat, limits: VoiceLimits) -> None:
        self.format = fmt  # `ready.audio.input`
        self._limits = limits
        self._item: _Item | None = None
        self._bucket: TokenBucket | None = None
        self._told: tuple[str, str] | None = None  # the last refusal: (code, message)
        self._rate_told = False
        self._heard = 0  # frames handed to the call: `AudioIn.sequence`

    @property
    def open_item(self) -> str | None:
        return None if self._item is None else self._item.item_id

    def receive(self, data: bytes, now: float) -> tuple[list[AudioIn], list[PorticoError]]:
        """One binary frame: the caller audio it carries, and the errors to send."""
        try:
            frame = decode_frame(data)
            audio = self._accept(frame)
        except PorticoError as exc:
            return [], self._tell(exc)
        self._told = None
        if self._bucket is None:
            self._bucket = TokenBucket(
                rate=self._limits.bytes_per_second, burst=self._limits.burst_bytes, now=now
            )
        if not self._bucket.allow(now, len(frame.payload)):
            # Dropped, never queued; the item goes on (its Sequence counted the frame).
            if self._rate_told:
                return [], []
            self._rate_told = True
            return [], [RateLimited(AUDIO_RATE, details={"item_id": frame.media_id})]
        self._rate_told = False
        return ([audio] if audio is not None else []), []

    def _accept(self, frame: BinaryFrame) -> AudioIn | None:
        """Check `frame` against the item rules; move the item on only when it passes."""
        item = self._item
        item_id = frame.media_id
        details = {"item_id": item_id}
        if not item_id:
            raise InvalidMessage(NO_ITEM_ID)
        if frame.sequence == 0 and (item is None or item.item_id != item_id):
            if item is not None:
                raise InvalidMessage(ITEM_OPEN, details={"item_id": item.item_id})
            if not self._same_format(frame):
                raise UnsatisfiableFormat(
                    ITEM_FORMAT, details={**details, "input": msgspec.to_builtins(self.format)}
                )
            item = _Item(item_id)
        elif item is None or item.item_id != item_id:
            raise InvalidMessage(UNKNOWN_ITEM, details=details)
        elif frame.sequence != item.next_sequence:
            raise InvalidMessage(
                ITEM_ORDER, details={**details, "expected_sequence": item.next_sequence}
            )
        else:
            item.next_sequence += 1
        self._item = None if frame.is_last else item
        if item.refused or not frame.payload:
            return None
        self._heard += 1
        # An item is a stretch of the caller's audio, not the call: the call goes on.
        return AudioIn(frame.payload, self._heard - 1)

    def _same_format(self, frame: BinaryFrame) -> bool:
        meta, fmt = frame.metadata, self.format
        codec = None if meta.codec is None else meta.codec.lower()
        return (
            (codec is None or codec in (PCM16, "pcm"))
            and meta.sample_rate in (None, fmt.sample_rate)
            and meta.channels in (None, fmt.channels)
        )

    def _tell(self, error: PorticoError) -> list[PorticoError]:
        said = (error.code, error.message)
        if said == self._told:
            return []
        self._told = said
        return [error]

    def refuse(self) -> None:
        """The call could not start for the open item: the item's later frames are
        dropped without a word (the client has its one error); the next item retries."""
        if self._item is not None:
            self._item.refused = True

    def connection_changed(self) -> None:
        """Audio in flight is lost: the open item is gone, the next frame starts one."""
        self._item = None
        self._told = None
        self._rate_told = False


def _turn_id() -> str:
    return new_id(f.VOICE_TURN_PREFIX)


VoiceOut = TurnChunk | TurnMediaChunk | TurnCompleted | f.Transcript | f.Error


class SpokenTurns:
    """The call's events as the session's messages (server role). Pure: turn ids come
    from `new_turn_id`."""

    def __init__(
        self,
        session_id: str,
        *,
        transcripts: bool,
        new_turn_id: Callable[[], str] = _turn_id,
    ) -> None:
        self._session_id = session_id
        self._transcripts = transcripts
        self._new_turn_id = new_turn_id
        self._format: AudioFormat | None = None
        self._turn: str | None = None  # the spoken turn in progress
        self._said: list[str] = []
        self._media: dict[str, int] = {}  # the turn's open speech streams: next sequence

    @property
    def turn_id(self) -> str | None:
        return self._turn

    def on_event(self, event: DuplexEvent) -> list[VoiceOut]:
        match event:
            case Hello(format=fmt):
                self._format = fmt
                return []
            case Transcript(text=text, final=final):
                if not self._transcripts or not text:
                    return []
                return [f.Transcript(seq=0, role="user", text=text, final=final)]
            case AgentText(text=text):
                turn = self._open()
                self._said.append(text)
                return [TurnChunk(session_id=self._session_id, turn_id=turn, text=text)]
            case AudioOut():
                return [self._speech(event)]
            case SpokenTurnDone(content=content):
                if self._turn is None and not content:
                    return []
                turn = self._open()
                said = "".join(self._said) if content is None else content
                return [*self._end_speech(turn), self._done(turn, said, cancelled=False)]
            case Interruption():
                return self.cut()
            case DuplexFailure():
                info = failure_error(event)
                error = f.Error(
                    seq=0,
                    turn_id=self._turn,
                    error=f.ErrorInfo(code=info.code, message=info.message, details=info.details),
                )
                self._reset()
                return [error]
        raise AssertionError(f"unhandled duplex event {type(event).__name__}")

    def cut(self) -> list[VoiceOut]:
        """The agent stopped mid-turn (barge-in, the call ended): `done` cancelled with
        what it had said; its open speech ends `lost` (the client drops it)."""
        if self._turn is None:
            return []
        return [self._done(self._turn, "".join(self._said), cancelled=True)]

    def _open(self) -> str:
        if self._turn is None:
            self._turn = self._new_turn_id()
        return self._turn

    def _speech(self, out: AudioOut) -> TurnMediaChunk:
        turn = self._open()
        fmt = self._format or AudioFormat()
        media_id = out.media_id or SPEECH_MEDIA_ID
        sequence = self._media.get(media_id, 0)
        if out.is_last:
            self._media.pop(media_id, None)
        else:
            self._media[media_id] = sequence + 1
        chunk = MediaChunk(media_id, fmt.mime_type, out.data, sequence, out.is_last)
        return TurnMediaChunk(session_id=self._session_id, turn_id=turn, chunk=chunk)

    def _end_speech(self, turn: str) -> list[VoiceOut]:
        """A runtime's speech need not mark its last frame: an empty last frame ends
        each stream the turn left open, so the client sees the item complete."""
        fmt = self._format or AudioFormat()
        ends: list[VoiceOut] = [
            TurnMediaChunk(
                session_id=self._session_id,
                turn_id=turn,
                chunk=MediaChunk(media_id, fmt.mime_type, b"", sequence, True),
            )
            for media_id, sequence in self._media.items()
        ]
        self._media = {}
        return ends

    def _done(self, turn: str, said: str, *, cancelled: bool) -> TurnCompleted:
        self._reset()
        return TurnCompleted(
            session_id=self._session_id, turn_id=turn, content=said, cancelled=cancelled
        )

    def _reset(self) -> None:
        self._turn, self._said, self._media = None, [], {}
