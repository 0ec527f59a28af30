"""A duplex `Converse` stream served to a voice handler (`portico agent serve --voice`).

The stream opened with `duplex_start`: its `audio_input` chunks feed `call.audio()`,
and what the handler sends goes out as the contract's duplex messages:
`runtime_hello` first (its `accept()`, else the caller's format), then `media_chunk`
(agent audio), `chunk` (agent text; role "user": the caller's transcript),
`interruption`, `done` per spoken turn. The handler returning ends the stream (status
OK: the agent hung up); raising ends it with one `error` (docs/agents.md, "Voice").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from portico.agent.options import AgentOptions
from portico.agent.voice import PCM16, AudioFormat, AudioFrame, VoiceCall, VoiceHandler
from portico.contract import runtime_pb2 as pb
from portico.errors import GENERIC_INTERNAL_MESSAGE, AgentError, InternalError

log = logging.getLogger("portico.agent")
Write = Callable[[pb.ServerMessage], Awaitable[Any]]


def mime_type_of(fmt: AudioFormat) -> str:
    if fmt.codec == PCM16:
        return f"audio/pcm;rate={fmt.sample_rate};channels={fmt.channels}"
    return f"audio/{fmt.codec}"


class StreamOutput:
    """`VoiceOutput` onto the stream: one `ServerMessage` per output."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self._mime_type = ""

    async def hello(self, fmt: AudioFormat, capabilities: tuple[str, ...]) -> None:
        self._mime_type = mime_type_of(fmt)
        media = pb.MediaNegotiation(
            codec=fmt.codec, sample_rate=fmt.sample_rate, channels=fmt.channels
        )
        hello = pb.RuntimeHello(capabilities=capabilities, media=media)
        await self._write(pb.ServerMessage(runtime_hello=hello))

    async def audio(self, data: bytes, media_id: str, sequence: int, is_last: bool) -> None:
        chunk = pb.MediaChunk(
            media_id=media_id,
            sequence=sequence % 2**31,  # int32 on the wire: a long call wraps
            is_last=is_last,
            mime_type=self._mime_type,
            data=data,
        )
        await self._write(pb.ServerMessage(media_chunk=chunk))

    async def text(self, text: str, *, user: bool) -> None:
        chunk = pb.Chunk(content=text, role="user" if user else "")
        await self._write(pb.ServerMessage(chunk=chunk))

    async def interruption(self) -> None:
        await self._write(pb.ServerMessage(interruption=pb.Interruption()))

    async def turn_done(self, content: str) -> None:
        await self._write(pb.ServerMessage(done=pb.Done(final_content=content)))


def caller_format(start: pb.DuplexStart) -> AudioFormat:
    """The caller's format; a field the facade left unset is the default's."""
    default = AudioFormat()
    return AudioFormat(
        codec=start.codec or default.codec,
        sample_rate=start.sample_rate or default.sample_rate,
        channels=start.channels or default.channels,
    )


async def serve_voice_call(
    handler: VoiceHandler,
    opening: pb.ClientMessage,
    requests: AsyncIterator[pb.ClientMessage],
    write: Write,
    options: AgentOptions,
) -> None:
    """Run one call to its end: the handler's return, its error, or the facade's cancel."""
    session_id = opening.session_id
    frames: asyncio.Queue[AudioFrame | None] = asyncio.Queue(options.max_queued_audio_frames)
    call = VoiceCall(
        session_id=session_id,
        caller_format=caller_format(opening.duplex_start),
        system_instruction=opening.duplex_start.system_instruction,
        frames=frames,
        output=StreamOutput(write),
    )
    reader = asyncio.create_task(_read(requests, frames, session_id))
    try:
        failure = await _run(handler, call)
        await call.finish()
        if failure is not None:
            await write(pb.ServerMessage(error=failure))
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def _run(handler: VoiceHandler, call: VoiceCall) -> pb.Error | None:
    try:
        await handler(call)
    except AgentError as exc:
        return pb.Error(code=exc.runtime_code, message=exc.message)
    except Exception:
        # The traceback is for the agent's operator; the facade gets a generic error.
        log.exception("agent voice handler raised session=%s", call.session_id)
        return pb.Error(code=InternalError.code, message=GENERIC_INTERNAL_MESSAGE)
    return None


async def _read(
    requests: AsyncIterator[pb.ClientMessage],
    frames: asyncio.Queue[AudioFrame | None],
    session_id: str,
) -> None:
    heard_last = False
    async for message in requests:
        if not message.HasField("audio_input") or heard_last:
            kind = "audio after the caller's last" if heard_last else "a non-audio message"
            log.warning("%s on a duplex stream dropped session=%s", kind, session_id)
            continue
        chunk = message.audio_input
        heard_last = chunk.is_last
        # A full queue waits: the stream is not read, so gRPC holds the caller back.
        await frames.put(AudioFrame(chunk.data, chunk.sequence, chunk.is_last))
    # The facade closed its side (the caller hung up): `audio()` ends.
    await frames.put(None)
