"""The voice handler API: a live call, for an agent that hears and speaks.

A voice agent is one async function of a `VoiceCall`, beside the text handler::

    async def voice(call: VoiceCall) -> None:
        async for frame in call.audio():          # the caller's audio, in order
            if heard_enough(frame):
                await call.transcript("what the caller said")
                await call.say("The agent's words")   # text of the agent's speech
                await call.speak(pcm)                  # the agent's audio, in `call.format`
                await call.turn_done()                 # one per spoken turn

The call ends when the handler returns (the agent hangs up) or the caller hangs up
(`audio()` ends; the handler may still answer, then returns). `raise AgentError(code,
message)` ends it with that error; any other exception with `INTERNAL_ERROR`. A call
the facade drops cancels the handler (`asyncio.CancelledError` at its current await).

`portico agent serve module:handler --voice module:voice` serves it on the same port
as the text handler (docs/agents.md, "Voice"). Nothing here needs the `grpc` extra.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import msgspec

PCM16 = "pcm16"  # signed 16-bit little-endian linear PCM


class AudioFormat(msgspec.Struct, frozen=True, kw_only=True):
    """A format as the contract names it (`DuplexStart`, `MediaNegotiation`)."""

    codec: str = PCM16
    sample_rate: int = 16000
    channels: int = 1


class AudioFrame(msgspec.Struct, frozen=True):
    """One frame of the caller's audio, in `call.caller_format`."""

    data: bytes
    sequence: int
    is_last: bool = False


class VoiceOutput(Protocol):
    """Where a call's output goes: the adapter (the gRPC stream) implements it."""

    async def hello(self, fmt: AudioFormat, capabilities: tuple[str, ...]) -> None: ...

    async def audio(self, data: bytes, media_id: str, sequence: int, is_last: bool) -> None: ...

    async def text(self, text: str, *, user: bool) -> None: ...

    async def interruption(self) -> None: ...

    async def turn_done(self, content: str) -> None: ...


DEFAULT_CAPABILITIES = ("audio", "transcripts")


class VoiceCall:
    """One caller on the line: their audio in, the agent's speech, text and turns out.

    The first thing a call sends is its counter-offer (the contract's `runtime_hello`):
    `accept()` sends it with the format the agent speaks and hears; a handler that does
    not call it gets the caller's own format, sent when it first reads audio or sends
    anything. Methods are safe to call from several tasks (a speaker task beside the
    listening loop): their messages go out one at a time, in call order.
    """

    def __init__(
        self,
        *,
        session_id: str,
        caller_format: AudioFormat,
        system_instruction: str,
        frames: asyncio.Queue[AudioFrame | None],
        output: VoiceOutput,
    ) -> None:
        self.session_id = session_id
        self.caller_format = caller_format  # what the caller sends (`DuplexStart`)
        self.system_instruction = system_instruction
        self.format = caller_format  # what the agent speaks: `accept()` changes it
        self._frames = frames
        self._output = output
        self._greeted = False
        self._lock = asyncio.Lock()
        self._listening = False
        self._audio_sequence = 0

    async def accept(
        self,
        fmt: AudioFormat | None = None,
        *,
        capabilities: tuple[str, ...] = DEFAULT_CAPABILITIES,
    ) -> None:
        """Send the counter-offer: `fmt` (None: the caller's). Once, before anything else;
        a second call raises `RuntimeError` (the facade already relayed the first)."""
        async with self._lock:
            if self._greeted:
                raise RuntimeError("the call's format was already sent")
            await self._greet(fmt or self.caller_format, tuple(capabilities))

    async def audio(self) -> AsyncIterator[AudioFrame]:
        """The caller's frames, in order, until the caller's last (`is_last`) or hangup.

        Read it once. Frames the handler has not read wait in a bounded queue; a full one
        stops reading the stream (the caller is held back), so keep reading."""
        if self._listening:
            raise RuntimeError("a call's audio is read once")
        self._listening = True
        await self._ensure_greeted()
        while (frame := await self._frames.get()) is not None:
            yield frame
            if frame.is_last:
                return

    async def speak(self, pcm: bytes, *, media_id: str = "", is_last: bool = False) -> None:
        """Agent audio in `self.format` (any length; send it at the pace it should be
        heard, or at once: the facade relays it as it comes)."""
        async with self._lock:
            await self._greet_once()
            sequence, self._audio_sequence = self._audio_sequence, self._audio_sequence + 1
            await self._output.audio(pcm, media_id, sequence, is_last)

    async def say(self, text: str) -> None:
        """The text of what the agent says (a `chunk`): streamed to the client, archived."""
        if text:
            await self._send(lambda: self._output.text(text, user=False))

    async def transcript(self, text: str) -> None:
        """What the caller said, recognised: one call per utterance (`chunk`, role user)."""
        if text:
            await self._send(lambda: self._output.text(text, user=True))

    async def interrupted(self) -> None:
        """The caller barged in and the agent stopped speaking: clients drop the audio
        they buffered. The cut turn needs no `turn_done`."""
        await self._send(self._output.interruption)

    async def turn_done(self, content: str = "") -> None:
        """The end of one spoken turn; `content` is its text when `say` did not stream it."""
        await self._send(lambda: self._output.turn_done(content))

    async def _send(self, emit: Callable[[], Awaitable[None]]) -> None:
        async with self._lock:
            await self._greet_once()
            await emit()

    async def _ensure_greeted(self) -> None:
        async with self._lock:
            await self._greet_once()

    async def _greet_once(self) -> None:
        if not self._greeted:
            await self._greet(self.caller_format, DEFAULT_CAPABILITIES)

    async def _greet(self, fmt: AudioFormat, capabilities: tuple[str, ...]) -> None:
        self._greeted = True
        self.format = fmt
        await self._output.hello(fmt, capabilities)

    async def finish(self) -> None:
        """For the adapter, once the handler is done (or failed): a call that never
        greeted greets now, so the facade hears the contract's `runtime_hello` first."""
        await self._ensure_greeted()


VoiceHandler = Callable[[VoiceCall], Awaitable[None]]
