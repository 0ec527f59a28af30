"""The `/ws` adapter: feeds the Omnia core, writes what it returns, calls the engine."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from portico.auth.base import (
    BEARER_SUBPROTOCOL_PREFIX,
    Identity,
    offered_subprotocols,
    subprotocol_token,
)
from portico.calls.service import LiveCall
from portico.config import DEFAULT_AGENT, Settings
from portico.core.engine import UserMessage
from portico.core.events import TurnCompleted, TurnEvent, TurnFailed
from portico.core.tools import ClientReply
from portico.domain.model import new_id
from portico.domain.trace import DISCLOSURE_DISPLAYED
from portico.errors import (
    DeclareTooLarge,
    DuplexError,
    InternalError,
    PorticoError,
    RateLimited,
    SessionExpired,
)
from portico.protocols.credential import (
    CLOSE_CREDENTIAL_EXPIRED,
    CREDENTIAL_EXPIRED_REASON,
    held_off,
)
from portico.protocols.omnia.connection import (
    CLOSE_KEEPALIVE_TIMEOUT,
    CLOSE_SLOW_CONSUMER,
    SESSION_ID_PATTERN,
    ConnectionLimits,
    DisclosureAcknowledged,
    Event,
    Keepalive,
    LimitHit,
    MessageReceived,
    OmniaConnection,
    RefreshOffered,
    ToolReply,
    UploadRequested,
    memory_facet_of,
)
from portico.protocols.omnia.frames import (
    ToolCallAckFrame,
    ToolCallNackFrame,
    ToolResultFrame,
    UploadReady,
)
from portico.protocols.omnia.voice import CallAudio, CallHungUp, CallRequested
from portico.runtime.duplex.base import DuplexEvent
from portico.server.admission import admit
from portico.server.duplex import voice_limits
from portico.server.services import SERVICES, Services
from portico.server.sockets import ServerSocket, handler, upgrade

log = logging.getLogger("portico.ws")
PROTOCOL = "omnia"
_LIMITS: dict[int, tuple[Settings, ConnectionLimits]] = {}
_EMPTY: dict[str, None] = {}  # shared, never written: a connection's `_attached` until used


def connection_limits(services: Services) -> ConnectionLimits:
    """The settings' limits, made once per process: every connection shares them."""
    settings = services.settings
    cached = _LIMITS.get(id(settings))
    if cached is not None and cached[0] is settings:
        return cached[1]
    limits = ConnectionLimits(
        max_payload_size=settings.max_payload_size,
        ping_interval=settings.ping_interval,
        pong_timeout=settings.pong_timeout,
        messages_per_second=settings.rate_limit_messages,
        message_burst=settings.rate_limit_burst,
        media_bytes_per_second=settings.media_rate_bytes,
        media_burst_bytes=settings.media_rate_burst,
        max_send_queue_bytes=settings.max_send_queue_bytes,
        credential_margin=settings.credential_expiry_margin,
    )
    _LIMITS.clear()  # one settings tree per process; tests make a few, one after another
    _LIMITS[id(settings)] = (settings, limits)
    return limits


class OmniaSocket(ServerSocket):
    """One `/ws` connection."""

    protocol = PROTOCOL
    __slots__ = (
        "_agent",
        "_attached",
        "_binding",
        "_call",
        "_call_epoch",
        "_core",
        "_memory_facet",
        "_principal",
        "_submitting",
    )

    def __init__(
        self,
        request: web.Request,
        ws: web.WebSocketResponse,
        services: Services,
        identity: Identity,
        agent: str,
        memory_facet: str,
        resume: str | None = None,
        reclaimed: LiveCall | PorticoError | None = None,
    ) -> None:
        super().__init__(request, ws, services)
        # Taken by `open_socket`: counted until the socket ends (`_ended` gives it back).
        self.hold(identity.principal)
        # Upload URLs point at this server as the client reached it: `self._request`.
        self._principal = identity.principal
        self._binding = identity.session_value
        self._agent = agent
        self._memory_facet = memory_facet
        # `?resume=`: the principal's call this connection took over (`omnia_handler`).
        self._call = reclaimed if isinstance(reclaimed, LiveCall) else None
        self._call_epoch = 0  # events of an earlier call of this connection are ignored
        self._core = OmniaConnection(
            session_id=resume if reclaimed is not None and resume else new_id("sess"),
            binary=request.query.get("binary", "false").lower() == "true",
            limits=connection_limits(services),
            now=self._loop.time(),
            wall=time.time(),
            memory_facet=memory_facet,
            ai_disclosure=services.engine.ai_disclosure(agent),
            identity=identity,
            # A reclaimed call keeps its own agent's limits, whatever `agent` this names.
            voice=voice_limits(
                services.settings, services.calls, agent if self._call is None else self._call.agent
            ),
            resumed=None if resume is None else reclaimed is not None,
        )
        if resume is not None:
            self._resume_call(resume, reclaimed)
        # The sessions this connection's turns ran in; an ordered set, made at the first
        # message (an idle connection holds none): _EMPTY until then.
        self._attached: dict[str, None] = _EMPTY
        # A message handed to the engine whose turn has not started yet: the drain
        # must wait for it as for a running turn (see `turn_running`).
        self._submitting = False
        # The minted id is this principal's before its first message (core/reservations.py).
        services.reservations.reserve(self._core.session_id, self._principal)

    @property
    def core(self) -> OmniaConnection:
        return self._core

    def traced_sessions(self) -> tuple[str, ...]:
        return tuple(sorted({self._core.session_id, *self._attached}))

    def describe(self) -> str:
        return f"session={self._core.session_id} principal={self._principal} agent={self._agent}"

    def on_closed(self) -> None:
        if self._call is not None:
            # Dropped without `hangup`: the call waits for a `?resume` in its window.
            self._services.calls.park(self._call)
            self._call = None
        self._services.reservations.release(self._core.session_id)
        for session_id in self._attached:
            self._services.engine.detach(session_id, self._on_turn_event)

    async def on_text(self, data: str, now: float) -> None:
        events = self._core.receive_text(data, now)
        del data  # decoded: the message's parts hold what is needed of it
        await self._handle_all(events)

    async def on_binary(self, data: bytes, now: float) -> None:
        await self._handle_all(self._core.receive_binary(data, now))

    def on_control(self, now: float) -> None:
        self._core.receive_control(now)

    async def on_timer(self, now: float) -> None:
        action = self._core.keepalive(now)
        if action is Keepalive.PING:
            await self._ws.ping()
        elif action is Keepalive.CLOSE:
            self.start_close(CLOSE_KEEPALIVE_TIMEOUT, "keepalive timeout")
        if await self._turn_elsewhere(now):
            return  # held off until that turn ends; asked again at the next timer
        self._check_expiry()

    async def _turn_elsewhere(self, now: float) -> bool:
        """Past the credential's close point with no turn here: whether another replica
        runs a turn of an attached session (its output streams to this connection)."""
        clock = self._core.credential
        if not clock.close_point_passed(now) or self.turn_running():
            return False
        return held_off(
            clock, now, await self._services.engine.runs_elsewhere(tuple(self._attached))
        )

    def turn_running(self) -> bool:
        # While `engine.submit` awaits the archive and the turn lock, neither the
        # engine nor `_attached` knows the turn yet; a drain that closed the socket
        # then would cut a turn that starts a moment later, whose reply the client
        # never sees (it sends the message again after the move: a second turn).
        return self._submitting or any(self._services.engine.is_busy(s) for s in self._attached)

    def _check_expiry(self) -> None:
        """Close 4401 once the credential's close point passed and no turn runs here."""
        if self._core.expiry_due(self._now(), turn_running=self.turn_running()):
            self.start_close(CLOSE_CREDENTIAL_EXPIRED, CREDENTIAL_EXPIRED_REASON)

    def _now(self) -> float:
        return self._loop.time()

    def on_overflow(self) -> None:
        self.start_close(CLOSE_SLOW_CONSUMER, "slow consumer")

    # -- events -------------------------------------------------------------------

    async def _handle_all(self, events: list[Event]) -> None:
        for event in events:
            try:
                if type(event) is CallAudio:  # 50 a second per call: no _handle coroutine
                    if self._call is not None:
                        await self._call.send(event.audio)
                else:
                    await self._handle(event)
            except PorticoError as exc:
                self._core.send_error(exc, getattr(event, "session_id", None), now=self._now())
            except Exception:
                log.exception("unexpected error handling a /ws frame")
                error = InternalError()
                self._core.send_error(error, getattr(event, "session_id", None), now=self._now())

    async def _handle(self, event: Event) -> None:
        match event:
            case MessageReceived():
                await self._submit(event)
            case ToolReply():
                await self._tool_reply(event)
            case UploadRequested():
                await self._request_upload(event)
            case DisclosureAcknowledged(session_id=session_id):
                self._services.engine.traces.record(
                    session_id, self._principal, DISCLOSURE_DISPLAYED, assertedBy="client"
                )
            case LimitHit(limit=limit):
                self._metrics.rate_limited.labels(limit).inc()
            case RefreshOffered(token=token):
                await self.refresh_credential(token, self._core.refresh)
            case CallRequested():
                await self._start_call(event)
            case CallHungUp():
                await self._hang_up_call()

    # -- voice calls --------------------------------------------------------------

    def _resume_call(self, resume: str, reclaimed: LiveCall | PorticoError | None) -> None:
        """After `connected`: the reclaimed call's format, or why there is no call."""
        if isinstance(reclaimed, PorticoError):
            # The session continues, its call could not (a limit, the runtime here).
            self._core.call_resumed(None, self._now())
            self._core.refuse_call(reclaimed, self._now())
            return
        call = self._call
        if call is None:
            # Missing, expired and another principal's call look the same.
            self._core.send_error(SessionExpired(), resume, now=self._now())
            return
        self._core.call_resumed(call.format, self._now())
        call.attach(self._call_listener(), self._call_taken)

    def _call_taken(self) -> None:
        """A newer connection of this principal resumed the call: this one lets go,
        with one error so its client knows why its call went quiet."""
        self._call = None
        self._call_epoch += 1
        if not self._closed:
            moved = DuplexError("the call was resumed on another connection")
            self._core.refuse_call(moved, self._now())
            self.wake()

    def _call_listener(self) -> Callable[[DuplexEvent | None], None]:
        self._call_epoch += 1
        return functools.partial(self._on_call_event, self._call_epoch)

    async def _start_call(self, event: CallRequested) -> None:
        if self._services.draining:
            self._core.refuse_call(RateLimited("the server is draining"), self._now())
            return
        call_listener = self._call_listener()
        try:
            call = await self._services.calls.start(
                principal=self._principal,
                binding=self._binding,
                agent=self._agent,
                session_id=self._core.session_id,
                format=event.format,
                listener=call_listener,
            )
        except PorticoError as exc:
            self._core.refuse_call(exc, self._now())
            if isinstance(exc, RateLimited):
                self._metrics.rate_limited.labels("audio_sessions").inc()
            return
        if self._closed:
            self._services.calls.park(call)  # the socket went while the call started
            return
        self._call = call
        call.attach(call_listener, self._call_taken)
        await call.send(event.audio)

    async def _hang_up_call(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            self._call_epoch += 1  # what the call still says is not for this socket
            self._core.call_ended()
            await call.hangup()

    def _on_call_event(self, epoch: int, event: DuplexEvent | None) -> None:
        if epoch != self._call_epoch or self._closed:
            return
        now = self._loop.time()
        if event is None:
            self._call = None
            self._core.call_ended()
        else:
            self._core.send_duplex_event(event, now)
        self.wake()

    async def _request_upload(self, event: UploadRequested) -> None:
        request = event.request
        grant = await self._services.media.request_upload(
            principal=self._principal,
            binding=self._binding,
            session_id=event.session_id,
            filename=request.filename,
            mime_type=request.mime_type,
            size_bytes=request.size_bytes,
            base_url=str(self._request.url.origin()),
        )
        self._metrics.uploads.labels("granted").inc()
        ready = UploadReady(
            upload_id=grant.upload_id,
            upload_url=grant.upload_url,
            storage_ref=grant.storage_ref,
            expires_at=grant.expires_at,
            method=grant.method,
            headers=grant.headers,
        )
        self._core.send_upload_ready(event.session_id, ready, now=self._now())

    async def _tool_reply(self, reply: ToolReply) -> None:
        tools, frame = self._services.tools, reply.frame
        match frame:
            case ToolCallAckFrame():
                answer = ClientReply(kind="ack")
            case ToolCallNackFrame(tool_call_nack=nack):
                answer = ClientReply(kind="nack", reason=nack.reason)
            case ToolResultFrame(tool_result=result):
                answer = ClientReply(kind="result", result=result.result, error=result.error)
        # Another replica's turn may have made the call (docs/replicas.md).
        await tools.settle(self._principal, reply.call_id, answer)

    async def _submit(self, event: MessageReceived) -> None:
        if self._services.draining:
            self._metrics.rate_limited.labels("draining").inc()
            raise RateLimited("the server is draining; reconnect and send again")
        message = UserMessage(
            principal=self._principal,
            binding=self._binding,
            agent=self._agent,
            session_id=event.session_id,
            own_session=event.own_session,
            content=event.content,
            parts=event.parts,
            metadata=event.metadata,
            directives=event.directives,
            declare=await self._declaration(event),
            memory_facet=self._memory_facet,
        )
        self._submitting = True
        try:
            await self._services.engine.submit(message, self._on_turn_event)
        finally:
            self._submitting = False
        if self._attached is _EMPTY:
            self._attached = {}
        self._attached[event.session_id] = None

    async def _declaration(self, event: MessageReceived) -> dict[str, Any] | None:
        """The `declare` to submit: one over 16 KiB is refused only where it would be read."""
        if not event.declare_too_large:
            return event.declare
        if await self._services.store.get_session(event.session_id) is None:
            raise DeclareTooLarge()  # this message would open the session
        return None  # a later message ignores declare, whatever its size

    # -- writing ------------------------------------------------------------------

    def _on_turn_event(self, event: TurnEvent) -> None:
        if not self._closed:
            self._core.send_turn_event(event, self._loop.time())
            self.wake()
            if isinstance(event, TurnCompleted | TurnFailed):
                # The engine frees the session after its last event: check once it has.
                self._loop.call_soon(self._check_expiry)


async def open_socket(request: web.Request) -> OmniaSocket:
    """Admit and upgrade: the socket, which holds the principal's connection from now
    on (given back when it ends), or the upgrade's refusal."""
    services = request.app[SERVICES]
    agent = request.query.get("agent") or DEFAULT_AGENT
    if not services.engine.has_agent(agent):
        raise web.HTTPNotFound(text=f"unknown agent {agent!r}")
    identity = await admit(request, services)
    memory_facet = upgrade_memory_facet(request, services, agent)
    resume = upgrade_resume(request, services)
    principal = identity.principal
    if not services.principals.take(principal):
        services.metrics.upgrades_refused.labels("principal").inc()
        raise web.HTTPTooManyRequests(
            text="too many connections for this principal", headers={"Retry-After": "1"}
        )
    reclaimed: LiveCall | PorticoError | None = None
    try:
        if resume is not None:
            # The principal's call of that session, wherever it runs (docs/replicas.md).
            reclaimed = await services.calls.reclaim(resume, principal, identity.session_value)
        protocols = selected_subprotocol(request.headers.get("Sec-WebSocket-Protocol"))
        ws = await upgrade(request, services, protocols=protocols)
        try:
            return OmniaSocket(
                request, ws, services, identity, agent, memory_facet, resume, reclaimed
            )
        except BaseException:
            services.slots.give()
            raise
    except BaseException:
        services.principals.give(principal)
        if isinstance(reclaimed, LiveCall):
            services.calls.park(reclaimed)  # the upgrade failed: the call waits again
        raise


def upgrade_memory_facet(request: web.Request, services: Services, agent: str) -> str:
    """The connection's memory facet, or the upgrade's refusal (400 or 403)."""
    try:
        return memory_facet_of(
            request.query.getall("memory_facet", []), services.engine.fixed_facet(agent)
        )
    except PorticoError as exc:
        services.metrics.upgrades_refused.labels("memory_facet").inc()
        refusal = web.HTTPForbidden if exc.http_status == 403 else web.HTTPBadRequest
        raise refusal(text=exc.message) from None


def upgrade_resume(request: web.Request, services: Services) -> str | None:
    """`?resume=<session id>`, or the upgrade's refusal (400) when it is malformed."""
    values = request.query.getall("resume", [])
    if not values:
        return None
    if len(values) > 1 or not SESSION_ID_PATTERN.fullmatch(values[0]):
        services.metrics.upgrades_refused.labels("resume").inc()
        raise web.HTTPBadRequest(
            text="resume must be one session id: 1 to 128 letters, digits, '_', '.', ':' or '-'"
        )
    return values[0]


def selected_subprotocol(header: str | None) -> tuple[str, ...]:
    """With a `portico.bearer.<token>` entry offered, the first other entry: a browser
    fails an upgrade that selects none of its offers, and the token is never echoed."""
    offered = offered_subprotocols(header)
    if subprotocol_token(offered) is None:
        return ()
    real = [entry for entry in offered if not entry.startswith(BEARER_SUBPROTOCOL_PREFIX)]
    return tuple(real[:1])


# `/ws`'s route handler: one coroutine frame per connection (`ServerSocket.serve`).
omnia_handler = handler(open_socket)
