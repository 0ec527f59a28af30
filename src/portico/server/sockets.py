"""What every WebSocket adapter shares: the read, write and timer loops, closing, shutdown.

A protocol adapter subclasses `ServerSocket`, feeds its sans-I/O core from the
`on_*` hooks and calls `wake()` when the core has frames to write. The core
offers `next_frame()`, `overflowed` and `next_deadline()`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import ClassVar, Protocol, TypeVar

from aiohttp import WSCloseCode, WSMessage, WSMsgType, web

from portico.auth.base import Identity
from portico.errors import Unauthenticated
from portico.protocols.outbox import BinaryData
from portico.server.admission import CLOSE_HANDSHAKE_TIMEOUT, CLOSE_TRY_AGAIN_LATER
from portico.server.metrics import Metrics
from portico.server.services import Services

log = logging.getLogger("portico.ws")
_DATA = (WSMsgType.TEXT, WSMsgType.BINARY)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def text_frame_header(length: int, *, binary: bool = False) -> bytes:
    """The header of an unmasked, final, uncompressed text (or binary) frame (RFC 6455 5.2)."""
    first = 0x82 if binary else 0x81
    if length < 126:
        return bytes((first, length))
    if length < 65536:
        return bytes((first, 126)) + length.to_bytes(2, "big")
    return bytes((first, 127)) + length.to_bytes(8, "big")


def larger_than(data: str | bytes, limit: int) -> bool:
    """Whether a received message is over `limit` bytes, counting text as UTF-8."""
    if len(data) > limit:
        return True  # a character is at least one byte
    if isinstance(data, bytes) or data.isascii() or len(data) * 4 <= limit:
        return False  # ASCII is one byte a character; nothing encodes above 4
    return len(data.encode()) > limit


def close_frame(code: int, reason: str) -> bytes:
    """An unmasked close frame (RFC 6455 5.5.1); the reason is cut to fit 125 bytes."""
    payload = code.to_bytes(2, "big") + reason.encode()[:123]
    return bytes((0x88, len(payload))) + payload


def fires_at(timer: asyncio.Handle) -> float:
    """When a loop timer fires. uvloop's `call_at` of a time already past is its
    `call_soon`: a plain Handle, with no `when()`, that fires at once."""
    when = getattr(timer, "when", None)
    return -math.inf if when is None else float(when())


def frame_type(frame: bytes) -> WSMsgType:
    """Queued frames are text unless a core marked them binary (`BinaryData`)."""
    return WSMsgType.BINARY if isinstance(frame, BinaryData) else WSMsgType.TEXT


class FramedCore(Protocol):
    @property
    def overflowed(self) -> bool: ...

    def next_frame(self) -> bytes | None: ...

    def next_deadline(self) -> float: ...


class ServerSocket(ABC):
    protocol: ClassVar[str]
    # True where the credential arrives in the first frame (`connect`, `hello`): until
    # `authenticated()`, the socket is a stranger with a deadline and a small budget.
    authenticates_in_band: ClassVar[bool] = False
    # One per connection, most of them idle: slots, not a dict (docs/performance.md); a
    # subclass without `__slots__` of its own gets a dict again.
    __slots__ = (
        "_admission",
        "_batched",
        "_closed",
        "_closing",
        "_flush_scheduled",
        "_frames",
        "_request",
        "_sent_close_code",
        "_services",
        "_timer",
        "_timer_task",
        "_transport",
        "_waiter",
        "_writing",
        "_ws",
    )

    def __init__(self, request: web.Request, ws: web.WebSocketResponse, services: Services) -> None:
        self._transport = request.transport
        self._request = request  # aiohttp keeps it for the connection's life anyway
        self._ws = ws
        self._services = services
        # No task per connection for writing or timers (each costs memory on every idle
        # connection): writes are flushed from a loop callback, deadlines are call_at
        # handles, and a task exists only while it has something to wait for.
        self._flush_scheduled = False
        self._writing = True  # False once the client overflowed its queue
        self._batched = not services.settings.ws_compression and self._transport is not None
        self._waiter: asyncio.Task[None] | None = None  # a drain or a compressed write
        # A loop timer, the key of a slot of the shared wheel, or None (not armed).
        # When it fires is read from it (`_armed`): a float per connection less.
        self._timer: asyncio.Handle | int | None = None
        self._timer_task: asyncio.Task[None] | None = None
        self._frames = services.metrics.frames.of(self.protocol)  # its frames, counted
        # Set once the socket stops taking engine events (closed or shutting down).
        self._closed = False
        # A close the server started; the handler waits for it so the close frame
        # reaches the client before the socket goes.
        self._closing: asyncio.Task[None] | None = None
        self._sent_close_code: int | None = None  # logged: what the client was sent
        # A stranger's handshake timer (`authenticates_in_band`), then the principal
        # whose connections count this one (`hold`): never both, so one slot.
        self._admission: asyncio.TimerHandle | str | None = None

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        # Not kept per connection (every caller runs on the server's loop), and not
        # asked of asyncio each time: see `Services.loop`.
        return self._services.loop

    @property
    def _metrics(self) -> Metrics:
        return self._services.metrics

    def hold(self, principal: str) -> None:
        """`principal`'s connection count includes this one until the socket ends."""
        self._admission = principal

    @property
    @abstractmethod
    def core(self) -> FramedCore: ...

    @abstractmethod
    def describe(self) -> str:
        """`key=value` fields for the connection's log lines."""

    @abstractmethod
    async def on_text(self, data: str, now: float) -> None: ...

    @abstractmethod
    async def on_binary(self, data: bytes, now: float) -> None: ...

    def on_control(self, now: float) -> None:
        """A WebSocket ping or pong arrived."""
        return None

    @abstractmethod
    async def on_timer(self, now: float) -> None:
        """The core's deadline passed."""

    def on_overflow(self) -> None:
        """The core's send queue overflowed: the client stopped reading."""
        return None

    def on_closed(self) -> None:
        """The socket is gone; detach from the engine."""
        return None

    # -- running ------------------------------------------------------------------------

    @staticmethod
    async def serve(
        open_socket: Callable[[web.Request], Awaitable[ServerSocket]], request: web.Request
    ) -> web.WebSocketResponse:
        """A route's handler (with the protocol's `open_socket` bound): admit, upgrade and
        serve the socket to its end; gives back the slot `upgrade` took.

        The read loop runs in this one coroutine, the handler's own: every frame of a
        coroutine chain is held by each idle connection for its whole life
        (docs/performance.md), so the handler, the socket's serving and its read loop
        are one frame. `open_socket`'s frame, with the admission's locals, is gone
        before the first read.
        """
        socket = await open_socket(request)
        del open_socket, request  # the socket holds what it needs
        started = time.perf_counter()
        try:
            socket._opened()
            ws, frames = socket._ws, socket._frames
            # aiohttp checks a compressed message's size after inflating it with one
            # byte of slack (see `upgrade`), so on a compressing connection the limit is
            # checked here, exactly.
            limit = socket._services.settings.max_payload_size if ws.compress else None
            msg: WSMessage | None
            while not ws.closed:
                msg = await ws.receive()
                now = socket._loop.time()
                if limit is not None and msg.type in _DATA and larger_than(msg.data, limit):
                    socket.start_close(WSCloseCode.MESSAGE_TOO_BIG, "message too big")
                    break
                if msg.type is WSMsgType.TEXT:
                    frames.inbound += 1
                    # Only the handler holds the frame, so it can let go of it once
                    # decoded (a maximal frame is 16 MiB of text), before the engine
                    # archives it.
                    handling = socket.on_text(msg.data, now)
                    del msg
                    await handling
                elif msg.type is WSMsgType.BINARY:
                    frames.inbound += 1
                    await socket.on_binary(msg.data, now)
                elif msg.type is WSMsgType.PING:
                    socket.on_control(now)
                    await ws.pong(msg.data)
                elif msg.type is WSMsgType.PONG:
                    socket.on_control(now)
                else:  # CLOSE, CLOSING, CLOSED, ERROR (e.g. a frame over max_msg_size: 1009)
                    break
                msg = None  # not kept while the next frame is awaited
                socket.wake()
                socket._schedule_timer()
        except ConnectionResetError:
            pass
        finally:
            await socket._ended(started)
        return socket._ws

    def _opened(self) -> None:
        """Counted, listed and logged as open."""
        services, protocol = self._services, self.protocol
        services.metrics.connections.labels(protocol).inc()
        services.metrics.connections_open.labels(protocol).inc()
        services.connections[self] = None
        log.info("connection opened protocol=%s %s", protocol, self.describe())
        if self.authenticates_in_band:
            self._await_handshake()
        self.wake()
        self._schedule_timer()

    async def _ended(self, started: float) -> None:
        """Detach, let a close the server started finish, give back the slots, log."""
        services = self._services
        try:
            self._closed = True
            self._writing = False
            self.on_closed()
            self._stop_being_a_stranger()
            if self._closing is not None:
                await asyncio.gather(self._closing, return_exceptions=True)
            await self._stop_background()
            log.info(
                "connection closed protocol=%s %s close_code=%s duration_s=%.1f",
                self.protocol,
                self.describe(),
                self._ws.close_code if self._sent_close_code is None else self._sent_close_code,
                time.perf_counter() - started,
            )
        finally:
            if isinstance(self._admission, str):
                services.principals.give(self._admission)
            services.connections.pop(self, None)
            services.metrics.connections_open.labels(self.protocol).dec()
            services.slots.give()

    # -- admission ----------------------------------------------------------------------

    def _await_handshake(self) -> None:
        self._services.strangers.arrived(self)
        self._admission = self._loop.call_later(
            self._services.settings.handshake_timeout, self._handshake_expired
        )

    def _stop_being_a_stranger(self) -> None:
        timer = self._admission
        if timer is not None and not isinstance(timer, str):  # uvloop's is no asyncio.TimerHandle
            timer.cancel()
            self._admission = None
        self._services.strangers.left(self)

    def _handshake_expired(self) -> None:
        self._admission = None
        self._stop_being_a_stranger()
        self._metrics.upgrades_refused.labels("handshake_timeout").inc()
        self._hang_up(CLOSE_HANDSHAKE_TIMEOUT, "handshake timeout")

    def evict(self) -> None:
        """The strangers' budget is full and this is its oldest member."""
        self._stop_being_a_stranger()
        self._metrics.upgrades_refused.labels("strangers").inc()
        self._hang_up(CLOSE_TRY_AGAIN_LATER, "too many unauthenticated connections")

    def _hang_up(self, code: int, reason: str) -> None:
        """Send the close frame and drop the connection at once: a stranger gets no
        closing handshake, whose wait would keep its slot for `close_timeout`."""
        if self._closing is not None or self._transport is None:
            return
        self._closed, self._writing = True, False
        if self._transport.is_closing():  # the peer is already gone: nothing is sent
            return
        self._sent_close_code = code
        self._transport.write(close_frame(code, reason))
        self._transport.close()  # flushes the close frame first

    def authenticated(self, principal: str) -> bool:
        """The in-band credential proved `principal`: no longer a stranger, and one of the
        principal's connections from now on. False: the principal has none left."""
        self._stop_being_a_stranger()
        if not self._services.principals.take(principal):
            self._metrics.upgrades_refused.labels("principal").inc()
            return False
        self.hold(principal)
        return True

    async def refresh_credential(self, token: str, refresh: Callable[..., bool]) -> None:
        """A refresh frame's token: verified, then offered to the core's `refresh`
        (which applies the acceptance rules). No reply either way; one INFO line per
        accepted refresh, never the token."""
        try:
            identity: Identity = await self._services.auth.identify(token)
        except Unauthenticated:
            return  # ignored, as any token the rules refuse
        if refresh(identity, now=self._loop.time(), wall=time.time()):
            log.info(
                "credential refreshed protocol=%s %s expires_at=%d",
                self.protocol,
                self.describe(),
                identity.expires_at or 0,
            )
            for session_id in self.traced_sessions():
                self._services.engine.traces.credential_refreshed(
                    session_id, identity.principal, protocol=self.protocol
                )

    def traced_sessions(self) -> tuple[str, ...]:
        """The sessions whose trace records this connection's credential refreshes: an
        RPC connection serves no one session, so its refreshes are only logged."""
        return ()

    async def _stop_background(self) -> None:
        self._disarm()
        waiter = self._waiter
        if waiter is not None and self._peer_gone():
            # A compressed send runs in a task aiohttp shields from cancellation:
            # cancelling the waiter would leave that send's failure on the dead transport
            # unretrieved (logged as a traceback). On a closing transport it fails at
            # once and the waiter ends quietly, so let it, within the close timeout.
            await asyncio.wait({waiter}, timeout=self._services.settings.close_timeout)
        tasks = [t for t in (waiter, self._timer_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _peer_gone(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def wake(self) -> None:
        """Frames are queued in the core: flush them once the current step is done."""
        if not self._flush_scheduled and self._writing:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    # -- writing ------------------------------------------------------------------------

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._writing or self._ws.closed:
            return
        if self._transport is not None and self._transport.is_closing():
            # The peer hung up (a reset) and the read loop has yet to see it: uvloop
            # raises on a write to a closed transport, a traceback for a plain hang-up.
            self._writing = False
            return
        if self._waiter is not None:
            # A waiter flushes again when the drain or the write it awaits is done. A
            # client that stopped reading never lets a drain end: its frames fill the
            # core's queue meanwhile, and that overflow is acted on here.
            if self.core.overflowed:
                self._after_write()
            return
        if not self._batched:
            self._waiter = asyncio.create_task(self._write_each())
            return
        self._frames.outbound += self._write_batch()
        self._after_write()

    def _after_write(self) -> None:
        if self.core.overflowed:
            self._writing = False
            self._metrics.slow_consumers.inc()
            log.info("slow consumer protocol=%s %s", self.protocol, self.describe())
            self.on_overflow()
        elif self._request.protocol.writing_paused:
            # Waiting for the drain is the backpressure: meanwhile frames wait in the
            # core's bounded queue, never in an unbounded transport buffer.
            self._waiter = asyncio.create_task(self._drain())
        else:
            self.after_flush()

    async def _drain(self) -> None:
        await self._request.protocol._drain_helper()
        self._waiter = None
        self._flush()

    async def _write_each(self) -> None:
        """Compressed frames go through aiohttp's writer, one awaited send each."""
        written = 0
        try:
            while (frame := self.core.next_frame()) is not None and not self._ws.closed:
                await self._ws.send_frame(frame, frame_type(frame))
                written += 1
        except ConnectionResetError:
            # The peer hung up mid-send (aiohttp's compressed send awaits, and the
            # transport closed meanwhile): a plain hang-up, which the read loop ends;
            # raised out of this task it would be logged as a traceback nobody awaited.
            self._writing = False
            self._waiter = None
            return
        self._frames.outbound += written
        self._waiter = None
        self._after_write()
        if self.core.overflowed or not self._writing:
            return
        self.wake()  # frames queued while the last one was being sent

    def _write_batch(self) -> int:
        """Every queued frame in one transport write: one syscall, not one per frame.

        aiohttp writes each frame separately; uncompressed server frames are simple
        enough (RFC 6455 5.2) to frame here, and the profile showed the per-frame
        write as the largest cost of streaming.
        """
        frames: list[bytes] = []
        next_frame, append = self.core.next_frame, frames.append  # looked up once: per frame
        while (frame := next_frame()) is not None:
            append(text_frame_header(len(frame), binary=isinstance(frame, BinaryData)))
            append(frame)
        if not frames:
            return 0
        assert self._transport is not None
        self._transport.write(b"".join(frames))
        return len(frames) // 2

    def after_flush(self) -> None:
        """Everything queued was written."""
        return None

    # -- timers -------------------------------------------------------------------------

    def _schedule_timer(self) -> None:
        """Arm for the core's next deadline when it is sooner than the armed one (a
        deadline that moved later is simply re-read when the timer fires). A far one
        waits in the shared wheel (server/deadlines.py), a near one on a loop timer."""
        deadline = self.core.next_deadline()
        if deadline >= self._armed() or self._closed:
            return
        self._disarm()
        wheel = self._services.deadlines
        if deadline - self._loop.time() > wheel.resolution:
            self._timer = wheel.add(self, deadline)
        else:
            self._timer = self._loop.call_at(deadline, self._timer_fired)

    def _armed(self) -> float:
        """When the armed timer or the wheel's slot fires; infinity when not armed."""
        timer = self._timer
        if timer is None:
            return math.inf
        if isinstance(timer, int):
            return self._services.deadlines.starts(timer)
        return fires_at(timer)

    def _disarm(self) -> None:
        timer, self._timer = self._timer, None
        if isinstance(timer, int):
            self._services.deadlines.discard(self, timer)
        elif timer is not None:
            timer.cancel()

    def slot_fired(self) -> None:
        """The wheel's slot began: the deadline is less than a slot away now."""
        self._timer = None
        self._schedule_timer()

    def _timer_fired(self) -> None:
        self._timer = None
        if self._closed or self._timer_task is not None:
            return
        if self.core.next_deadline() > self._loop.time():
            # What it was armed for went without it (on /v1/session, an ack sent with
            # the turn's first chunk, once a turn): arm for what is next, no task.
            self._schedule_timer()
            return
        self._timer_task = asyncio.create_task(self._run_timer())

    async def _run_timer(self) -> None:
        try:
            await self.on_timer(self._loop.time())
        except ConnectionError:
            # A ping to a peer that just went away: the read loop ends the socket.
            log.debug("timer write on a closed connection protocol=%s", self.protocol)
        finally:
            self._timer_task = None
        self._schedule_timer()

    # -- closing ------------------------------------------------------------------------

    def start_close(self, code: int, reason: str) -> None:
        if self._sent_close_code is None:  # the first close (or hang-up) is the one sent
            self._sent_close_code = code
            self._closing = asyncio.create_task(self._close(code, reason.encode()))

    async def _close(self, code: int, reason: bytes) -> None:
        """Flush what is queued, then close with `code`; drop a client that never takes it."""
        # From here on only this task writes: a frame queued later (the answer to a
        # message that crossed the close) must not follow the close frame.
        self._writing = False
        try:
            async with asyncio.timeout(self._services.settings.close_timeout):
                if not self.core.overflowed:
                    while (frame := self.core.next_frame()) is not None:
                        await self._ws.send_frame(frame, frame_type(frame))
                await self._ws.close(code=code, message=reason)
        except (TimeoutError, ConnectionError):
            if self._transport is not None:
                self._transport.abort()

    def busy(self) -> bool:
        """Whether the drain must wait before closing this connection."""
        return not self._closed and self.turn_running()

    def turn_running(self) -> bool:
        """A turn whose output this connection carries runs now (or, on RPC, a request)."""
        return False

    async def going_away(self) -> None:
        """Server shutdown: what is queued still goes out, then close with 1001."""
        self._closed = True
        self.start_close(WSCloseCode.GOING_AWAY, "server shutting down")
        await asyncio.gather(self._closing or asyncio.sleep(0), return_exceptions=True)


@functools.lru_cache(maxsize=4)
def _one_more(limit: int) -> int:
    """`limit + 1`, one int object for every connection: a new one would be 32 bytes
    held by each idle connection's `WebSocketResponse`."""
    return limit + 1


async def upgrade(
    request: web.Request, services: Services, *, protocols: tuple[str, ...] = ()
) -> web.WebSocketResponse:
    """Take a connection slot (`max_connections`) and upgrade; from then on the slot is
    the socket's, given back when `ServerSocket.serve` ends.

    `protocols`: the subprotocols the upgrade may select (the client's first offer
    among them is echoed)."""
    settings = services.settings
    ws = web.WebSocketResponse(
        protocols=protocols,
        # aiohttp refuses a message of exactly `max_msg_size` bytes; the setting is the
        # largest message accepted.
        max_msg_size=_one_more(settings.max_payload_size),
        autoping=False,  # the cores decide when a peer is dead, so they see every pong
        compress=settings.ws_compression,
    )
    services.slots.take()
    try:
        await ws.prepare(request)
    except BaseException:
        services.slots.give()
        raise
    return ws


S = TypeVar("S", bound=ServerSocket)


async def upgraded(
    request: web.Request, services: Services, socket_for: Callable[[web.WebSocketResponse], S]
) -> S:
    """Upgrade, counting the connection against `max_connections`, and make its socket
    (which gives the slot back when it ends)."""
    ws = await upgrade(request, services)
    try:
        return socket_for(ws)
    except BaseException:
        services.slots.give()
        raise


def handler(open_socket: Callable[[web.Request], Awaitable[ServerSocket]]) -> Handler:
    """The route handler that opens sockets with `open_socket` and serves them: a
    partial, which aiohttp awaits as the coroutine function it wraps."""
    return functools.partial(ServerSocket.serve, open_socket)
