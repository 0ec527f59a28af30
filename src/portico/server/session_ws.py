"""The `/v1/session` adapter: resumable sessions on the shared engine.

A `LiveSession` is the session's transport state (its `Channel`, capabilities,
tools, context) and outlives connections for `resume_window` seconds; the
engine's turn events are numbered into its channel whether or not a connection
is attached, so a client that resumes gets exactly what it missed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
from aiohttp import web

from portico.config import DEFAULT_AGENT
from portico.core.engine import UserMessage
from portico.core.events import (
    TurnChunk,
    TurnCompleted,
    TurnEvent,
    TurnFailed,
    TurnMediaChunk,
    TurnToolCall,
    TurnToolCallTimedOut,
)
from portico.core.tools import ClientReply
from portico.domain.model import new_id
from portico.domain.validation import check_client_id, check_parts, split_metadata
from portico.errors import (
    BufferOverflow,
    InternalError,
    InvalidMessage,
    PorticoError,
    ProtocolViolation,
    RateLimited,
    ResumeFailed,
    SessionAgentNotFound,
    SessionBackendUnavailable,
    SessionMoved,
    SessionUnauthenticated,
    StoreError,
    TooManyConnections,
    Unauthenticated,
)
from portico.protocols.credential import held_off
from portico.protocols.session import frames as f
from portico.protocols.session.channel import Channel, Numbered
from portico.protocols.session.connection import (
    CLOSE_NORMAL,
    CLOSE_REPLACED,
    Acknowledged,
    CredentialOffered,
    HelloReceived,
    Received,
    Role,
    SessionConnection,
    State,
    Timing,
)
from portico.protocols.session.media import MediaItems, choose_audio
from portico.protocols.session.voice import VoiceOut
from portico.runtime.base import ClientTool, MediaChunk
from portico.server.admission import check_admission
from portico.server.services import SERVICES, Services
from portico.server.session_catchup import catch_up
from portico.server.session_ledger import SessionLedger, SessionProfile, decode_profile
from portico.server.session_replay import replayed_events
from portico.server.session_voice import SessionCall
from portico.server.sockets import ServerSocket, handler, upgraded
from portico.sessionstate.base import ENDED_TURNS_KEPT, NO_MARK, SessionSnapshot, TurnMark

log = logging.getLogger("portico.session")
PROTOCOL = "session"
SUPPORTED_CAPABILITIES = frozenset({"resume", "tools", "context", "audio", "transcripts"})
# Credentials never travel in URLs (they end up in logs and browser history).
CREDENTIAL_QUERY_KEYS = frozenset({"token", "access_token", "credential", "authorization"})
# The sessions this process serves now (a connection attached, or inside the window).
LIVE_SESSIONS = web.AppKey("live_sessions", dict[str, "LiveSession"])
CLOSE_BACKEND_FAILED = 1011
NO_AUDIO_INPUT = "binary frames need the audio capability and an input format (ready.audio.input)"
_TASKS: set[asyncio.Task[None]] = set()


def _nothing() -> None:
    return None


def _spawn(coro: Coroutine[Any, Any, None]) -> None:
    """A port write nobody waits for (window, removal); failures are logged."""
    _keep(asyncio.get_running_loop().create_task(coro))


def _keep(task: asyncio.Task[None] | None) -> None:
    if task is None:
        return
    _TASKS.add(task)
    task.add_done_callback(_finished)


def _finished(task: asyncio.Task[None]) -> None:
    _TASKS.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("session state write failed: %r", task.exception())


def timing(services: Services) -> Timing:
    settings = services.settings
    return Timing(
        ack_delay=settings.ack_delay,
        ack_every=settings.ack_every,
        heartbeat_interval=settings.heartbeat_interval,
        idle_timeout=settings.session_idle_timeout,
        max_send_queue_bytes=settings.max_send_queue_bytes,
        credential_margin=settings.credential_expiry_margin,
    )


def session_frame(event: TurnEvent) -> Numbered | None:
    """The numbered `/v1/session` message for an engine event (seq set by the channel)."""
    match event:
        case TurnChunk(turn_id=turn_id, text=text):
            return f.Chunk(seq=0, turn_id=turn_id, content=text)
        case TurnCompleted(turn_id=turn_id, content=content, parts=parts, cancelled=cancelled):
            return f.Done(seq=0, turn_id=turn_id, content=content, parts=parts, cancelled=cancelled)
        case TurnFailed(turn_id=turn_id, code=code, message=message):
            return f.Error(seq=0, turn_id=turn_id, error=f.ErrorInfo(code=code, message=message))
        case TurnToolCall(turn_id=turn_id, call=call):
            info = f.ToolCallInfo(
                id=call.id,
                name=call.name,
                arguments=call.arguments,
                consent_message=call.consent_message,
                categories=call.categories or None,
            )
            return f.ToolCall(seq=0, turn_id=turn_id, tool_call=info)
        case TurnToolCallTimedOut(call_id=call_id, error=error):
            return f.ServerToolResult(seq=0, call_id=call_id, error=error)
        case TurnMediaChunk():
            return None  # media travel as items in binary frames: `LiveSession._media_chunk`
    raise AssertionError(f"unhandled turn event {type(event).__name__}")


class LiveSession:
    """This process's copy of a session it serves: the connection, the engine listener,
    the media items. Its numbered streams live in the session-state port through
    `ledger`; the `channel` mirrors them for the sans-I/O core (numbering, dedup, the
    backlog a resume on this process resends)."""

    def __init__(
        self,
        *,
        session_id: str,
        owner: str,
        binding: str = "",
        agent: str,
        capabilities: tuple[str, ...],
        audio: f.AudioChoice | None = None,
        tools: tuple[ClientTool, ...],
        context: dict[str, Any],
        channel: Channel,
        ledger: SessionLedger,
        sessions: dict[str, LiveSession],
        profile: SessionProfile | None = None,
        counts_steps: bool | None = None,
    ) -> None:
        self.id = session_id
        self.owner = owner
        self.binding = binding  # the session-binding claim's value it was opened with
        self.agent = agent
        self.capabilities = capabilities
        self.audio = audio  # `ready.audio`, fixed at open like the capabilities
        self.media = MediaItems(session_id, numbered=channel.next_seq - 1)
        self.tools = tools
        self.context = context
        self.profile = profile or SessionProfile(
            owner=owner, binding=binding, agent=agent, capabilities=capabilities, audio=audio
        )
        self.channel = channel
        self.ledger = ledger
        # One resend buffer, not two: per message one append fewer, per ack one trim.
        self._port_keeps = ledger.in_process
        self.socket: SessionSocket | None = None
        self.ended = False
        # The voice call half, when `ready.audio.input` chose a format (set by the
        # socket that built the session: the session does not know the services).
        self.voice: SessionCall | None = None
        # Turns whose terminal message this copy numbered, newest last: a turn can end
        # here through the engine or its relayed events and through the catch-up from
        # the archive (session_catchup.py, after a takeover or a backend outage);
        # whichever comes second is dropped, with any event of the turn after it.
        self._ended_turns: dict[str, None] = {}
        # Turns running: the last step (core/events.py) numbered of each. An event at
        # or before it arrived twice (a takeover's replay and the live events overlap).
        # Only where another replica may take the session over (the port is shared):
        # one process never replays, and its chunks skip the bookkeeping.
        self._counts_steps = not ledger.in_process if counts_steps is None else counts_steps
        self._steps: dict[str, int] = {}
        # While a takeover's replay is read (server/session_replay.py), the events
        # heard meanwhile wait here, to be numbered after the replayed ones.
        self._held: list[TurnEvent] | None = None
        self._sessions = sessions
        self._expiry: asyncio.TimerHandle | None = None
        # Stops the engine's events for this copy once it is dropped (set by the socket
        # that built it: the session does not know the engine).
        self.release: Callable[[], None] = _nothing
        ledger.on_recorded = self._recorded
        ledger.on_moved = self.moved
        ledger.on_overflow = self._overflowed
        ledger.on_failure = self._backend_failed

    def attach(self, socket: SessionSocket) -> None:
        """A connection takes the session; an older one still attached is replaced (4409)."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        previous, self.socket = self.socket, socket
        if previous is not None:
            previous.replaced()
        if self.voice is not None:
            self.voice.connection_changed()
        # Items opened while no connection was attached lost their frames: end them
        # (before the resend, so the client learns it with the backlog).
        self._end_items()

    def detach(self, socket: SessionSocket, window: float) -> None:
        """The connection went away: the resume window starts now, here and in the port
        (another replica that gets the resume checks the deadline there)."""
        if self.socket is not socket or self.ended:
            return
        self.socket = None
        self._end_items()  # binary frames are never resent: what was in flight is lost
        if self.voice is not None:
            self.voice.connection_changed()
        self._expiry = asyncio.get_running_loop().call_later(window, self.expire)
        _spawn(self._set_window(time.time() + window))

    async def _set_window(self, deadline: float) -> None:
        try:
            await self.ledger.window(deadline)
        except SessionMoved:
            self.moved()

    def expire(self) -> None:
        """The window passed without a resume."""
        self.end()

    def end(self) -> None:
        """No resume any more (`end`, window passed, buffer overflow); turns still finish."""
        if self.ended:
            return
        self._drop()
        _keep(self.ledger.forget())
        log.info("session ended session=%s", self.id)

    def moved(self) -> None:
        """Another replica claimed the session: this copy stops writing, its connection
        (a half-open one) is closed as replaced, and the port keeps the session."""
        if self.ended:
            return
        self._drop()
        if self.socket is not None:
            self.socket.replaced()
            self.socket = None
        log.info("session moved to another connection session=%s", self.id)

    def _drop(self) -> None:
        self.ended = True
        if self.voice is not None:
            self.voice.close()
        self.ledger.stop()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._sessions.get(self.id) is self:
            del self._sessions[self.id]
        self.release()

    def on_turn_event(self, event: TurnEvent) -> None:
        """Number every event into the session; write it once the port holds it."""
        turn_id = event.turn_id
        if self.ended or turn_id in self._ended_turns:
            return
        mark = NO_MARK
        if self._counts_steps and event.step:
            if not self._first_time(event):
                return
            mark = TurnMark(step=(turn_id, event.step))
        if type(event) is TurnChunk:  # most events by far: skip the checks and the match
            # `_number` and `Channel.number` inlined: the chunk is built with its seq.
            channel = self.channel
            seq = channel.next_seq
            channel.next_seq = seq + 1
            chunk = f.Chunk(seq=seq, turn_id=turn_id, content=event.text)
            self.ledger.send(seq, f.encode(chunk), mark)
            return
        if isinstance(event, TurnMediaChunk):
            if "audio" in self.capabilities:
                self._media_chunk(event)
            return  # without `audio` the client gets no binary frames: media are dropped
        if isinstance(event, TurnCompleted | TurnFailed):
            # Items the agent left open (a cancelled turn) end before the turn does.
            for end in self.media.end_all(event.turn_id):
                self._number(end)
            mark = TurnMark(_archived_turn(event.turn_id), mark.step)
            self._turn_over(event.turn_id)
        frame = session_frame(event)
        if frame is not None:
            # The step goes with the event's last message: one recorded only in part
            # is replayed whole after a takeover.
            self._number(frame, mark)
        if isinstance(event, TurnCompleted | TurnFailed) and self.socket is not None:
            self.socket.turn_ended()

    def _first_time(self, event: TurnEvent) -> bool:
        """Whether to number `event` now: not while a takeover's replay is read (it is
        held), not when its step was numbered already."""
        if self._held is not None:
            self._held.append(event)
            return False
        if event.step <= self._steps.get(event.turn_id, 0):
            return False
        self._steps[event.turn_id] = event.step
        return True

    def hold_events(self, last_step: tuple[str, int]) -> None:
        """A takeover begins: the ledger recorded `last_step`; what is heard from now
        waits for `replay`."""
        turn_id, step = last_step
        if step and turn_id not in self._ended_turns:
            self._steps[turn_id] = step
        self._held = []

    def replay(self, events: list[TurnEvent]) -> None:
        """Number the takeover's `events` (oldest first, the ledger's missing ones),
        then those heard meanwhile; each turn's steps once."""
        held, self._held = self._held or [], None
        for event in (*events, *held):
            self.on_turn_event(event)

    def voice_out(self, out: VoiceOut) -> None:
        """What the session's call says: spoken turns as turns, the rest as is."""
        if isinstance(out, f.Transcript):
            self._number(out)
        elif isinstance(out, f.Error):
            if out.turn_id is not None:  # a spoken turn ends with the call's failure
                for end in self.media.end_all(out.turn_id):
                    self._number(end)
            self._number(out)
        else:
            self.on_turn_event(out)

    def answer(self, frame: Numbered) -> None:
        """The session's answer to a client message it handled (an `error` with `ref_seq`).

        Numbered like any server message and written to the connection attached now:
        the one that carried the message may have been taken over while it was being
        handled, and its core must not number into the session's channel behind the
        live connection's back (a seq that connection never sees is a gap to its client).
        """
        self._number(frame)

    def _number(self, frame: Numbered, mark: TurnMark = NO_MARK) -> None:
        if self.ended:
            return
        seq, data = self.channel.number(frame)
        self.ledger.send(seq, data, mark)

    def end_turn(self, frame: Numbered, turn_id: str) -> None:
        """A turn's terminal message from the archive (see session_catchup)."""
        if turn_id in self._ended_turns:
            return  # its relayed terminal event was numbered first
        self._turn_over(turn_id)
        self._number(frame, TurnMark(turn_id))

    def ended_before(self, turn_ids: tuple[str, ...]) -> None:
        """Turns whose terminal message the ledger held when this copy took the session
        over (newest first, as the port lists them): their events, still arriving over
        the bus from the replica that ran them, are not numbered a second time."""
        for turn_id in reversed(turn_ids):
            self._turn_over(turn_id)

    def _turn_over(self, turn_id: str) -> None:
        self._steps.pop(turn_id, None)
        self._ended_turns[turn_id] = None
        if len(self._ended_turns) > ENDED_TURNS_KEPT:
            del self._ended_turns[next(iter(self._ended_turns))]

    def _recorded(self, seq: int, data: bytes) -> None:
        """The port holds message `seq`: keep it for a resend here (unless the port is
        this process's memory, which is the resend buffer then), and write it."""
        if not self._port_keeps:
            self.channel.keep(seq, data)
        if self.socket is not None:
            self.socket.write(data)

    def _overflowed(self) -> None:
        # A client that reads but never acknowledges: end the session.
        if self.socket is not None:
            self.socket.fail(BufferOverflow())
        self.end()

    def _backend_failed(self) -> None:
        """The port refused a write for another reason (Redis unreachable): what this
        copy holds can no longer be resumed exactly once, so it stops; the client's
        resume gets what the port kept, or `RESUME_FAILED`. The connection is closed
        1011 (resume), not 4409 as `moved` would (stop: the client would give up)."""
        socket, self.socket = self.socket, None
        self.moved()
        if socket is not None:
            socket.backend_failed()

    def _media_chunk(self, event: TurnMediaChunk) -> None:
        """`audio_start` (numbered) for a new item, the chunk's binary frame (lossy),
        `audio_end` (numbered) after the item's last chunk."""
        turn_id, chunk = event.turn_id, event.chunk
        start, _ = self.media.start(turn_id, chunk)
        if start is not None:
            self._number(start)
        frame = self.media.frame(turn_id, chunk)
        # Written after the numbered messages before it (its `audio_start`) are: at once
        # on the in-process port, after their round trips on Redis.
        self.ledger.after_recorded(lambda: self._binary(turn_id, chunk, frame))
        end = self.media.finish(turn_id, chunk)
        if end is not None:
            self._number(end)

    def _binary(self, turn_id: str, chunk: MediaChunk, frame: bytes) -> None:
        if self.socket is None or not self.socket.write_binary(frame):
            # Known in time only while the item is open; a frame dropped after its
            # `audio_end` was numbered (the Redis port's delay) shows as a gap in the
            # item's Sequence, which is how a client judges an item complete anyway.
            self.media.dropped(turn_id, chunk)

    def _end_items(self) -> None:
        if "audio" in self.capabilities:
            for end in self.media.end_all():
                self._number(end)


class SessionSocket(ServerSocket):
    protocol = PROTOCOL
    authenticates_in_band = True

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, services: Services) -> None:
        super().__init__(request, ws, services)
        self._core = SessionConnection(
            role=Role.SERVER, timing=timing(services), now=self._loop.time(), ledger=True
        )
        self._sessions = request.app[LIVE_SESSIONS]
        self._live: LiveSession | None = None
        self._epoch = 0  # the epoch this connection claimed the session under
        self._principal = ""
        self._binding = ""

    @property
    def core(self) -> SessionConnection:
        return self._core

    def traced_sessions(self) -> tuple[str, ...]:
        return (self._live.id,) if self._live is not None else ()

    def describe(self) -> str:
        session = self._live.id if self._live else "-"
        return f"session={session} principal={self._principal or '-'}"

    # -- core plumbing ------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """A numbered message the port holds (once per message: `_after_core` inlined)."""
        core = self._core
        core.write_numbered(data)
        if core.close_request is not None:
            self.start_close(*core.close_request)
        self.wake()

    def write_binary(self, data: bytes) -> bool:
        """A media frame; False when it was dropped (lossy: see `write_binary` of the core)."""
        queued = self._core.write_binary(data)
        if queued:
            self.wake()
        return queued

    def fail(self, error: PorticoError) -> None:
        self._core.fail(error)
        self._after_core()

    def replaced(self) -> None:
        """A newer connection resumed this session: stop, whatever arrives later is ignored."""
        self._live = None
        self._core.close(CLOSE_REPLACED, "replaced by a newer connection")
        self._after_core()

    def backend_failed(self) -> None:
        self._live = None
        self._core.close(CLOSE_BACKEND_FAILED, "session state unavailable")
        self._after_core()

    def _after_core(self) -> None:
        if self._core.close_request is not None:
            self.start_close(*self._core.close_request)
        self.wake()

    def on_closed(self) -> None:
        if self._live is not None:
            self._live.detach(self, self._services.settings.resume_window)

    def on_overflow(self) -> None:
        self._after_core()

    def on_control(self, now: float) -> None:
        self._core.receive_control(now)

    async def on_text(self, data: str, now: float) -> None:
        for event in self._core.receive_text(data, now):
            if type(event) is Acknowledged:
                # Four of a bench client's five frames a turn: trimmed in this step on
                # the in-process port, with no coroutine made for it.
                if not self._acknowledged_now(event.seq):
                    await self._acknowledged(event.seq)
            elif isinstance(event, HelloReceived):
                await self._hello(event.hello)
            elif isinstance(event, Received):
                await self._numbered(event.frame)
            elif isinstance(event, CredentialOffered):
                await self.refresh_credential(event.token, self._core.refresh)
        self._after_core()

    async def on_binary(self, data: bytes, now: float) -> None:
        live = self._live
        voice = None if live is None or live.ended else live.voice
        if voice is None or self._core.state is not State.OPEN:
            # Before `ready`, or a session that hears no audio: a client bug (4400).
            self._core.fail(ProtocolViolation(NO_AUDIO_INPUT))
        else:
            await voice.receive(data, now)
        self._after_core()

    async def on_timer(self, now: float) -> None:
        self._core.on_timer(now)
        if await self._turn_elsewhere(now):
            return  # held off until that turn ends; asked again at the next timer
        self._check_expiry()

    async def _turn_elsewhere(self, now: float) -> bool:
        """Past the credential's close point with no turn here: whether another replica
        runs the session's turn (a message sent there before this resume)."""
        clock, live = self._core.credential, self._live
        if clock is None or live is None or not clock.close_point_passed(now):
            return False
        if self.turn_running():
            return False
        return held_off(clock, now, await self._services.engine.runs_elsewhere((live.id,)))

    def turn_ended(self) -> None:
        # The engine frees the session after its last event: check once it has.
        self._loop.call_soon(self._check_expiry)

    def turn_running(self) -> bool:
        live = self._live
        return live is not None and self._services.engine.is_busy(live.id)

    def _check_expiry(self) -> None:
        self._core.check_credential(self._loop.time(), turn_running=self.turn_running())
        self._after_core()

    # -- handshake ----------------------------------------------------------------------

    async def _hello(self, hello: f.Hello) -> None:
        try:
            identity = await self._services.auth.identify(hello.credential)
            self._principal, self._binding = identity.principal, identity.session_value
        except Unauthenticated as exc:
            self._core.fail(SessionUnauthenticated(exc.message))
            return
        if not self.authenticated(self._principal):
            self._core.fail(TooManyConnections())
            return
        try:
            if hello.protocol != f.PROTOCOL_VERSION:
                raise ProtocolViolation(f"unsupported protocol version {hello.protocol}")
            live = await self._session_for(hello)
        except StoreError:
            log.exception("archive unavailable for a /v1/session hello")
            self._core.fail(
                SessionBackendUnavailable("the archive is unreachable; try again shortly")
            )
            return
        except PorticoError as exc:
            self._core.fail(exc)
            return
        except Exception:
            log.exception("session state unavailable for a /v1/session hello")
            self._core.fail(SessionBackendUnavailable())
            return
        self._live = live
        live.attach(self)
        peer_last_seq = hello.last_seq if hello.session_id else 0
        if peer_last_seq and not await self._port_ack(live, peer_last_seq):
            return
        if live.ledger.in_process:
            live.channel.replace_backlog(live.ledger.backlog())
        settings = self._services.settings
        ready = f.Ready(
            session_id=live.id,
            resumed=bool(hello.session_id),
            last_seq=live.ledger.handled,
            capabilities=live.capabilities,
            audio=live.audio,
            heartbeat_ms=round(settings.heartbeat_interval * 1000),
            resume_window_ms=round(settings.resume_window * 1000),
            ai_disclosure=self._services.engine.ai_disclosure(live.agent),
        )
        self._core.accept(live.channel, ready, peer_last_seq)
        self._core.bind_credential(identity, now=self._loop.time(), wall=time.time())
        log.info("session %s session=%s", _how(hello), live.id)

    def _session_for(self, hello: f.Hello) -> Awaitable[LiveSession]:
        if hello.session_id:
            return self._resume(hello)
        if hello.continue_session is not None:
            return self._continue(hello)
        return self._open(hello)

    async def _resume(self, hello: f.Hello) -> LiveSession:
        assert hello.session_id is not None
        local = self._sessions.get(hello.session_id)
        if local is not None and not local.ended:
            # One answer for unknown, foreign, expired and ended: existence never leaks.
            if not self._mine(local.owner, local.binding):
                raise ResumeFailed()
            if await local.ledger.claim():
                self._epoch = local.ledger.epoch
                # What the port holds handled, not what an older connection of this
                # process received and never got marked: the client resends that.
                local.channel.handled = local.ledger.handled
                return local
            local.moved()  # another replica held it meanwhile: this copy is stale
        return await self._adopt(hello.session_id)

    async def _adopt(self, session_id: str) -> LiveSession:
        """Take over a session this process does not hold (it was opened or last
        resumed on another replica, or this one restarted): from the port alone."""
        states = self._services.session_states
        # Ownership needs the session's fields only: its buffer is read once, below.
        header = await states.header(session_id)
        profile = None if header is None else decode_profile(header.capabilities)
        if header is None or profile is None or not self._mine(profile.owner, profile.binding):
            raise ResumeFailed()
        if header.window_deadline is not None and header.window_deadline <= time.time():
            raise ResumeFailed()
        if not self._services.engine.has_agent(profile.agent):
            raise ResumeFailed()
        # One step (one round trip in Redis): no other claim comes between.
        snapshot = await states.claim_and_load(session_id)
        live = self._live_session(profile, session_id, snapshot)
        live.hold_events(snapshot.last_step)  # in the step that attached it: none missed
        _spawn(self._take_over(live, profile, snapshot))
        return live

    async def _take_over(
        self, live: LiveSession, profile: SessionProfile, snapshot: SessionSnapshot
    ) -> None:
        """The claim fenced the previous holder: what it did not record of the turns
        running is this replica's to number, from the bus (session_replay.py), then the
        turns it did not end in the ledger are answered from the archive."""
        services = self._services
        live.replay(
            await replayed_events(
                services.engine.recent_events,
                live.id,
                count=services.settings.resend_buffer_messages,
                after=profile.events_after,
                ended=snapshot.ended_turns,
                last_step=snapshot.last_step,
            )
        )
        await catch_up(
            live,
            services.store,
            since=profile.opened_at,
            ended=snapshot.ended_turns,
            runs_elsewhere=services.engine.runs_elsewhere,
        )

    def _mine(self, owner: str, binding: str) -> bool:
        return owner == self._principal and binding == self._binding

    async def _open(self, hello: f.Hello) -> LiveSession:
        agent = hello.agent or DEFAULT_AGENT
        if not self._services.engine.has_agent(agent):
            raise SessionAgentNotFound(agent)
        session_id = new_id("sess")
        await self._services.engine.open_session(
            principal=self._principal, agent=agent, session_id=session_id, binding=self._binding
        )
        return await self._create(hello, session_id, agent)

    async def _continue(self, hello: f.Hello) -> LiveSession:
        """A new numbering on an archived conversation: same id, seq from 1, no replay."""
        assert hello.continue_session is not None
        stored = await self._services.store.get_session(hello.continue_session)
        # Unknown, foreign (another principal or another session-binding value),
        # deleted or closed: the answer of a failed resume, which never says whether
        # the session exists.
        if (
            stored is None
            or stored.owner != self._principal
            or stored.binding != self._binding
            or stored.deleted_at is not None
            or stored.status == "closed"
        ):
            raise ResumeFailed()
        if not self._services.engine.has_agent(stored.agent):
            raise SessionAgentNotFound(stored.agent)
        previous = self._sessions.get(stored.id)
        if previous is not None:
            # Still live here: its numbering ends (its connection is replaced, 4409).
            socket = previous.socket
            previous.end()
            self._services.engine.detach(previous.id, previous.on_turn_event)
            if socket is not None:
                socket.replaced()
        # A holder on another replica is fenced by the new ledger's epoch; the turn
        # events relayed so far belong to the numbering it held.
        after = await self._services.engine.session_position(stored.id)
        return await self._create(hello, stored.id, stored.agent, events_after=after)

    async def _create(
        self, hello: f.Hello, session_id: str, agent: str, *, events_after: str = ""
    ) -> LiveSession:
        capabilities = tuple(
            sorted((set(hello.capabilities) & SUPPORTED_CAPABILITIES) | {"resume"})
        )
        profile = SessionProfile(
            owner=self._principal,
            binding=self._binding,
            agent=agent,
            capabilities=capabilities,
            audio=(
                choose_audio(hello.audio, hears=self._services.calls.takes_calls(agent))
                if "audio" in capabilities
                else None
            ),
            tools=hello.tools if "tools" in capabilities else (),
            context=dict(hello.context or {}) if "context" in capabilities else {},
            opened_at=time.time(),
            events_after=events_after,
        )
        states = self._services.session_states
        epoch = await states.create(session_id, capabilities=profile.encode())
        empty = SessionSnapshot(epoch=epoch, next_seq=1, handled=0, peer_acked=0, unacknowledged=())
        return self._live_session(profile, session_id, empty)

    def _live_session(
        self, profile: SessionProfile, session_id: str, snapshot: SessionSnapshot
    ) -> LiveSession:
        settings = self._services.settings
        channel = Channel.restore(
            max_messages=settings.resend_buffer_messages,
            max_bytes=settings.resend_buffer_bytes,
            next_seq=snapshot.next_seq,
            handled=snapshot.handled,
            peer_acked=snapshot.peer_acked,
            unacknowledged=snapshot.unacknowledged,
        )
        ledger = SessionLedger(
            self._services.session_states, session_id, snapshot.epoch, handled=snapshot.handled
        )
        live = LiveSession(
            session_id=session_id,
            owner=profile.owner,
            binding=profile.binding,
            agent=profile.agent,
            capabilities=profile.capabilities,
            audio=profile.audio,
            tools=tuple(ClientTool(t.name, t.description, t.parameters) for t in profile.tools),
            context=dict(profile.context),
            channel=channel,
            ledger=ledger,
            sessions=self._sessions,
            profile=profile,
        )
        live.ended_before(snapshot.ended_turns)  # as the numbering it continues
        self._epoch = snapshot.epoch
        self._sessions[session_id] = live
        engine = self._services.engine
        engine.attach(session_id, live.on_turn_event)
        live.release = lambda: engine.detach(session_id, live.on_turn_event)
        heard = profile.audio.input if profile.audio is not None else None
        if heard is not None and self._services.calls.takes_calls(profile.agent):
            live.voice = SessionCall(
                session_id=session_id,
                owner=profile.owner,
                binding=profile.binding,
                agent=profile.agent,
                heard=heard,
                transcripts="transcripts" in profile.capabilities,
                services=self._services,
                emit=live.voice_out,
            )
        return live

    # -- the session-state port ---------------------------------------------------------

    async def _port_ack(self, live: LiveSession, seq: int) -> bool:
        """Trim the port's resend buffer; False when the connection failed instead."""
        try:
            if not live.ledger.acknowledged_now(self._epoch, seq):
                await live.ledger.acknowledged(self._epoch, seq)
        except (SessionMoved, ProtocolViolation) as exc:
            self._port_refused(live, exc)
            return False
        except Exception:
            log.exception("session state unavailable session=%s", live.id)
            live.moved()
            self.backend_failed()
            return False
        return True

    def _acknowledged_now(self, seq: int) -> bool:
        """The ack applied in the caller's step (nothing to apply counts too); False:
        it needs `_acknowledged`, which awaits the port or handles its refusal."""
        live = self._live
        if live is None or live.ended:
            return True
        try:
            return live.ledger.acknowledged_now(self._epoch, seq)
        except Exception:
            return False  # `_acknowledged` asks again and acts on the refusal or failure

    async def _acknowledged(self, seq: int) -> None:
        live = self._live
        if live is not None and not live.ended:
            await self._port_ack(live, seq)

    def _port_refused(self, live: LiveSession, exc: PorticoError) -> None:
        if isinstance(exc, SessionMoved):
            # Claimed by a newer connection: of this process (it handles the resend
            # now) or of another replica (this copy is stale and stops).
            if live.ledger.epoch == self._epoch:
                live.moved()
            self._core.close(CLOSE_REPLACED, "replaced by a newer connection")
            return
        self._core.fail(exc)  # an ack beyond what was sent, a gap: 4400, resumable

    async def _mark(self, live: LiveSession, frame: Numbered) -> bool:
        """Mark client message `frame.seq` handled in the port, before its effect shows
        (a `context` message's effect is part of the same step); True: apply it now."""
        seq = frame.seq
        if seq is None:  # the core passes only numbered messages on
            return False
        profile = None
        if isinstance(frame, f.Context) and "context" in live.capabilities:
            profile = msgspec.structs.replace(live.profile, context=dict(frame.context))
        try:
            fresh = await live.ledger.mark_handled(
                self._epoch, seq, None if profile is None else profile.encode()
            )
        except (SessionMoved, ProtocolViolation) as exc:
            self._port_refused(live, exc)
            return False
        except Exception:
            log.exception("session state unavailable session=%s", live.id)
            live.moved()
            self.backend_failed()
            return False
        if profile is not None and fresh:
            live.profile = profile
        self._core.confirm(seq, self._loop.time())
        return fresh

    # -- numbered messages --------------------------------------------------------------

    async def _numbered(self, frame: Numbered) -> None:
        live = self._live
        if live is None or live.ended or not await self._mark(live, frame):
            return
        try:
            await self._apply(live, frame)
        except PorticoError as exc:
            live.answer(f.Error(seq=0, ref_seq=frame.seq, error=_info(exc)))
        except Exception:
            log.exception("unexpected error handling a /v1/session message")
            live.answer(f.Error(seq=0, ref_seq=frame.seq, error=_info(InternalError())))

    async def _apply(self, live: LiveSession, frame: Numbered) -> None:
        tools = self._services.tools
        match frame:
            case f.Message():
                await self._message(live, frame)
            # Settled here, or forwarded to the replica whose turn made the call.
            case f.ToolCallAck(call_id=call_id):
                await tools.settle(self._principal, call_id, ClientReply(kind="ack"))
            case f.ToolCallNack(call_id=call_id, reason=reason):
                await tools.settle(
                    self._principal, call_id, ClientReply(kind="nack", reason=reason)
                )
            case f.ClientToolResult(call_id=call_id, result=result, error=error):
                reply = ClientReply(kind="result", result=result, error=error)
                await tools.settle(self._principal, call_id, reply)
            case f.Context(context=context):
                if "context" not in live.capabilities:
                    raise InvalidMessage("the context capability is not in effect")
                live.context = dict(context)
            case f.Interrupt():
                await self._services.engine.cancel(live.id)
                if live.voice is not None:
                    await live.voice.interrupt()
            case f.End():
                live.end()
                self._services.engine.session_ended(live.id, live.agent)
                self._services.engine.detach(live.id, live.on_turn_event)
                self._core.close(CLOSE_NORMAL, "session ended")
            case _:
                raise InvalidMessage(f"{frame.type} is not a client message")  # type: ignore[union-attr]

    async def _message(self, live: LiveSession, frame: f.Message) -> None:
        if self._services.draining:
            raise RateLimited("the server is draining; send again after resuming")
        parts = frame.parts or ()
        if not frame.content and not parts:
            raise InvalidMessage("a message needs `content` or `parts`")
        check_parts(parts)
        client_id = frame.client_id or ""
        check_client_id(client_id)
        forwarded, directives = split_metadata(frame.metadata or {})
        await self._services.engine.submit(
            UserMessage(
                principal=self._principal,
                binding=self._binding,
                agent=live.agent,
                session_id=live.id,
                own_session=True,
                content=frame.content or "",
                parts=parts,
                metadata=forwarded,
                directives=directives,
                client_tools=live.tools,
                context=live.context,
                client_id=client_id,
                unique_client_id=True,
            ),
            live.on_turn_event,
        )


def _archived_turn(turn_id: str) -> str:
    """The turn id the ledger records as ended (for another replica's catch-up, which
    answers archived turns): a spoken turn's `vturn-` id is no archived turn, and
    recording it would push real ones out of the ledger's bounded list."""
    return "" if turn_id.startswith(f.VOICE_TURN_PREFIX + "-") else turn_id


def _how(hello: f.Hello) -> str:
    if hello.session_id:
        return "resumed"
    return "continued" if hello.continue_session is not None else "opened"


def _info(error: PorticoError) -> f.ErrorInfo:
    return f.ErrorInfo(code=error.code, message=error.message, details=error.details)


async def open_session_socket(request: web.Request) -> SessionSocket:
    if CREDENTIAL_QUERY_KEYS & {key.lower() for key in request.query}:
        raise web.HTTPBadRequest(
            text="credentials are never accepted in the URL; send them in hello"
        )
    services = request.app[SERVICES]
    check_admission(request, services)
    return await upgraded(
        request, services, functools.partial(SessionSocket, request, services=services)
    )


# The route handler: one coroutine frame per connection (`ServerSocket.serve`).
session_handler = handler(open_session_socket)


__all__ = ["LIVE_SESSIONS", "LiveSession", "SessionSocket", "session_handler"]
