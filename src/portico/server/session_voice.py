"""A `/v1/session` session's voice call: the thin adapter between the sans-I/O halves
(`protocols/session/voice.py`) and the call service `/ws` uses (`calls/service.py`).

The session's first audio starts a call (with the format `ready.audio.input` chose);
the call then lasts as long as the session: through drops and resumes (it keeps
running in the resume window, its numbered messages wait in the resend buffer, its
audio reaches no one), until `end`, the window's end, or its own end or failure,
after which the client's next item starts a new call (the rest of the item it was
sending is dropped). So the session is the call's parking:
`/v1/session` needs no parking lot of its own.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from portico.calls.service import LiveCall
from portico.errors import PorticoError, RateLimited
from portico.protocols.session import frames as f
from portico.protocols.session.voice import CallerItems, SpokenTurns, VoiceOut, runtime_format
from portico.runtime.duplex.base import AudioIn, DuplexEvent, DuplexFailure
from portico.server.duplex import voice_limits
from portico.server.services import Services
from portico.store.base import detached

Emit = Callable[[VoiceOut], None]


def _error(exc: PorticoError) -> f.Error:
    return f.Error(
        seq=0, error=f.ErrorInfo(code=exc.code, message=exc.message, details=exc.details)
    )


class SessionCall:
    def __init__(
        self,
        *,
        session_id: str,
        owner: str,
        binding: str,
        agent: str,
        heard: f.AudioFormat,
        transcripts: bool,
        services: Services,
        emit: Emit,
    ) -> None:
        limits = voice_limits(services.settings, services.calls, agent)
        assert limits is not None  # `ready.audio.input` is chosen only for such agents
        self.items = CallerItems(heard, limits)
        self.turns = SpokenTurns(session_id, transcripts=transcripts)
        self._session_id = session_id
        self._owner = owner
        self._binding = binding
        self._agent = agent
        self._services = services
        self._emit = emit
        self._call: LiveCall | None = None
        self._epoch = 0  # events of an earlier call of this session are ignored
        self._starting = asyncio.Lock()
        self._closed = False

    async def receive(self, data: bytes, now: float) -> None:
        """One binary frame from the client."""
        audio, errors = self.items.receive(data, now)
        for error in errors:
            if isinstance(error, RateLimited):
                self._services.metrics.rate_limited.labels("audio_bytes").inc()
            self._emit(_error(error))
        for frame in audio:
            await self._send(frame)

    async def _send(self, audio: AudioIn) -> None:
        call = self._call
        if call is None or call.over:
            async with self._starting:
                call = self._call
                if call is None or call.over:
                    call = await self._start()
            if call is None:
                self.items.refuse()
                return
        await call.send(audio)

    async def _start(self) -> LiveCall | None:
        if self._closed:
            return None
        if self._services.draining:
            self._emit(_error(RateLimited("the server is draining")))
            return None
        self._epoch += 1
        listener = functools.partial(self._on_event, self._epoch)
        try:
            call = await self._services.calls.start(
                principal=self._owner,
                binding=self._binding,
                agent=self._agent,
                session_id=self._session_id,
                format=runtime_format(self.items.format),
                listener=listener,
            )
        except PorticoError as exc:
            if isinstance(exc, RateLimited):
                self._services.metrics.rate_limited.labels("audio_sessions").inc()
            self._emit(_error(exc))
            return None
        if self._closed:  # the session ended while the call started
            detached(call.hangup(), name=f"call-hangup-{self._session_id}")
            return None
        self._call = call
        call.attach(listener, self._taken)
        return call

    def _on_event(self, epoch: int, event: DuplexEvent | None) -> None:
        if epoch != self._epoch:
            return
        if event is None or isinstance(event, DuplexFailure):
            # The call is over: its turn in progress ends, and the client's open item
            # goes with it (the next item starts a new call).
            self.items.refuse()
        if event is None:
            self._call = None
            outs = self.turns.cut()
        else:
            outs = self.turns.on_event(event)
        for out in outs:
            self._emit(out)

    def _taken(self) -> None:
        """A `/ws ?resume` of this session by its owner took the call over."""
        self._call = None
        self._epoch += 1
        self.items.refuse()
        for out in self.turns.cut():
            self._emit(out)

    async def interrupt(self) -> None:
        """The client's `interrupt`: barge-in on the agent's speech."""
        call = self._call
        if call is not None:
            await call.interrupt()

    def connection_changed(self) -> None:
        self.items.connection_changed()

    def close(self) -> None:
        """The session ended (`end`, its window, moved away): hang the call up."""
        self._closed = True
        self._epoch += 1
        call, self._call = self._call, None
        if call is not None:
            detached(call.hangup(), name=f"call-hangup-{self._session_id}")
