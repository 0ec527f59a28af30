"""Voice activity detection and utterance segmentation (sans-I/O over 20 ms frames)."""

from __future__ import annotations

from typing import Protocol

import msgspec

from portico.voice import FRAME_BYTES, INSTALL_HINT, SAMPLE_RATE, VoiceUnavailable


class SpeechDetector(Protocol):
    def is_speech(self, frame: bytes) -> bool:
        """Whether one 20 ms pcm16 16 kHz mono frame holds speech."""


class WebRtcVad:
    def __init__(self, aggressiveness: int = 2) -> None:
        try:
            import webrtcvad  # type: ignore[import-untyped]
        except ImportError as exc:
            raise VoiceUnavailable(INSTALL_HINT) from exc
        self._vad = webrtcvad.Vad(aggressiveness)

    def is_speech(self, frame: bytes) -> bool:
        return bool(self._vad.is_speech(frame, SAMPLE_RATE))


class SpeechStarted(msgspec.Struct, frozen=True):
    """The caller started speaking (barge-in when the agent is talking)."""


class Utterance(msgspec.Struct, frozen=True):
    audio: bytes


class Segmenter:
    """Cuts the caller's audio into utterances: speech starts after `start_frames` voiced
    frames in a row (one click is no speech), and ends after `end_frames` unvoiced ones.
    Frames arrive in any size; they are regrouped into 20 ms frames."""

    def __init__(
        self,
        detector: SpeechDetector,
        *,
        start_frames: int = 3,
        end_frames: int = 25,
        max_frames: int = 500,
    ) -> None:
        self._detector = detector
        self._start_frames, self._end_frames, self._max_frames = (
            start_frames,
            end_frames,
            max_frames,
        )
        self._pending = b""
        self._voiced_run = 0
        self._silent_run = 0
        self._lead: list[bytes] = []  # frames before speech was confirmed
        self._speech: list[bytes] | None = None

    def feed(self, data: bytes) -> list[SpeechStarted | Utterance]:
        self._pending += data
        events: list[SpeechStarted | Utterance] = []
        while len(self._pending) >= FRAME_BYTES:
            frame, self._pending = self._pending[:FRAME_BYTES], self._pending[FRAME_BYTES:]
            event = self._frame(frame)
            if event is not None:
                events.append(event)
        return events

    def flush(self) -> Utterance | None:
        """The utterance in progress when the caller's audio ends."""
        if self._speech is None:
            return None
        audio, self._speech = b"".join(self._speech), None
        return Utterance(audio)

    def _frame(self, frame: bytes) -> SpeechStarted | Utterance | None:
        voiced = self._detector.is_speech(frame)
        if self._speech is None:
            self._voiced_run = self._voiced_run + 1 if voiced else 0
            self._lead = ([*self._lead, frame])[-self._start_frames - 5 :]
            if self._voiced_run >= self._start_frames:
                self._speech, self._lead, self._silent_run = list(self._lead), [], 0
                return SpeechStarted()
            return None
        self._speech.append(frame)
        self._silent_run = 0 if voiced else self._silent_run + 1
        if self._silent_run >= self._end_frames or len(self._speech) >= self._max_frames:
            self._voiced_run = 0
            return self.flush()
        return None
