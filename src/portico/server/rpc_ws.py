"""The `/v1/rpc` adapter: authenticates `connect`, replays missed updates, runs requests
concurrently against `Conversations`, and pushes updates and live chunks."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import msgspec
from aiohttp import web

from portico.core.conversations import ForkRequest, Page, SendRequest
from portico.core.events import TurnChunk, TurnCompleted, TurnEvent, TurnFailed
from portico.domain.model import Update
from portico.errors import (
    InvalidRequest,
    PorticoError,
    RpcInternal,
    RpcRateLimited,
    RpcTooManyConnections,
    RpcUnauthenticated,
    Unauthenticated,
)
from portico.protocols.credential import held_off
from portico.protocols.rpc import frames as f
from portico.protocols.rpc.connection import (
    CLOSE_SLOW_CONSUMER,
    ConnectReceived,
    CredentialOffered,
    Event,
    RequestReceived,
    RpcConnection,
)
from portico.protocols.rpc.entities import (
    WireEntity,
    WireMessage,
    entity_wire,
    message_wire,
    rtc_wire,
    session_wire,
    trace_wire,
    turn_wire,
)
from portico.server.admission import check_admission
from portico.server.services import SERVICES, Services
from portico.server.sockets import ServerSocket, handler, upgraded
from portico.store.base import Background, collecting_updates

log = logging.getLogger("portico.rpc")
PROTOCOL = "rpc"
REPLAY_PAGE = 500  # updates read per archive query while replaying
MAX_IN_FLIGHT = 64  # concurrent requests per connection; more are `rate_limited`

Handler = Callable[[str, Any], Awaitable[Any]]


class RpcSocket(ServerSocket):
    """One `/v1/rpc` connection."""

    protocol = PROTOCOL
    authenticates_in_band = True

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, services: Services) -> None:
        super().__init__(request, ws, services)
        settings = services.settings
        self._core = RpcConnection(
            max_send_queue_bytes=settings.max_send_queue_bytes,
            requests_per_second=settings.rate_limit_messages,
            request_burst=settings.rate_limit_burst,
            now=self._loop.time(),
            credential_margin=settings.credential_expiry_margin,
        )
        self._principal = ""
        self._in_flight: set[asyncio.Task[None]] = set()
        self._background = Background("marking rtcs sent")
        self._handlers = method_handlers(services)

    @property
    def core(self) -> RpcConnection:
        return self._core

    def describe(self) -> str:
        return f"principal={self._principal or '-'}"

    def on_closed(self) -> None:
        if self._principal:
            self._services.updates.unsubscribe(self._principal, self._on_update)
            self._services.engine.detach_owner(self._principal, self._on_turn_event)
            self._services.tools.rpc_detached(self._principal)
        # Requests in flight run to their end (their replies go nowhere): cancelling an
        # action halfway could leave half of it done, e.g. a session without its message.

    async def on_text(self, data: str, now: float) -> None:
        await self._handle_all(self._core.receive_text(data, now))

    async def on_binary(self, data: bytes, now: float) -> None:
        await self._handle_all(self._core.receive_text(data, now))

    async def on_timer(self, now: float) -> None:
        if await self._turn_elsewhere(now):
            return  # held off until that turn ends; asked again at the next timer
        self._check_expiry()

    async def _turn_elsewhere(self, now: float) -> bool:
        """Past the credential's close point with no turn here: whether another replica
        streams a turn of the principal's here (its replies reach this connection)."""
        clock = self._core.credential
        if clock is None or not self._principal or not clock.close_point_passed(now):
            return False
        if self._services.engine.runs_a_turn_for(self._principal):
            return False
        elsewhere = await self._services.engine.runs_a_turn_elsewhere_for(self._principal)
        return held_off(clock, now, elsewhere)

    def _check_expiry(self) -> None:
        """Close 4401 once the credential's close point passed and none of the
        principal's turns runs (their replies reach this connection)."""
        if self._closed or not self._principal:
            return
        running = self._services.engine.runs_a_turn_for(self._principal)
        self._core.check_credential(self._loop.time(), turn_running=running)
        self._after_core()

    def turn_running(self) -> bool:
        """The principal's turns stream here, and a request's reply must not be lost."""
        running = bool(self._principal) and self._services.engine.runs_a_turn_for(self._principal)
        return running or bool(self._in_flight)

    def on_overflow(self) -> None:
        self.start_close(CLOSE_SLOW_CONSUMER, "slow consumer")

    def _after_core(self) -> None:
        self._mark_delivered()
        self.wake()
        if self._core.close_request is not None:
            self.start_close(*self._core.close_request)

    async def _handle_all(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, ConnectReceived):
                await self._connect(event.connect)
            elif isinstance(event, RequestReceived):
                self._start(event.request)
            elif isinstance(event, CredentialOffered):
                await self.refresh_credential(event.token, self._core.refresh)
        self._after_core()

    # -- connect and recovery -------------------------------------------------------------

    async def _connect(self, connect: f.Connect) -> None:
        try:
            identity = await self._services.auth.identify(connect.token)
        except Unauthenticated as exc:
            self._core.refuse(RpcUnauthenticated(exc.message))
            return
        principal = identity.principal
        if not self.authenticated(principal):
            self._core.refuse(RpcTooManyConnections())
            return
        self._principal = principal
        self._handlers = method_handlers(self._services, identity.session_value)
        # Subscribe before reading the log's head: an update committed in between is
        # then held by the core and sent after the replay, not lost.
        self._services.updates.subscribe(principal, self._on_update)
        self._services.engine.attach_owner(principal, self._on_turn_event)
        self._services.tools.rpc_attached(principal)
        store = self._services.store
        head = await store.update_log(principal)
        recovered = (
            connect.offset is not None
            and connect.epoch == head.epoch
            and head.first_offset - 1 <= connect.offset <= head.last_offset
        )
        self._core.accept(
            user_id=principal, epoch=head.epoch, offset=head.last_offset, recovered=recovered
        )
        self._core.bind_credential(identity, now=self._loop.time(), wall=time.time())
        if recovered:
            assert connect.offset is not None
            await self._replay(connect.offset, head.last_offset)
        self._core.start_from(head.last_offset)
        self._core.replay_done()
        self._core.streaming(self._services.engine.streaming_replies(principal))
        self._background.spawn(self._services.tools.deliver_waiting(principal))

    async def _replay(self, after: int, until: int) -> None:
        self._core.start_from(after)
        while after < until:
            page = await self._services.store.list_updates(
                self._principal, after_offset=after, limit=REPLAY_PAGE
            )
            page = [update for update in page if update.offset <= until]
            for update in page:
                self._core.replayed(update)
            self.wake()
            if len(page) < REPLAY_PAGE:
                break
            after = page[-1].offset
        self._core.gaps_until(until)

    # -- requests -------------------------------------------------------------------------

    def _start(self, request: f.Request) -> None:
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            self._core.reply_error(request.id, RpcRateLimited("too many requests in flight"))
            return
        task = asyncio.create_task(self._run(request))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _run(self, request: f.Request) -> None:
        action = f.METHODS[request.method].action
        try:
            with collecting_updates() as updates:
                result = await self._handlers[request.method](self._principal, request.params)
            self._core.reply(request.id, result, sorted_updates(updates) if action else None)
        except PorticoError as exc:
            self._core.reply_error(request.id, exc)
        except Exception:
            log.exception("rpc method failed method=%s", request.method)
            self._core.reply_error(request.id, RpcInternal())
        self._after_core()

    # -- pushes ---------------------------------------------------------------------------

    def _on_update(self, update: Update) -> None:
        if not self._closed:
            self._core.push_update(update)
            self._mark_delivered()
            self.wake()

    def _mark_delivered(self) -> None:
        """Rtcs this connection just received are `sent` (written in the background)."""
        delivered = self._core.take_delivered_rtcs()
        if delivered:
            self._background.spawn(self._services.tools.delivered(delivered))

    def _on_turn_event(self, event: TurnEvent) -> None:
        if not self._closed and isinstance(event, TurnCompleted | TurnFailed):
            # The engine frees the session after its last event: check once it has.
            self._loop.call_soon(self._check_expiry)
        if self._closed or not isinstance(event, TurnChunk):
            return  # everything but the chunks reaches RPC clients as updates
        live = f.Live(event.session_id, event.turn_id, event.message_id, event.index, event.text)
        self._core.push_live(live)
        self.wake()


def sorted_updates(updates: list[Update]) -> list[Update]:
    return sorted(updates, key=lambda u: u.offset)


# -- methods --------------------------------------------------------------------------------


def method_handlers(services: Services, binding: str = "") -> dict[str, Handler]:
    """Each method's implementation: (principal, validated params) -> wire result, for a
    caller whose token carries the session-binding value `binding`."""
    c = services.conversations.bound_to(binding)

    async def session_list(principal: str, p: f.SessionList) -> Any:
        return page_wire(await c.list_sessions(principal, cursor=p.cursor, limit=p.limit))

    async def session_get(principal: str, p: f.SessionRef) -> Any:
        return session_wire(await c.session(principal, p.session_id))

    async def session_close(principal: str, p: f.SessionClose) -> Any:
        return session_wire(await c.close(principal, p.session_id))

    async def session_open(principal: str, p: f.SessionRef) -> Any:
        return session_wire(await c.reopen(principal, p.session_id))

    async def session_update(principal: str, p: f.SessionUpdate) -> Any:
        title = None if isinstance(p.title, msgspec.UnsetType) else p.title
        deleted_at = deletion_time(p.deleted_at)
        updated = await c.update(principal, p.session_id, title=title, deleted_at=deleted_at)
        return session_wire(updated)

    async def session_fork(principal: str, p: f.SessionFork) -> Any:
        refuse_while_draining(services)
        request = ForkRequest(
            session_id=p.old_server_session_id,
            message_id=p.old_server_message_id,
            content=p.content_data,
            client_id=p.new_client_message_id,
            client_session_id=p.new_client_session_id,
            limit=p.limit,
        )
        session, messages = await c.fork(principal, request)
        return {"session_id": session.id, "turn_id": "", "message_ids": [m.id for m in messages]}

    async def session_compact(principal: str, p: f.SessionCompact) -> Any:
        queued = await c.compact(principal, p.session_id, p.custom_instruction)
        return {"session_id": p.session_id, "queued": queued}

    async def session_trace(principal: str, p: f.SessionRef) -> Any:
        limit = services.settings.trace_max_events
        events = await c.trace(principal, p.session_id, limit=limit)
        return {"session_id": p.session_id, "items": [trace_wire(event) for event in events]}

    async def message_send(principal: str, p: f.MessageSend) -> Any:
        refuse_while_draining(services)
        if not p.client_id:
            raise InvalidRequest("client_id is required", field="params.client_id")
        request = SendRequest(
            agent_prompt=p.agent_prompt,
            content=p.content_data,
            parts=p.parts,
            client_id=p.client_id,
            server_session_id=p.server_session_id,
            client_session_id=p.client_session_id,
            agent=p.agent,
            metadata=p.metadata or {},
        )
        session, message = await c.send(principal, request)
        return {"session_id": session.id, "message_id": message.id, "turn_id": ""}

    async def message_list(principal: str, p: f.MessageList) -> Any:
        after = offset_cursor(p.cursor)
        page = await c.list_messages(principal, p.session_id, after_offset=after, limit=p.limit)
        return page_wire(page)

    async def message_get(principal: str, p: f.MessageRef) -> Any:
        return message_wire(await c.message(principal, p.message_id))

    async def turn_stop(principal: str, p: f.TurnStop) -> Any:
        await c.stop(principal, p.session_id)
        return {"session_id": p.session_id}

    async def turn_list(principal: str, p: f.PagedBySession) -> Any:
        return page_wire(
            await c.list_turns(principal, p.session_id, cursor=p.cursor, limit=p.limit)
        )

    async def turn_get(principal: str, p: f.TurnRef) -> Any:
        return turn_wire(await c.turn(principal, p.turn_id))

    async def rtc_list(principal: str, p: f.PagedBySession) -> Any:
        return page_wire(await c.list_rtcs(principal, p.session_id, cursor=p.cursor, limit=p.limit))

    async def rtc_get(principal: str, p: f.RtcRef) -> Any:
        return rtc_wire(await c.rtc(principal, p.rtc_id))

    async def rtc_update_status(principal: str, p: f.RtcUpdateStatus) -> Any:
        return rtc_wire(await c.rtc_status(principal, p.rtc_id, p.status, p.client_id))

    async def rtc_submit_result(principal: str, p: f.RtcSubmitResult) -> Any:
        record = await c.rtc_submit(
            principal,
            p.rtc_id,
            success=p.success,
            result=p.result,
            error=p.error,
            client_id=p.client_id,
        )
        return rtc_wire(record)

    handlers: dict[str, Any] = {
        "v1.session.list": session_list,
        "v1.session.get": session_get,
        "v1.session.close": session_close,
        "v1.session.open": session_open,
        "v1.session.update": session_update,
        "v1.session.fork": session_fork,
        "v1.session.compact": session_compact,
        "v1.session.trace": session_trace,
        "v1.message.send": message_send,
        "v1.message.list": message_list,
        "v1.message.get": message_get,
        "v1.turn.stop": turn_stop,
        "v1.turn.list": turn_list,
        "v1.turn.get": turn_get,
        "v1.rtc.list": rtc_list,
        "v1.rtc.get": rtc_get,
        "v1.rtc.update_status": rtc_update_status,
        "v1.rtc.submit_result": rtc_submit_result,
    }
    return handlers


def refuse_while_draining(services: Services) -> None:
    """No new turns while the server drains; the client retries on another replica."""
    if services.draining:
        services.metrics.rate_limited.labels("draining").inc()
        raise RpcRateLimited("the server is draining; send again shortly")


def page_wire(page: Page[Any]) -> dict[str, Any]:
    items: list[WireEntity] = [entity_wire(item) for item in page.items]
    if page.streamed:
        items = [_with_streamed(item, page.streamed) for item in items]
    return {"items": items, "next_cursor": page.next_cursor}


def _with_streamed(wire: WireEntity, streamed: dict[str, int]) -> WireEntity:
    if isinstance(wire, WireMessage) and wire.id in streamed:
        return msgspec.structs.replace(wire, streamed_chunks=streamed[wire.id])
    return wire


def offset_cursor(cursor: str | int) -> int:
    """`message.list`'s cursor: a global_offset, as a decimal string or an integer."""
    if cursor == "":
        return 0
    if isinstance(cursor, str):
        if not cursor.isdecimal():
            raise InvalidRequest("cursor must be a decimal global_offset", field="params.cursor")
        cursor = int(cursor)
    if not 0 <= cursor <= f.MAX_INT64:
        raise InvalidRequest("cursor must be a global_offset", field="params.cursor")
    return cursor


def deletion_time(value: datetime | msgspec.UnsetType | None) -> float | msgspec.UnsetType | None:
    """Decoding checked the time (RFC 3339, with a zone)."""
    if value is None or isinstance(value, msgspec.UnsetType):
        return value
    return value.timestamp()


async def open_rpc_socket(request: web.Request) -> RpcSocket:
    services = request.app[SERVICES]
    # Credentials come in `connect`, never in the URL or on the upgrade.
    check_admission(request, services)
    return await upgraded(
        request, services, functools.partial(RpcSocket, request, services=services)
    )


# The route handler: one coroutine frame per connection (`ServerSocket.serve`).
rpc_handler = handler(open_rpc_socket)
