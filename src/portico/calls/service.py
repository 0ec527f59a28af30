"""The call service: runs each duplex call in a task of its own, beside the sockets.

A connection starts a call and listens to it; the call outlives the connection. A
connection that drops without `hangup` parks its call for `realtime_grace_window`:
the call keeps running (its text is still archived; its audio has no one to reach
and is dropped), and a connection of the same principal may reclaim it with
`?resume=<session id>`. A call nobody reclaims is hung up when its window ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import msgspec

from portico.calls.directory import CallDirectory, CallRecord, InProcessCallDirectory
from portico.calls.parking import InProcessParkingLot, ParkingLot
from portico.calls.rules import DUPLEX_ERROR, CallRules, Step, VoiceTurnRecord
from portico.calls.slots import AudioSessionSlots
from portico.calls.turnstile import Turnstile
from portico.core.compaction import since_latest_summary
from portico.core.engine import HISTORY_LIMIT
from portico.domain.model import Message, Session, Turn, new_id
from portico.errors import (
    DuplexError,
    MediaNotEnabled,
    PorticoError,
    RateLimited,
    SessionExpired,
)
from portico.runtime.duplex.base import (
    AudioFormat,
    AudioIn,
    AudioOut,
    DuplexCall,
    DuplexEvent,
    DuplexFailure,
    DuplexRuntime,
    DuplexStart,
    Hello,
)
from portico.store.base import Store, detached

log = logging.getLogger("portico.calls")

# A listener gets the call's events; None once, when the call is over.
CallListener = Callable[[DuplexEvent | None], None]
SessionOpener = Callable[..., Awaitable[Session]]
VOICE_METADATA = {"source": "voice"}
CLOSE_GRACE = 5.0  # seconds a closed call's runtime may take to end its events


class CallTelemetry(Protocol):
    def call_started(self) -> None: ...
    def call_ended(self) -> None: ...
    def call_refused(self, reason: str) -> None: ...
    def call_parked(self) -> None: ...
    def call_unparked(self, reclaimed: bool) -> None: ...
    def call_moved(self) -> None: ...
    def audio(self, direction: str, size: int) -> None: ...


class CallHandover(Protocol):
    """The replicas' link as the call service sees it (replication/link.py)."""

    async def release_call(self, replica: str, session_id: str, token: str) -> bool:
        """Ask `replica` to let go of the session's call holding `token`."""
        ...


class NoCallTelemetry:
    def call_started(self) -> None: ...
    def call_ended(self) -> None: ...
    def call_refused(self, reason: str) -> None: ...
    def call_parked(self) -> None: ...
    def call_unparked(self, reclaimed: bool) -> None: ...
    def call_moved(self) -> None: ...
    def audio(self, direction: str, size: int) -> None: ...


class LiveCall:
    """One running call: the runtime's call, its pump, and who listens to it."""

    def __init__(
        self,
        service: CallService,
        call: DuplexCall,
        *,
        session: Session,
        listener: CallListener,
        caller_format: AudioFormat,
        token: str,
    ) -> None:
        self.session_id = session.id
        self.caller_format = caller_format
        self.token = token  # this holding of the call, in the call directory
        self.owner = session.owner
        self.agent = session.agent
        self._service = service
        self._call = call
        self._listener: CallListener | None = listener
        self._release: Callable[[], None] | None = None
        self._rules = CallRules()
        self.hung_up = False
        self.over = False
        self.failure = ""  # the code the call failed with, if it did
        self._started = time.monotonic()
        self._sending = Turnstile()  # the port: frames in order, never concurrently
        self._pump = detached(self._run(), name=f"call-{session.id}")
        hand_over = getattr(call, "hand_over", None)
        if hand_over is not None:
            hand_over(self._take)

    @property
    def hello(self) -> Hello | None:
        return self._rules.hello

    @property
    def format(self) -> AudioFormat | None:
        return None if self._rules.hello is None else self._rules.hello.format

    def attach(self, listener: CallListener, release: Callable[[], None] | None = None) -> None:
        """`listener` gets the call's events from now on; `release` is called if another
        connection takes the call over (`?resume` while this one is still open)."""
        self._listener, self._release = listener, release

    def detach(self) -> None:
        self._listener = self._release = None

    def take_over(self) -> None:
        """Another connection of the owner resumes the call: the holder lets go."""
        release = self._release
        self.detach()
        if release is not None:
            release()

    async def send(self, audio: AudioIn) -> None:
        if self.over:
            return
        self._service.telemetry.audio("in", len(audio.data))
        sending = self._sending
        if sending.busy:  # only a call taken over mid-frame (calls/turnstile.py)
            await sending.wait()
        sending.busy = True
        try:
            await self._call.send(audio)
        except Exception:
            log.exception("duplex runtime refused caller audio")
            await self._deliver_step(DuplexFailure(DUPLEX_ERROR, "the voice runtime failed"))
            self._pump.cancel()  # the call is over: its runtime's events are not read
        finally:
            sending.leave()

    async def interrupt(self) -> None:
        """The client barged in (`/v1/session` `interrupt`): see `CallRules.interrupt`."""
        if self.over:
            return
        step = self._rules.interrupt()
        for forwarded in step.forward:
            if self._listener is not None:
                self._listener(forwarded)
        await self._archive(step.records)

    async def hangup(self) -> None:
        """End the call on purpose (hangup, its parking window ended, shutdown)."""
        self.hung_up = True
        with contextlib.suppress(Exception):
            await self._call.close()
        if not self._pump.done():
            # A runtime whose events outlive its close costs the call, never the slot.
            asyncio.get_running_loop().call_later(CLOSE_GRACE, self._pump.cancel)

    async def wait(self) -> None:
        await asyncio.gather(self._pump, return_exceptions=True)

    async def _run(self) -> None:
        try:
            async for event in self._call.events():
                step = self._forward(event)
                if step.records:
                    await self._archive(step.records)
                if step.ended:
                    break
        except Exception:
            log.exception("duplex runtime failed mid-call")
            await self._deliver_step(DuplexFailure(DUPLEX_ERROR, "the voice runtime failed"))
        finally:
            await self._archive(self._rules.finish())
            with contextlib.suppress(Exception):
                await self._call.close()
            self.over = True
            self._service.ended(self)
            outcome = (
                f"failed:{self.failure}"
                if self.failure
                else ("hung_up" if self.hung_up else "ended")
            )
            log.info(
                "call ended session=%s principal=%s agent=%s outcome=%s duration_s=%.1f",
                self.session_id,
                self.owner,
                self.agent,
                outcome,
                time.monotonic() - self._started,
            )
            listener, self._listener = self._listener, None
            if listener is not None:
                listener(None)

    async def _deliver_step(self, event: DuplexEvent) -> bool:
        step = self._forward(event)
        if step.records:
            await self._archive(step.records)
        return step.ended

    def _take(self, event: DuplexEvent) -> bool:
        """An event the runtime offers while the pump waits with nothing unread (its
        `hand_over`): agent audio of a started call is forwarded here and now, which
        is what the pump would do next, without waking it. Anything else, or a call
        that ended, goes to the pump (a step that archives or ends the call is its)."""
        rules = self._rules
        if type(event) is not AudioOut or rules.hello is None or rules.ended:
            return False
        # AudioOut: no records, never ends the call once started; `_forward` without
        # its Step and lists (docs/performance.md, "Voice calls").
        if rules.audio_out():
            self._service.telemetry.audio("out", len(event.data))
            if self._listener is not None:
                self._listener(event)
        return True

    def _forward(self, event: DuplexEvent) -> Step:
        """The call rules' step for `event`, its events handed to the listener; what it
        archives is the caller's to await (most events, agent audio, archive nothing:
        no coroutine is made for them, docs/performance.md "Voice calls")."""
        step = self._rules.feed(event)
        for forwarded in step.forward:
            if isinstance(forwarded, AudioOut):
                self._service.telemetry.audio("out", len(forwarded.data))
            elif isinstance(forwarded, DuplexFailure):
                self.failure = forwarded.code
            if self._listener is not None:
                self._listener(forwarded)
        return step

    async def _archive(self, records: list[VoiceTurnRecord]) -> None:
        for record in records:
            try:
                await self._service.archive(self, record)
            except Exception:
                # The call goes on: a lost transcript is not worth the caller's call.
                log.exception("archiving a voice turn failed session=%s", self.session_id)


class CallService:
    def __init__(
        self,
        *,
        runtimes: Mapping[str, DuplexRuntime],
        store: Store,
        open_session: SessionOpener,
        grace_window: float,
        max_sessions: int,
        max_sessions_per_principal: int | None,
        telemetry: CallTelemetry | None = None,
        parking: ParkingLot[LiveCall] | None = None,
        directory: CallDirectory | None = None,
        replica_id: str = "local",
        handover: CallHandover | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._runtimes = dict(runtimes)
        self._store = store
        self._open_session = open_session
        self._grace = grace_window
        self.slots = AudioSessionSlots(max_sessions, max_sessions_per_principal)
        self.telemetry: CallTelemetry = telemetry or NoCallTelemetry()
        self.parking: ParkingLot[LiveCall] = parking or InProcessParkingLot()
        # Who may take which call over, on this replica or any (docs/replicas.md).
        self.directory: CallDirectory = directory or InProcessCallDirectory()
        self.replica_id = replica_id
        self._handover = handover
        self._clock = clock
        self._wall = wall
        self._live: set[LiveCall] = set()
        self._sessions: dict[str, LiveCall] = {}  # the latest call of each session
        self._sweep: asyncio.TimerHandle | None = None
        self._stopping = False  # calls ended by shutdown stay claimable (see `shutdown`)

    def takes_calls(self, agent: str) -> bool:
        return agent in self._runtimes

    async def start(
        self,
        *,
        principal: str,
        binding: str,
        agent: str,
        session_id: str,
        format: AudioFormat,
        listener: CallListener,
    ) -> LiveCall:
        """Start a call; raises the refusal (a limit, the session, the runtime)."""
        runtime = self._runtimes.get(agent)
        if runtime is None:
            raise MediaNotEnabled("this agent takes no calls: binary media is not accepted")
        refusal = self.slots.take(principal)
        if refusal is not None:
            self.telemetry.call_refused(refusal)
            raise RateLimited(
                "too many audio sessions on this server"
                if refusal == "process"
                else "too many audio sessions for this principal"
            )
        try:
            session = await self._session(principal, binding, agent, session_id)
            start = DuplexStart(
                session_id=session.id,
                agent=agent,
                owner=principal,
                format=format,
                history_reader=functools.partial(self._history, session.id),
            )
            try:
                call = await runtime.start(start)
            except PorticoError:
                raise
            except Exception as exc:
                log.exception("duplex runtime could not start a call")
                raise DuplexError("the voice runtime could not start the call") from exc
        except BaseException as exc:
            self.slots.give(principal)
            if isinstance(exc, PorticoError):
                self.telemetry.call_refused("runtime" if exc.code == DUPLEX_ERROR else exc.code)
            raise
        token = new_id("call")
        # Registered before the call's events flow: once its caller hears the call, a
        # resume anywhere finds it, even if this replica dies the next moment.
        await self._register(session.id, principal, agent, token, format)
        live = LiveCall(
            self, call, session=session, listener=listener, caller_format=format, token=token
        )
        log.info(
            "call started session=%s principal=%s agent=%s codec=%s sample_rate=%d",
            session.id,
            principal,
            agent,
            format.codec,
            format.sample_rate,
        )
        self._live.add(live)
        self._sessions[live.session_id] = live
        self.telemetry.call_started()
        return live

    async def _register(
        self, session_id: str, owner: str, agent: str, token: str, caller_format: AudioFormat
    ) -> None:
        record = CallRecord(
            session_id=session_id,
            owner=owner,
            agent=agent,
            replica=self.replica_id,
            token=token,
            format=caller_format,
        )
        try:
            await self.directory.register(record)
        except Exception:
            # The call goes on; only a `?resume` on another replica will not find it.
            log.warning("call directory unreachable: not registered session=%s", session_id)

    def _directory_write(self, write: Awaitable[None], what: str, session_id: str) -> None:
        async def run() -> None:
            try:
                await write
            except Exception:
                log.warning("call directory %s failed session=%s", what, session_id)

        detached(run(), name=f"call-directory-{what}-{session_id}")

    async def _session(self, principal: str, binding: str, agent: str, session_id: str) -> Session:
        session = await self._open_session(
            principal=principal, agent=agent, session_id=session_id, binding=binding
        )
        if session.owner != principal or session.binding != binding:
            raise SessionExpired()
        return session

    async def _history(self, session_id: str, before: Message) -> tuple[Message, ...]:
        """The session's archived conversation (its text turns and earlier voice turns):
        what a runtime reads as history. The utterance being answered is not in it yet."""
        found = await self._store.list_messages(session_id, after_offset=0, limit=HISTORY_LIMIT)
        return tuple(m for m in since_latest_summary(found) if m.id != before.id)

    def ended(self, call: LiveCall) -> None:
        """The call's events are over: its slot is free, a parked call leaves the lot."""
        if call not in self._live:
            return
        self._live.discard(call)
        if self._sessions.get(call.session_id) is call:
            del self._sessions[call.session_id]
        self.slots.give(call.owner)
        if not self._stopping:
            self._directory_write(
                self.directory.drop(call.session_id, call.token), "drop", call.session_id
            )
        if self.parking.discard(call.session_id) is call:
            self.telemetry.call_unparked(reclaimed=False)
        self.telemetry.call_ended()

    # -- parking -----------------------------------------------------------------------

    def park(self, call: LiveCall) -> None:
        """The call's connection dropped without `hangup`: keep it for the window."""
        if call.over or call.hung_up:
            return
        call.detach()
        self.parking.park(call.session_id, call.owner, call, self._clock() + self._grace)
        until = self._wall() + self._grace
        self._directory_write(
            self.directory.park(call.session_id, call.token, until), "park", call.session_id
        )
        self.telemetry.call_parked()
        log.info("call parked session=%s window_s=%.1f", call.session_id, self._grace)
        self._arm_sweep()

    async def reclaim(
        self, session_id: str, principal: str, binding: str
    ) -> LiveCall | PorticoError | None:
        """The principal's call of this session, now the caller's to listen to (None:
        there is none; an error: it was claimed but its continuation could not start).

        The directory decides, whichever replica runs the call. Here: the call itself,
        parked or taken over from the connection holding it. On another replica: that
        replica lets it go (its runtime call ends, its last turn archived) and this one
        continues the session with a new runtime call in the caller's format, the
        archived turns as its history. A replica that died holding it answers nothing
        and needs to: its call died with it."""
        try:
            record = await self.directory.claim(session_id, principal, self._wall())
        except Exception:
            log.warning("call directory unreachable: resume looked up here only")
            return self._take_here(session_id, principal)
        if record is None:
            return None
        if record.replica == self.replica_id:
            call = self._take_here(session_id, principal)
            if call is not None:
                call.token = new_id("call")  # a new holding: stale writes of the old miss
                await self._register(
                    call.session_id, call.owner, call.agent, call.token, call.caller_format
                )
            return call
        if self._handover is not None:
            detached(self._release_elsewhere(record), name=f"call-release-{session_id}")
        try:
            call = await self.start(
                principal=principal,
                binding=binding,
                agent=record.agent,
                session_id=session_id,
                format=record.format,
                listener=_nobody,
            )
        except PorticoError as exc:
            return exc
        log.info("call continued from replica=%s session=%s", record.replica, session_id)
        return call

    async def _release_elsewhere(self, record: CallRecord) -> None:
        assert self._handover is not None
        try:
            await self._handover.release_call(record.replica, record.session_id, record.token)
        except Exception as exc:
            # Gone (killed) or unreachable: its call is gone with it, or ends at its window.
            log.info(
                "replica=%s did not release its call session=%s: %s",
                record.replica,
                record.session_id,
                exc,
            )

    async def release_here(self, session_id: str, token: str) -> bool:
        """Another replica took this call over: this one lets go of it and ends it."""
        call = self._sessions.get(session_id)
        if call is None or call.token != token or call.over:
            return False
        if self.parking.discard(session_id) is call:
            self.telemetry.call_unparked(reclaimed=True)
        else:
            call.take_over()
        self.telemetry.call_moved()
        log.info("call handed over to another replica session=%s", session_id)
        await call.hangup()
        return True

    def _take_here(self, session_id: str, principal: str) -> LiveCall | None:
        """The principal's call held by this process: a parked one, or one a connection
        of theirs still holds (a client that reconnects before the server saw its old
        socket die: the new connection takes the call over)."""
        call = self.parking.reclaim(session_id, principal, self._clock())
        if call is not None:
            self.telemetry.call_unparked(reclaimed=True)
            log.info("call reclaimed session=%s", session_id)
            return call
        held = self._sessions.get(session_id)
        if held is None or held.owner != principal or held.over or held.hung_up:
            return None
        held.take_over()
        self.telemetry.call_moved()
        log.info("call taken over by a new connection session=%s", session_id)
        return held

    def _arm_sweep(self) -> None:
        deadline = self.parking.next_deadline()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        if deadline is None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, deadline - self._clock())
        self._sweep = loop.call_later(delay, self._expire)

    def _expire(self) -> None:
        self._sweep = None
        for call in self.parking.expired(self._clock()):
            self.telemetry.call_unparked(reclaimed=False)
            log.info("parked call ended: not reclaimed session=%s", call.session_id)
            detached(call.hangup(), name=f"call-expire-{call.session_id}")
        self._arm_sweep()

    # -- archive -----------------------------------------------------------------------

    async def archive(self, call: LiveCall, record: VoiceTurnRecord) -> None:
        """A voice turn as a text turn: transcript = user message, agent text = reply."""
        now = self._wall()
        reply = (
            Message(
                id=new_id("msg"),
                session_id=call.session_id,
                role="assistant",
                content=record.reply_text,
                content_type="text",
                metadata=VOICE_METADATA,
                created_at=now,
                updated_at=now,
                turn_offset=2 if record.user_text else 0,
            )
            if record.reply_text
            else None
        )
        if not record.user_text:
            assert reply is not None
            await self._store.append_message(reply)
            return
        turn = Turn(
            id=new_id("turn"),
            session_id=call.session_id,
            state=record.state,
            created_at=now,
            started_at=now,
            ended_at=now,
            error_code=record.error_code,
            error_message=record.error_message,
        )
        user = Message(
            id=new_id("msg"),
            session_id=call.session_id,
            turn_id=turn.id,
            role="user",
            content=record.user_text,
            content_type="text",
            metadata=VOICE_METADATA,
            created_at=now,
            updated_at=now,
            turn_offset=1,
        )
        if reply is not None:
            reply = msgspec.structs.replace(reply, turn_id=turn.id)
        await self._store.begin_turn(turn, user, reply=reply)

    # -- shutdown ----------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Hang up every call, parked or live, and wait for each to be archived."""
        if self._sweep is not None:
            self._sweep.cancel()
        calls = list(self._live)
        # Their records stay, parked for the window: a caller who reconnects to another
        # replica continues the session there (docs/replicas.md, "Voice calls").
        self._stopping = True
        until = self._wall() + self._grace
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_GRACE):
                await asyncio.gather(
                    *(self.directory.park(c.session_id, c.token, until) for c in calls)
                )
        for call in calls:
            await call.hangup()
        await asyncio.gather(*(call.wait() for call in calls), return_exceptions=True)
        for runtime in self._runtimes.values():
            close = getattr(runtime, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()

    @property
    def live_count(self) -> int:
        return len(self._live)


def _nobody(event: DuplexEvent | None) -> None:
    """A continued call's listener until its connection attaches (see `reclaim`)."""
