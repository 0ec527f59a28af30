"""The embedded voice agent as a duplex runtime factory, plus the test caller's voice.

The duplex contract suite can include `embedded_runtime`; the speech tests use
`spoken` to make a caller's utterance with espeak-ng (a voice unlike the agent's)."""

from __future__ import annotations

import io
import subprocess
import wave

from portico.config import Settings
from portico.runtime.duplex.base import DuplexRuntime, DuplexStart
from portico.runtime.duplex.embedded import EmbeddedVoiceRuntime, build
from portico.voice import FRAME_BYTES
from portico.voice.synthesizer import resample

CALLER_VOICE = "en-us+f3"  # the espeak variant pocketsphinx hears best (8 of 9 demo phrases)


async def embedded_runtime(*, frame_interval: float = 0.0) -> DuplexRuntime:
    """The runtime `build()` makes, speaking `frame_interval` apart (0: as fast as read)."""
    build(Settings())  # checks the speech packages are there, as the server does
    return EmbeddedVoiceRuntime(frame_interval=frame_interval)


def start_of(session_id: str = "voice-1") -> DuplexStart:
    from portico.runtime.duplex.embedded import HEARD_FORMAT

    return DuplexStart(session_id=session_id, agent="demo", owner="alice", format=HEARD_FORMAT)


def spoken(text: str, *, pad_ms: int = 300) -> bytes:
    """`text` said by the test caller, pcm16 16 kHz mono, with silence either side."""
    wav = subprocess.run(
        ["espeak-ng", "-v", CALLER_VOICE, "--stdout"],
        input=text.encode(),
        capture_output=True,
        timeout=30,
        check=True,
    ).stdout
    with wave.open(io.BytesIO(wav)) as reader:
        pcm = resample(reader.readframes(reader.getnframes()), reader.getframerate())
    silence = bytes(32 * pad_ms)
    return silence + pcm + silence


def frames(pcm: bytes) -> list[bytes]:
    return [pcm[i : i + FRAME_BYTES] for i in range(0, len(pcm), FRAME_BYTES)]
