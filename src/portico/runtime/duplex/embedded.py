"""The embedded duplex runtime: the demo agent, spoken to, with no network or download.

Caller audio -> VAD segmenter -> pocketsphinx (the demo's phrases) -> the demo agent's
text reply -> espeak-ng -> 20 ms frames. It counter-offers 16 kHz mono pcm16 whatever
the caller proposed (what webrtcvad and pocketsphinx hear), rather than resampling the
caller: clients already resample to the `Hello` format.

Recognition and synthesis are CPU-bound C/subprocess work of 10-300 ms: they run in a
bounded thread pool so the event loop keeps serving every other session meanwhile, and
so a burst of calls queues instead of starving the server's cores."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from portico.config import Settings
from portico.domain.model import Message, new_id
from portico.runtime.base import Chunk, TurnInput
from portico.runtime.demo import DemoRuntime
from portico.runtime.duplex.base import (
    AgentText,
    AudioFormat,
    AudioIn,
    AudioOut,
    CallEvents,
    DuplexEvent,
    DuplexStart,
    EventTaker,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)
from portico.voice import FRAME_BYTES, FRAME_MS, INSTALL_HINT, SAMPLE_RATE, VoiceUnavailable
from portico.voice.phrases import DEMO_PHRASES
from portico.voice.recognizer import PocketSphinxRecognizer, Recognizer
from portico.voice.synthesizer import EspeakSynthesizer, Synthesizer
from portico.voice.vad import Segmenter, SpeechStarted, WebRtcVad

HEARD_FORMAT = AudioFormat(sample_rate=SAMPLE_RATE, channels=1)
SPEECH_WORKERS = 2  # the machine's cores: more threads would only queue inside the GIL/OS
SPOKEN_LEAD_FRAMES = 10  # sent at once (200 ms of jitter buffer), the rest in real time


async def demo_reply(text: str, start: DuplexStart) -> str:
    """The demo agent's answer to one utterance, from its own text logic. A tool call it
    asks for gets no answer: a voice call has no client to run it."""
    now = time.time()
    message = Message(
        id=new_id("msg"),
        session_id=start.session_id,
        role="user",
        content=text,
        created_at=now,
        updated_at=now,
    )
    turn = TurnInput(
        session_id=start.session_id,
        turn_id=new_id("turn"),
        agent=start.agent,
        owner=start.owner,
        message=message,
        history_reader=start.history_reader,
    )
    stream = DemoRuntime(word_delay=0).run(turn)
    pieces: list[str] = []
    event = await stream.__anext__()
    with contextlib.suppress(StopAsyncIteration):
        while True:
            if isinstance(event, Chunk):
                pieces.append(event.text)
            event = await stream.asend(None)  # a ToolCall is answered None
    return "".join(pieces).replace("`", "").strip()


class EmbeddedVoiceCall:
    def __init__(
        self,
        start: DuplexStart,
        recognizer: Recognizer,
        synthesizer: Synthesizer,
        pool: ThreadPoolExecutor,
        frame_interval: float,
    ) -> None:
        self._start, self._recognizer, self._synthesizer = start, recognizer, synthesizer
        self._pool, self._frame_interval = pool, frame_interval
        self._segmenter = Segmenter(WebRtcVad())
        self._events = CallEvents()
        self._events.put(Hello(format=HEARD_FORMAT, capabilities=("audio",)))
        self._turn_lock = asyncio.Lock()  # one decoder per call: turns run one at a time
        self._turns: set[asyncio.Task[None]] = set()
        self._speaking: asyncio.Task[None] | None = None
        self._ended = False

    async def send(self, audio: AudioIn) -> None:
        if self._ended:
            return
        for segment in self._segmenter.feed(audio.data):
            if isinstance(segment, SpeechStarted):
                self._barge_in()
            else:
                self._spawn(self._turn(segment.audio))
        if audio.is_last:
            tail = self._segmenter.flush()
            if tail is not None:
                self._spawn(self._turn(tail.audio))
            self._spawn(self._hang_up())

    def events(self) -> AsyncIterator[DuplexEvent]:
        return self._events.drain()

    def hand_over(self, taker: EventTaker) -> None:
        """Agent audio the waiting reader would be woken for goes to `taker` (base.py)."""
        self._events.hand_over(taker)

    async def close(self) -> None:
        if self._ended:
            return
        self._ended = True
        for task in list(self._turns):
            task.cancel()
        self._events.close()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._turns.add(task)
        task.add_done_callback(self._turns.discard)

    def _barge_in(self) -> None:
        if self._speaking is not None and not self._speaking.done():
            self._speaking.cancel()
            self._events.push(Interruption())

    async def _hang_up(self) -> None:
        async with self._turn_lock:  # after the last utterance's reply
            pass
        await self.close()

    async def _turn(self, utterance: bytes) -> None:
        loop = asyncio.get_running_loop()
        async with self._turn_lock:
            heard = await loop.run_in_executor(self._pool, self._recognizer.recognize, utterance)
            if not heard or self._ended:
                return  # nothing recognised: the agent stays silent
            self._events.push(Transcript(heard, final=True))
            reply = await demo_reply(heard, self._start)
            speech = await loop.run_in_executor(self._pool, self._synthesizer.synthesize, reply)
            if self._ended:
                return
            self._events.push(AgentText(reply))
            self._speaking = asyncio.current_task()
            try:
                await self._speak(speech)
            except asyncio.CancelledError:
                if self._ended:
                    raise
                return  # barged in: the turn ends without `SpokenTurnDone`
            finally:
                self._speaking = None
            self._events.push(SpokenTurnDone())

    async def _speak(self, speech: bytes) -> None:
        media_id = new_id("voice")[-12:]
        starts = range(0, len(speech), FRAME_BYTES)
        for index, offset in enumerate(starts):
            frame = speech[offset : offset + FRAME_BYTES].ljust(FRAME_BYTES, b"\0")
            self._events.push(
                AudioOut(
                    data=frame, media_id=media_id, sequence=index, is_last=index == len(starts) - 1
                )
            )
            if index >= SPOKEN_LEAD_FRAMES:
                await asyncio.sleep(self._frame_interval)
            else:
                await asyncio.sleep(0)


class EmbeddedVoiceRuntime:
    def __init__(self, *, frame_interval: float = FRAME_MS / 1000, workers: int = SPEECH_WORKERS):
        self._frame_interval = frame_interval
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="voice")
        self._synthesizer = EspeakSynthesizer()  # stateless: one subprocess per utterance

    async def start(self, start: DuplexStart) -> EmbeddedVoiceCall:
        loop = asyncio.get_running_loop()
        recognizer = await loop.run_in_executor(self._pool, PocketSphinxRecognizer, DEMO_PHRASES)
        return EmbeddedVoiceCall(
            start, recognizer, self._synthesizer, self._pool, self._frame_interval
        )


def build(settings: Settings) -> EmbeddedVoiceRuntime:
    """The embedded runtime; raises `VoiceUnavailable` naming the extra when it is missing."""
    del settings  # its limits are the module's constants for now (see docs/voice-embedded.md)
    try:
        for library in ("pocketsphinx", "webrtcvad"):
            importlib.import_module(library)
    except ImportError as exc:
        raise VoiceUnavailable(INSTALL_HINT) from exc
    return EmbeddedVoiceRuntime()
