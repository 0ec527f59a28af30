"""The `scripted` duplex runtime: a deterministic voice agent for tests and frontend work.

Script (YAML or JSON; docs/voice.md):

    format: {codec: pcm16, sample_rate: 16000, channels: 1}  # counter-offer; absent: the caller's
    silence_peak: 500      # a frame whose PCM16 peak is under this is silence
    echo: false            # true: every caller frame comes straight back as agent audio
    turns:                 # taken in order, one per utterance; the last one repeats
      - hear_frames: 5     # speak after this many loud frames...
        transcript: hello  # ...reported as the caller's words
        reply: Hi there    # the agent's text
        tone_ms: 400       # a sine of this length is the agent's speech, in 20 ms frames
        tone_hz: 440
      - after_silence_frames: 10   # or: speak once speech is followed by this much silence
        fail: {code: PROVIDER_UNAVAILABLE, message: the script says so}

While the agent speaks (a spoken turn lasts from its start to its `SpokenTurnDone`,
the pause after its last frame included), a loud caller frame is barge-in: the rest of
its speech is dropped and `Interruption` follows instead of the done. So turns never
overlap: the next utterance can only be heard once the agent's turn has ended. The
rules live in `ScriptedCall`, which is sans-I/O (frames in, events out);
`ScriptedDuplexRuntime` only queues them.
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections import deque
from collections.abc import AsyncIterator
from typing import Annotated

import msgspec

from portico.config_errors import read_yaml
from portico.errors import ScriptError
from portico.runtime.duplex.base import (
    PCM16,
    AgentText,
    AudioFormat,
    AudioIn,
    AudioOut,
    CallEvents,
    DuplexCall,
    DuplexEvent,
    DuplexFailure,
    DuplexStart,
    EventTaker,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)

FRAME_MS = 20
Positive = Annotated[int, msgspec.Meta(ge=1)]


class FailStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    code: str
    message: str = "the scripted call failed"


class VoiceTurn(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    hear_frames: Positive | None = None
    after_silence_frames: Positive | None = None
    transcript: str = ""
    reply: str = ""
    tone_ms: Annotated[int, msgspec.Meta(ge=0)] = 200
    tone_hz: Annotated[float, msgspec.Meta(gt=0)] = 440.0
    fail: FailStep | None = None


class VoiceScript(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: AudioFormat | None = None
    silence_peak: Annotated[int, msgspec.Meta(ge=0, le=32768)] = 500
    echo: bool = False
    turns: tuple[VoiceTurn, ...] = (VoiceTurn(hear_frames=5),)


def peak(pcm: bytes) -> int:
    """The largest absolute PCM16 sample of a frame (an odd trailing byte is ignored)."""
    samples = struct.unpack(f"<{len(pcm) // 2}h", pcm[: len(pcm) // 2 * 2])
    return max((abs(sample) for sample in samples), default=0)


def tone(fmt: AudioFormat, milliseconds: int, hz: float) -> list[bytes]:
    """A sine in `fmt`, cut into 20 ms frames (the last may be shorter)."""
    per_frame = fmt.sample_rate * FRAME_MS // 1000
    total = fmt.sample_rate * milliseconds // 1000
    frames = []
    for start in range(0, total, per_frame):
        count = min(per_frame, total - start)
        values = (
            int(8000 * math.sin(2 * math.pi * hz * (start + i) / fmt.sample_rate))
            for i in range(count)
            for _ in range(fmt.channels)
        )
        frames.append(struct.pack(f"<{count * fmt.channels}h", *values))
    return frames


class ScriptedCall:
    """The rules of one scripted call, sans-I/O: `hear` a frame, get the events it causes."""

    def __init__(self, script: VoiceScript, caller: AudioFormat) -> None:
        self.script = script
        self.format = script.format or AudioFormat(
            codec=PCM16, sample_rate=caller.sample_rate, channels=caller.channels
        )
        self._turn_index = 0
        self._loud = 0
        self._silent_after_speech = 0
        self._speaking: deque[bytes] = deque()
        self._turn_open = False  # a spoken turn started and has not ended (done or barge-in)
        self._turn_started = False
        self.ended = False

    def opening(self) -> list[DuplexEvent]:
        return [Hello(format=self.format, capabilities=("audio", "transcripts"))]

    def hear(self, frame: AudioIn) -> list[DuplexEvent]:
        if self.ended:
            return []
        if self.script.echo:
            return [AudioOut(data=frame.data, sequence=frame.sequence)]
        loud = peak(frame.data) >= self.script.silence_peak
        if loud and self._turn_open:
            self._speaking.clear()
            self._turn_open = False
            self._loud = 1
            return [Interruption()]
        return self._count(loud)

    def take_turn_started(self) -> bool:
        """Whether the last frame started a spoken turn (asked once per turn)."""
        started, self._turn_started = self._turn_started, False
        return started

    def next_speech(self) -> AudioOut | None:
        """The next frame of agent speech, or None when it is not speaking."""
        return AudioOut(data=self._speaking.popleft()) if self._speaking else None

    def end_of_speech(self) -> SpokenTurnDone | None:
        """The end of the spoken turn whose speech has all been taken (once), or None:
        no turn is open (none started, or it was barged in on), or it has speech left."""
        if not self._turn_open or self._speaking:
            return None
        self._turn_open = False
        return SpokenTurnDone()

    def _count(self, loud: bool) -> list[DuplexEvent]:
        turn = self._current()
        if loud:
            self._loud += 1
            self._silent_after_speech = 0
        elif self._loud:
            self._silent_after_speech += 1
        heard = turn.hear_frames is not None and self._loud >= turn.hear_frames
        paused = (
            turn.after_silence_frames is not None
            and self._loud > 0
            and self._silent_after_speech >= turn.after_silence_frames
        )
        return self._respond(turn) if heard or paused else []

    def _current(self) -> VoiceTurn:
        turns = self.script.turns
        return turns[min(self._turn_index, len(turns) - 1)]

    def _respond(self, turn: VoiceTurn) -> list[DuplexEvent]:
        self._turn_index += 1
        self._loud = self._silent_after_speech = 0
        if turn.fail is not None:
            self.ended = True
            return [DuplexFailure(turn.fail.code, turn.fail.message)]
        events: list[DuplexEvent] = []
        if turn.transcript:
            events.append(Transcript(turn.transcript))
        if turn.reply:
            events.append(AgentText(turn.reply))
        self._speaking.extend(tone(self.format, turn.tone_ms, turn.tone_hz))
        self._turn_open = self._turn_started = True
        return events


class _Call:
    def __init__(self, core: ScriptedCall, frame_interval: float) -> None:
        self._core = core
        self._interval = frame_interval
        self._events = CallEvents()
        self._closed = False
        self._speaker: asyncio.Task[None] | None = None
        self._ender: asyncio.Task[None] | None = None
        self._put(core.opening())

    async def send(self, audio: AudioIn) -> None:
        if self._closed:
            return
        self._put(self._core.hear(audio))
        if self._core.ended:
            self._finish()
            return
        if self._core.take_turn_started():
            self._ensure_speaker()
        if audio.is_last:
            self._finish_after_speech()

    def events(self) -> AsyncIterator[DuplexEvent]:
        return self._events.drain()

    async def close(self) -> None:
        self._finish()

    def hand_over(self, taker: EventTaker) -> None:
        """Events the waiting reader would be woken for go to `taker` first (base.py)."""
        self._events.hand_over(taker)

    def _put(self, events: list[DuplexEvent]) -> None:
        for event in events:
            self._events.push(event)

    def _ensure_speaker(self) -> None:
        if self._speaker is None or self._speaker.done():
            self._speaker = asyncio.create_task(self._speak())

    async def _speak(self) -> None:
        # The core says when a turn ends: a barge-in during a pause ends it without its
        # done, and a turn started since (only after that barge-in) is spoken on here.
        while (frame := self._core.next_speech()) is not None and not self._closed:
            self._events.push(frame)
            # Speech at the pace a caller hears it (or as fast as read, for tests).
            await asyncio.sleep(self._interval)
        done = self._core.end_of_speech()
        if done is not None and not self._closed:
            self._events.push(done)

    def _finish_after_speech(self) -> None:
        async def later() -> None:
            if self._speaker is not None:
                await self._speaker
            self._finish()

        self._ender = asyncio.create_task(later())

    def _finish(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._speaker is not None and self._speaker is not asyncio.current_task():
            self._speaker.cancel()
        self._events.close()


class ScriptedDuplexRuntime:
    def __init__(self, script: VoiceScript, *, frame_interval: float = FRAME_MS / 1000) -> None:
        self.script = script
        self.frame_interval = frame_interval

    @classmethod
    def from_file(cls, path: str) -> ScriptedDuplexRuntime:
        return cls(load_voice_script(path))

    async def start(self, start: DuplexStart) -> DuplexCall:
        return _Call(ScriptedCall(self.script, start.format), self.frame_interval)


def load_voice_script(path: str) -> VoiceScript:
    try:
        return msgspec.convert(read_yaml(path, "voice script"), VoiceScript)
    except msgspec.ValidationError as exc:
        raise ScriptError(f"voice script {path}: {exc}") from None
