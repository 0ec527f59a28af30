"""The `/ws` adapter: feeds the Omnia core, writes what it returns, calls the engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiohttp import WSCloseCode, WSMsgType, web

from portico.config import DEFAULT_AGENT
from portico.core.engine import UserMessage
from portico.core.events import TurnEvent
from portico.core.model import new_id
from portico.errors import InternalError, PorticoError, RateLimited
from portico.protocols.omnia.connection import (
    CLOSE_KEEPALIVE_TIMEOUT,
    CLOSE_SLOW_CONSUMER,
    ConnectionLimits,
    Event,
    Keepalive,
    LimitHit,
    MessageReceived,
    OmniaConnection,
    ToolReply,
    UploadRequested,
)
from portico.protocols.omnia.frames import (
    ToolCallAckFrame,
    ToolCallNackFrame,
    ToolResultFrame,
    UploadReady,
)
from portico.server.admission import admit
from portico.server.services import SERVICES, Services

log = logging.getLogger("portico.ws")
PROTOCOL = "omnia"


def connection_limits(services: Services) -> ConnectionLimits:
    settings = services.settings
    return ConnectionLimits(
        max_payload_size=settings.max_payload_size,
        ping_interval=settings.ping_interval,
        pong_timeout=settings.pong_timeout,
        messages_per_second=settings.rate_limit_messages,
        message_burst=settings.rate_limit_burst,
        media_bytes_per_second=settings.media_rate_bytes,
        max_send_queue_bytes=settings.max_send_queue_bytes,
    )


class OmniaSocket:
    """One `/ws` connection: a read loop, a writer task and a keepalive task."""

    def __init__(
        self,
        request: web.Request,
        ws: web.WebSocketResponse,
        services: Services,
        principal: str,
        agent: str,
    ) -> None:
        self._transport = request.transport
        # Upload URLs point at this server as the client reached it.
        self._base_url = str(request.url.origin())
        self._ws = ws
        self._services = services
        self._principal = principal
        self._agent = agent
        self._loop = asyncio.get_running_loop()
        self._core = OmniaConnection(
            session_id=new_id("sess"),
            binary=request.query.get("binary", "false").lower() == "true",
            limits=connection_limits(services),
            now=self._loop.time(),
        )
        self._metrics = services.metrics
        self._wake = asyncio.Event()
        self._attached: set[str] = set()
        self._closed = False
        # A close the server started (keepalive, slow consumer); the handler waits for it
        # so the close frame reaches the client before the socket goes.
        self._closing: asyncio.Task[None] | None = None

    async def serve(self) -> None:
        started = time.perf_counter()
        log.info(
            "connection opened protocol=omnia session=%s principal=%s agent=%s",
            self._core.session_id,
            self._principal,
            self._agent,
        )
        self._wake.set()
        writer = asyncio.create_task(self._write_loop())
        keepalive = asyncio.create_task(self._keepalive_loop())
        try:
            await self._read_loop()
        finally:
            self._closed = True
            for session_id in self._attached:
                self._services.engine.detach(session_id, self._on_turn_event)
            if self._closing is not None:
                await asyncio.gather(self._closing, return_exceptions=True)
            for task in (writer, keepalive):
                task.cancel()
            await asyncio.gather(writer, keepalive, return_exceptions=True)
            log.info(
                "connection closed protocol=omnia session=%s close_code=%s duration_s=%.1f",
                self._core.session_id,
                self._ws.close_code,
                time.perf_counter() - started,
            )

    # -- reading ------------------------------------------------------------------

    async def _read_loop(self) -> None:
        ws, frames_in = self._ws, self._metrics.frames_in.labels(PROTOCOL)
        while not ws.closed:
            msg = await ws.receive()
            now = self._loop.time()
            if msg.type is WSMsgType.TEXT:
                frames_in.inc()
                await self._handle_all(self._core.receive_text(msg.data, now))
            elif msg.type is WSMsgType.BINARY:
                frames_in.inc()
                await self._handle_all(self._core.receive_binary(msg.data, now))
            elif msg.type is WSMsgType.PING:
                self._core.receive_control(now)
                await ws.pong(msg.data)
            elif msg.type is WSMsgType.PONG:
                self._core.receive_control(now)
            else:  # CLOSE, CLOSING, CLOSED, ERROR (e.g. a frame over max_msg_size: 1009)
                break
            self._wake.set()

    async def _handle_all(self, events: list[Event]) -> None:
        for event in events:
            try:
                await self._handle(event)
            except PorticoError as exc:
                self._core.send_error(exc, getattr(event, "session_id", None))
            except Exception:
                log.exception("unexpected error handling a /ws frame")
                self._core.send_error(InternalError(), getattr(event, "session_id", None))

    async def _handle(self, event: Event) -> None:
        match event:
            case MessageReceived():
                await self._submit(event)
            case ToolReply():
                await self._tool_reply(event)
            case UploadRequested():
                await self._request_upload(event)
            case LimitHit(limit=limit):
                self._metrics.rate_limited.labels(limit).inc()

    async def _request_upload(self, event: UploadRequested) -> None:
        request = event.request
        grant = await self._services.media.request_upload(
            principal=self._principal,
            session_id=event.session_id,
            filename=request.filename,
            mime_type=request.mime_type,
            size_bytes=request.size_bytes,
            base_url=self._base_url,
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
        self._core.send_upload_ready(event.session_id, ready)

    async def _tool_reply(self, reply: ToolReply) -> None:
        tools, frame = self._services.tools, reply.frame
        match frame:
            case ToolCallAckFrame():
                await tools.acknowledge(self._principal, reply.call_id)
            case ToolCallNackFrame(tool_call_nack=nack):
                tools.reject(self._principal, reply.call_id, nack.reason)
            case ToolResultFrame(tool_result=result):
                tools.answer(self._principal, reply.call_id, result.result, result.error)

    async def _submit(self, event: MessageReceived) -> None:
        if self._services.draining:
            self._metrics.rate_limited.labels("draining").inc()
            raise RateLimited("the server is draining; reconnect and send again")
        message = UserMessage(
            principal=self._principal,
            agent=self._agent,
            session_id=event.session_id,
            own_session=event.own_session,
            content=event.content,
            parts=event.parts,
            metadata=event.metadata,
            directives=event.directives,
            declare=event.declare,
        )
        await self._services.engine.submit(message, self._on_turn_event)
        self._attached.add(event.session_id)

    # -- writing ------------------------------------------------------------------

    def _on_turn_event(self, event: TurnEvent) -> None:
        if not self._closed:
            self._core.send_turn_event(event)
            self._wake.set()

    async def _write_loop(self) -> None:
        ws, frames_out = self._ws, self._metrics.frames_out.labels(PROTOCOL)
        while not ws.closed:
            await self._wake.wait()
            self._wake.clear()
            while (frame := self._core.next_frame()) is not None:
                # Awaiting the write is the backpressure: while a client does not read,
                # frames wait in the core's bounded queue, never in an unbounded buffer.
                await ws.send_frame(frame, WSMsgType.TEXT)
                frames_out.inc()
            if self._core.overflowed:
                self._metrics.slow_consumers.inc()
                log.info("slow consumer session=%s: send queue full", self._core.session_id)
                self._start_close(CLOSE_SLOW_CONSUMER, b"slow consumer")
                return

    async def going_away(self) -> None:
        """Server shutdown: flush what is queued, then close with 1001."""
        self._closed = True  # no more turn events; what is queued still goes out
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._services.settings.close_timeout):
                while (frame := self._core.next_frame()) is not None:
                    await self._ws.send_frame(frame, WSMsgType.TEXT)
        self._start_close(WSCloseCode.GOING_AWAY, b"server shutting down")
        await asyncio.gather(self._closing or asyncio.sleep(0), return_exceptions=True)

    def _start_close(self, code: int, reason: bytes) -> None:
        if self._closing is None:
            self._closing = asyncio.create_task(self._close(code, reason))

    async def _close(self, code: int, reason: bytes) -> None:
        """Close with `code`; a client that never takes the close frame is dropped."""
        try:
            async with asyncio.timeout(self._services.settings.close_timeout):
                await self._ws.close(code=code, message=reason)
        except TimeoutError:
            if self._transport is not None:
                self._transport.abort()

    async def _keepalive_loop(self) -> None:
        while not self._ws.closed:
            await asyncio.sleep(max(0.0, self._core.next_deadline() - self._loop.time()))
            action = self._core.keepalive(self._loop.time())
            if action is Keepalive.PING:
                await self._ws.ping()
            elif action is Keepalive.CLOSE:
                self._start_close(CLOSE_KEEPALIVE_TIMEOUT, b"keepalive timeout")
                return


async def omnia_handler(request: web.Request) -> web.StreamResponse:
    services = request.app[SERVICES]
    agent = request.query.get("agent") or DEFAULT_AGENT
    if not services.engine.has_agent(agent):
        raise web.HTTPNotFound(text=f"unknown agent {agent!r}")
    principal = await admit(request, services)
    settings = services.settings
    ws = web.WebSocketResponse(
        max_msg_size=settings.max_payload_size,
        autoping=False,  # the core tracks pongs to decide when a peer is dead
        compress=settings.ws_compression,
    )
    async with services.slots.hold():
        await ws.prepare(request)
        open_gauge = services.metrics.connections_open.labels(PROTOCOL)
        services.metrics.connections.labels(PROTOCOL).inc()
        open_gauge.inc()
        try:
            socket = OmniaSocket(request, ws, services, principal, agent)
            services.connections.add(socket)
            with contextlib.suppress(ConnectionResetError):
                await socket.serve()
        finally:
            open_gauge.dec()
    return ws
