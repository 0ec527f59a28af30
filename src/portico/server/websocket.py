"""The `/ws` adapter: feeds the Omnia core, writes what it returns, calls the engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiohttp import WSMsgType, web

from portico.config import DEFAULT_AGENT
from portico.core.engine import UserMessage
from portico.core.events import TurnEvent
from portico.core.model import new_id
from portico.errors import (
    InternalError,
    MediaNotEnabled,
    PorticoError,
)
from portico.protocols.omnia.connection import (
    CLOSE_KEEPALIVE_TIMEOUT,
    Event,
    Keepalive,
    MessageReceived,
    OmniaConnection,
    ToolReply,
    UploadRequested,
)
from portico.protocols.omnia.frames import ToolCallAckFrame, ToolCallNackFrame, ToolResultFrame
from portico.server.services import SERVICES, Services

log = logging.getLogger("portico.ws")


class OmniaSocket:
    """One `/ws` connection: a read loop, a writer task and a keepalive task."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        services: Services,
        principal: str,
        agent: str,
        binary: bool,
    ) -> None:
        settings = services.settings
        self._ws = ws
        self._services = services
        self._principal = principal
        self._agent = agent
        self._loop = asyncio.get_running_loop()
        self._core = OmniaConnection(
            session_id=new_id("sess"),
            binary=binary,
            max_payload_size=settings.max_payload_size,
            ping_interval=settings.ping_interval,
            pong_timeout=settings.pong_timeout,
            now=self._loop.time(),
        )
        self._wake = asyncio.Event()
        self._attached: set[str] = set()
        self._closed = False

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
        ws = self._ws
        while not ws.closed:
            msg = await ws.receive()
            now = self._loop.time()
            if msg.type is WSMsgType.TEXT:
                await self._handle_all(self._core.receive_text(msg.data, now))
            elif msg.type is WSMsgType.BINARY:
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
                raise MediaNotEnabled()

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
        engine = self._services.engine
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
        await engine.submit(message, self._on_turn_event)
        self._attached.add(event.session_id)

    # -- writing ------------------------------------------------------------------

    def _on_turn_event(self, event: TurnEvent) -> None:
        if not self._closed:
            self._core.send_turn_event(event)
            self._wake.set()

    async def _write_loop(self) -> None:
        ws = self._ws
        while not ws.closed:
            await self._wake.wait()
            self._wake.clear()
            for frame in self._core.data_to_send():
                await ws.send_frame(frame, WSMsgType.TEXT)

    async def _keepalive_loop(self) -> None:
        while not self._ws.closed:
            await asyncio.sleep(max(0.0, self._core.next_deadline() - self._loop.time()))
            action = self._core.keepalive(self._loop.time())
            if action is Keepalive.PING:
                await self._ws.ping()
            elif action is Keepalive.CLOSE:
                await self._ws.close(code=CLOSE_KEEPALIVE_TIMEOUT, message=b"keepalive timeout")
                return


async def omnia_handler(request: web.Request) -> web.StreamResponse:
    services = request.app[SERVICES]
    agent = request.query.get("agent") or DEFAULT_AGENT
    if not services.engine.has_agent(agent):
        raise web.HTTPNotFound(text=f"unknown agent {agent!r}")
    principal = await services.principal_of(request)
    settings = services.settings
    ws = web.WebSocketResponse(
        max_msg_size=settings.max_payload_size,
        autoping=False,  # the core tracks pongs to decide when a peer is dead
        compress=settings.ws_compression,
    )
    await ws.prepare(request)
    services.websockets.add(ws)
    binary = request.query.get("binary", "false").lower() == "true"
    with contextlib.suppress(ConnectionResetError):
        await OmniaSocket(ws, services, principal, agent, binary).serve()
    return ws
