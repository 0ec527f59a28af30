"""The `openai-realtime` duplex runtime: a voice call over the OpenAI Realtime API.

One WebSocket per call to `{base_url}/realtime?model=...` (docs/voice-runtimes.md).
The API speaks pcm16 at 24 kHz mono in both directions, so the runtime
counter-offers exactly that in its `Hello` and the caller resamples: no
resampler on the server, and the caller hears what the model said, unaltered.

`RealtimeMapping` is the sans-I/O core: it turns one server event into the
port's events plus the client events to answer with (barge-in answers
`response.cancel`). `RealtimeCall` is the thin adapter around the socket.
Both event-name generations are understood (`response.audio.delta` of the beta
and `response.output_audio.delta` of the GA interface).

Failures are the provider codes of the text runtime: a refused handshake with
401/403 is `PROVIDER_AUTH_FAILED`, 429 `PROVIDER_RATE_LIMITED`, an unreachable
endpoint or a socket closed mid-call `PROVIDER_UNAVAILABLE`, a handshake past
`first_token_timeout` `PROVIDER_TIMEOUT`. Messages name the model, never the
provider's response.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from portico.config import AgentSettings
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
    DuplexRuntime,
    DuplexStart,
    EventTaker,
    FailedCall,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)
from portico.runtime.provider import (
    AUTH_FAILED,
    RATE_LIMITED,
    TIMEOUT,
    UNAVAILABLE,
    key_headers,
)

REALTIME_FORMAT = AudioFormat(codec=PCM16, sample_rate=24000, channels=1)

AUDIO_DELTAS = frozenset({"response.audio.delta", "response.output_audio.delta"})
TEXT_DELTAS = frozenset(
    {
        "response.audio_transcript.delta",
        "response.output_audio_transcript.delta",
        "response.text.delta",
        "response.output_text.delta",
    }
)
HARMLESS_ERRORS = frozenset({"response_cancel_not_active"})  # a cancel racing the turn's end

Json = dict[str, Any]
_decode = msgspec.json.Decoder(dict[str, Any])
_encode = msgspec.json.Encoder()


def session_update(instructions: str) -> Json:
    """The call's first client event: audio both ways, server VAD, transcripts."""
    session: Json = {
        "modalities": ["audio", "text"],
        "input_audio_format": "pcm16",
        "output_audio_format": "pcm16",
        "input_audio_transcription": {"model": "whisper-1"},
        "turn_detection": {"type": "server_vad"},
    }
    if instructions:
        session["instructions"] = instructions
    return {"type": "session.update", "session": session}


def audio_append(audio: AudioIn) -> list[Json]:
    """The client events one caller frame becomes; the last frame also asks for a reply."""
    events: list[Json] = []
    if audio.data:
        encoded = base64.b64encode(audio.data).decode("ascii")
        events.append({"type": "input_audio_buffer.append", "audio": encoded})
    if audio.is_last:
        events += [{"type": "input_audio_buffer.commit"}, {"type": "response.create"}]
    return events


def error_code(error: Mapping[str, Any]) -> str:
    """The port's failure code for a Realtime `error` event's `error` object."""
    code = str(error.get("code") or "")
    if code in ("invalid_api_key", "authentication_error"):
        return AUTH_FAILED
    if code in ("rate_limit_exceeded", "insufficient_quota"):
        return RATE_LIMITED
    return UNAVAILABLE


def handshake_code(status: int) -> str:
    if status in (401, 403):
        return AUTH_FAILED
    if status == 429:
        return RATE_LIMITED
    return UNAVAILABLE


@dataclass
class RealtimeMapping:
    """Server events in, port events and client replies out; no I/O, no clock."""

    model: str
    responding: bool = False  # a response is in progress (barge-in must cancel it)
    sequence: int = 0
    failed: bool = False
    replies: list[Json] = field(default_factory=list)

    def on_event(self, event: Mapping[str, Any]) -> list[DuplexEvent]:
        kind = str(event.get("type", ""))
        if kind == "response.created":
            self.responding = True
        elif kind in AUDIO_DELTAS:
            return self._audio(event)
        elif kind in TEXT_DELTAS:
            return [AgentText(str(event.get("delta", "")))]
        elif kind == "conversation.item.input_audio_transcription.delta":
            return [Transcript(str(event.get("delta", "")), final=False)]
        elif kind == "conversation.item.input_audio_transcription.completed":
            return [Transcript(str(event.get("transcript", "")), final=True)]
        elif kind == "input_audio_buffer.speech_started":
            return self._barge_in()
        elif kind == "response.done":
            return self._response_done(event)
        elif kind == "error":
            return self._error(event)
        return []

    def take_replies(self) -> list[Json]:
        replies, self.replies = self.replies, []
        return replies

    def on_text(self, text: str | bytes) -> list[DuplexEvent]:
        """One WebSocket text message; one that is not a JSON object fails the call."""
        try:
            event = _decode.decode(text)
        except msgspec.DecodeError:
            return self._fail(UNAVAILABLE, f"the model {self.model} sent a malformed event")
        return self.on_event(event)

    def _audio(self, event: Mapping[str, Any]) -> list[DuplexEvent]:
        try:
            data = base64.b64decode(str(event.get("delta", "")), validate=True)
        except ValueError:  # binascii.Error, or a delta that is not ASCII
            return self._fail(UNAVAILABLE, f"the model {self.model} sent malformed audio")
        self.sequence += 1
        media_id = str(event.get("item_id") or event.get("response_id") or "")
        return [AudioOut(data=data, media_id=media_id, sequence=self.sequence)]

    def _barge_in(self) -> list[DuplexEvent]:
        if not self.responding:
            return []  # the caller started a new utterance; nobody was speaking
        self.responding = False
        self.replies.append({"type": "response.cancel"})
        return [Interruption()]

    def _response_done(self, event: Mapping[str, Any]) -> list[DuplexEvent]:
        self.responding = False
        response = event.get("response") or {}
        if isinstance(response, Mapping) and response.get("status") == "failed":
            return self._fail(UNAVAILABLE, f"the model {self.model} failed the response")
        return [SpokenTurnDone()]

    def _error(self, event: Mapping[str, Any]) -> list[DuplexEvent]:
        error = event.get("error") or {}
        error = error if isinstance(error, Mapping) else {}
        if error.get("code") in HARMLESS_ERRORS:
            return []
        code = error_code(error)
        return self._fail(code, f"the model {self.model} reported an error ({code})")

    def _fail(self, code: str, message: str) -> list[DuplexEvent]:
        self.failed = True
        return [DuplexFailure(code, message)]


class RealtimeCall:
    """One call's socket: `send` appends audio, `events` reads the server's events."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        ws: aiohttp.ClientWebSocketResponse,
        model: str,
    ) -> None:
        self._http = http
        self._ws = ws
        self._mapping = RealtimeMapping(model=model)
        self._closed = False
        self._ending = False  # the caller's last frame went out: end after the reply
        self._write = asyncio.Lock()
        # A task reads the socket into the call's queue (rather than `events()` reading
        # it itself), so agent audio can be handed over (base.py `EventQueue`).
        self._events = CallEvents()
        self._events.put(Hello(format=REALTIME_FORMAT, capabilities=("barge_in", "transcripts")))
        self._broke: Exception | None = None  # what stopped the reading task, raised to the reader
        self._reading = asyncio.ensure_future(self._read())

    async def send(self, audio: AudioIn) -> None:
        if self._closed or self._ending:
            return
        self._ending = audio.is_last
        await self._send_all(audio_append(audio))

    async def configure(self, instructions: str) -> None:
        """The call's first client event, before any audio (`session_update`)."""
        await self._send_all([session_update(instructions)])

    def hand_over(self, taker: EventTaker) -> None:
        """Agent audio the waiting reader would be woken for goes to `taker` (base.py)."""
        self._events.hand_over(taker)

    async def events(self) -> AsyncIterator[DuplexEvent]:
        try:
            async for event in self._events.drain():
                yield event
            if self._broke is not None:
                raise self._broke
        finally:
            await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._events.close()
        if self._reading is not asyncio.current_task():
            self._reading.cancel()
        with contextlib.suppress(Exception):
            await self._ws.close()
        await self._http.close()

    async def _read(self) -> None:
        try:
            async for event in self._provider_events():
                self._events.push(event)
        except Exception as exc:  # a bug: the reader raises it, as when it read itself
            self._broke = exc
        finally:
            self._events.close()

    async def _provider_events(self) -> AsyncIterator[DuplexEvent]:
        while not self._closed:
            message = await self._ws.receive()
            if message.type != aiohttp.WSMsgType.TEXT:
                if not self._closed:
                    yield self._dropped()
                return
            events = self._mapping.on_text(message.data)
            # Answered before the events are handed on: a barge-in's cancel must not
            # wait for the reader to come back for more.
            await self._send_all(self._mapping.take_replies())
            for event in events:
                yield event
                if isinstance(event, DuplexFailure):
                    return
                if isinstance(event, SpokenTurnDone) and self._ending:
                    return

    def _dropped(self) -> DuplexFailure:
        model = self._mapping.model
        return DuplexFailure(UNAVAILABLE, f"the model {model} closed the call")

    async def _send_all(self, events: list[Json]) -> None:
        async with self._write:
            for event in events:
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await self._ws.send_str(_encode.encode(event).decode())


class OpenAIRealtimeRuntime:
    def __init__(self, agent: AgentSettings, *, api_key: str | None) -> None:
        assert agent.base_url, "check_openai_agent() requires a base_url"
        assert agent.model, "check_openai_agent() requires a model"
        self._url = f"{agent.base_url.rstrip('/')}/realtime"
        self._model = agent.model
        self._key_headers = key_headers(agent, api_key)
        self._timeout = agent.first_token_timeout

    async def start(self, start: DuplexStart) -> DuplexCall:
        http = aiohttp.ClientSession()
        try:
            ws = await asyncio.wait_for(self._connect(http), self._timeout)
        except BaseException as exc:
            await http.close()
            if not isinstance(exc, Exception):
                raise
            return FailedCall(self._connect_failure(exc))
        call = RealtimeCall(http, ws, self._model)
        await call.configure(start.system_instruction)
        return call

    async def _connect(self, http: aiohttp.ClientSession) -> aiohttp.ClientWebSocketResponse:
        headers = {"OpenAI-Beta": "realtime=v1", **self._key_headers}
        return await http.ws_connect(
            self._url, params={"model": self._model}, headers=headers, autoping=True
        )

    def _connect_failure(self, exc: Exception) -> DuplexFailure:
        if isinstance(exc, aiohttp.WSServerHandshakeError):
            code = handshake_code(exc.status)
        elif isinstance(exc, TimeoutError):
            code = TIMEOUT
        else:
            code = UNAVAILABLE
        return DuplexFailure(code, f"the model {self._model} could not be reached ({code})")


def build(agent: AgentSettings, env: Mapping[str, str]) -> DuplexRuntime:
    """The runtime for an agent; the key is read from `api_key_env` here, never stored
    in the settings."""
    api_key = env.get(agent.api_key_env) if agent.api_key_env else None
    return OpenAIRealtimeRuntime(agent, api_key=api_key)
