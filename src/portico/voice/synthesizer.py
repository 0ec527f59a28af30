"""Speech synthesis with eSpeak NG's binary: one `espeak-ng --stdout` per utterance,
with a timeout and a bound on the output, resampled to 16 kHz."""

from __future__ import annotations

import array
import io
import shutil
import subprocess
import sys
import wave
from typing import Protocol

from portico.voice import SAMPLE_RATE, VoiceUnavailable


class Synthesizer(Protocol):
    def synthesize(self, text: str) -> bytes:
        """`text` spoken as pcm16 16 kHz mono."""


def resample(pcm: bytes, source_rate: int, target_rate: int = SAMPLE_RATE) -> bytes:
    """Linear-interpolation resampling of pcm16 mono (speech, not music: good enough)."""
    if source_rate == target_rate or not pcm:
        return pcm
    source = array.array("h", pcm[: len(pcm) // 2 * 2])
    if sys.byteorder != "little":
        source.byteswap()
    count = len(source) * target_rate // source_rate
    step = source_rate / target_rate
    last = len(source) - 1
    out = array.array("h", bytes(2 * count))
    for index in range(count):
        position = index * step
        left = int(position)
        right = min(left + 1, last)
        fraction = position - left
        out[index] = int(source[left] + (source[right] - source[left]) * fraction)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


class EspeakSynthesizer:
    def __init__(
        self, *, voice: str = "en-us", timeout: float = 10.0, max_bytes: int = 8_000_000
    ) -> None:
        binary = shutil.which("espeak-ng")
        if binary is None:
            raise VoiceUnavailable(
                "the embedded voice agent speaks with espeak-ng: apt-get install espeak-ng"
            )
        self._binary, self._voice, self._timeout, self._max_bytes = (
            binary,
            voice,
            timeout,
            max_bytes,
        )

    def synthesize(self, text: str) -> bytes:
        # The text goes on stdin, never the command line: no option injection, no length limit.
        completed = subprocess.run(
            [self._binary, "-v", self._voice, "--stdout"],
            input=text.encode(),
            capture_output=True,
            timeout=self._timeout,
            check=True,
        )
        wav = completed.stdout[: self._max_bytes]
        with wave.open(io.BytesIO(wav)) as reader:
            rate = reader.getframerate()
            pcm = reader.readframes(reader.getnframes())
        return resample(pcm, rate)
