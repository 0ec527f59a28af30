"""A voice agent: it listens for an utterance and answers it with a tone.

Served in its own process, behind `runtime: grpc` (the voice half of the contract):
    portico agent serve examples.voice_agent.agent:handler \\
        --voice examples.voice_agent.agent:voice --port 50051

It hears by loudness only (no speech recognition): an utterance is loud frames
followed by `PAUSE_FRAMES` of quiet. It reports what it heard as the caller's
transcript ("N ms of speech"), says "I heard you." and speaks a 440 Hz tone as long
as the utterance (at most a second), paced in real time; a loud frame while it
speaks is barge-in: it stops, and says so (`interrupted`). The text handler answers
typed messages of the same session.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import struct
from collections.abc import AsyncIterator

from portico.agent import AudioFormat, Reply, Turn, VoiceCall

FRAME_MS = 20
LOUD_PEAK = 500  # a PCM16 frame with a sample at least this loud is speech
PAUSE_FRAMES = 10  # 200 ms of quiet ends an utterance
MAX_TONE_MS = 1000


async def handler(turn: Turn) -> AsyncIterator[Reply]:
    yield f"I am a voice agent: call me. You typed {len(turn.text)} characters."


async def voice(call: VoiceCall) -> None:
    await call.accept(AudioFormat(sample_rate=call.caller_format.sample_rate, channels=1))
    speaker: asyncio.Task[None] | None = None
    loud = quiet = 0
    try:
        async for frame in call.audio():
            if _peak(frame.data) >= LOUD_PEAK:
                if speaker is not None and not speaker.done():
                    speaker.cancel()  # barge-in: the caller talks over the agent
                    await asyncio.gather(speaker, return_exceptions=True)
                    await call.interrupted()
                loud, quiet = loud + 1, 0
            elif loud:
                quiet += 1
            if loud and quiet >= PAUSE_FRAMES:
                speaker = asyncio.create_task(_answer(call, loud * FRAME_MS))
                loud = quiet = 0
        if speaker is not None:
            await speaker  # the caller's last audio: finish the answer, then hang up
    finally:
        if speaker is not None:
            speaker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await speaker


async def _answer(call: VoiceCall, heard_ms: int) -> None:
    await call.transcript(f"{heard_ms} ms of speech")
    await call.say("I heard you.")
    for frame in tone(call.format, min(heard_ms, MAX_TONE_MS)):
        await call.speak(frame)
        await asyncio.sleep(FRAME_MS / 1000)  # at the pace it is heard
    await call.turn_done()


def tone(fmt: AudioFormat, milliseconds: int, hz: float = 440.0) -> list[bytes]:
    """A sine in `fmt` (PCM16), cut into 20 ms frames."""
    per_frame = fmt.sample_rate * FRAME_MS // 1000
    total = fmt.sample_rate * milliseconds // 1000
    frames = []
    for start in range(0, total, per_frame):
        count = min(per_frame, total - start)
        samples = [
            int(8000 * math.sin(2 * math.pi * hz * (start + i) / fmt.sample_rate))
            for i in range(count)
            for _ in range(fmt.channels)
        ]
        frames.append(struct.pack(f"<{len(samples)}h", *samples))
    return frames


def _peak(pcm: bytes) -> int:
    samples = struct.unpack(f"<{len(pcm) // 2}h", pcm[: len(pcm) // 2 * 2])
    return max((abs(sample) for sample in samples), default=0)
