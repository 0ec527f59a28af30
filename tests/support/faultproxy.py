"""A fault-injection WebSocket proxy for tests, after Ably's unified-test-suite proxy.

The proxy listens on 127.0.0.1, accepts WebSocket upgrades and opens, for each client
connection, its own WebSocket to the real server (same path and query string; the
`Authorization` and `Origin` headers and the requested subprotocols go along). Frames are
relayed both ways with their type kept (text stays text, binary stays binary); ping and pong
control frames and close frames (code and reason) pass through too. The upstream is dialled
before the client's upgrade is answered, so an upstream refusal (HTTP 400, 401, ...) reaches
the client with the same status.

Faults come from `Rule`s, tried in order against every text and binary frame. The first
rule that fires decides what happens to the frame; rules after it neither fire nor count it.
Rules may be added and removed while connections run. Every frame, connection, close and
drop lands in `proxy.events`, an `EventLog` tests assert on and wait on.

    async with FaultProxy(server.http_url) as proxy:
        proxy.add_rule(Rule(suppress(), direction=SERVER_TO_CLIENT, type="chunk", seq=3))
        proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, type="done"))
        client = await session.ws_connect(proxy.url("/v1/session"))
        ...
        await proxy.wait_connection(1)  # the client reconnected after the cut
        delivered = proxy.events.delivered(SERVER_TO_CLIENT, type="chunk", connection=0)
        assert [chunk["seq"] for chunk in delivered] == [1, 2, 4]

Delays keep order: each direction of a connection is relayed by one task, so while a frame
is held by `delay`, the frames behind it on the same direction (close frames included) wait
too, and their own delays start only once it has been sent. The other direction is not held.

Frames the proxy sends itself (`inject`, `replace`, `ProxyConnection.send`) never go
through the rules. A half-open connection (the peers think it is up, nothing gets through)
is `proxy.add_rule(Rule(suppress(), connection=i, times=None), first=True)`: every text and
binary frame of connection i dropped, both ways (WebSocket pings and close frames still pass).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, overload

import aiohttp
from aiohttp import WSMsgType, web
from yarl import URL

Direction: TypeAlias = Literal["client_to_server", "server_to_client"]
CLIENT_TO_SERVER: Direction = "client_to_server"
SERVER_TO_CLIENT: Direction = "server_to_client"
FrameKind: TypeAlias = Literal["text", "binary"]
# "open": a client connection and its upstream are up; "refused": the upstream refused the
# upgrade (connection -1, code = HTTP status); "close": a close frame; "drop": a side went
# away without a close frame, or the proxy cut the connection.
EventKind: TypeAlias = Literal["text", "binary", "open", "refused", "close", "drop"]
# A frame the proxy sends on its own: a mapping is sent as JSON text, str as text, bytes
# as binary.
Outgoing: TypeAlias = Mapping[str, Any] | str | bytes

_FRAME_KINDS: tuple[EventKind, ...] = ("text", "binary")
DEFAULT_FORWARD_HEADERS = ("Authorization", "Origin")
DEFAULT_WITHIN = 5.0  # seconds any wait of the proxy's allows by default
_NORMAL_CLOSURE = 1000


# --- frames and events -------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """A text or binary frame the proxy received, as rules and `replace` callables see it."""

    direction: Direction
    connection: int
    data: str | bytes
    json: Any = None  # the parsed JSON of a text frame; None for binary or non-JSON text

    @property
    def kind(self) -> FrameKind:
        return "binary" if isinstance(self.data, bytes) else "text"

    @property
    def type(self) -> str | None:
        value = self.json.get("type") if isinstance(self.json, dict) else None
        return value if isinstance(value, str) else None

    @property
    def seq(self) -> int | None:
        value = self.json.get("seq") if isinstance(self.json, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class ProxyEvent:
    """One entry of the event log.

    For text and binary frames, `action` is what the proxy did with a frame it received:
    "forward", "suppress", "delay", "duplicate", "inject" (forwarded, with extra frames),
    "replace" (not forwarded: a "replacement" event follows), "cut" or "close"; frames the
    proxy made up itself are logged as "injected" or "replacement". `delivered` counts how
    many copies reached the far side (0 when dropped, 1 + n for `duplicate(n)`).
    A frame event is logged once its action is done (a delayed frame: once sent).
    Close events carry `code` and the reason in `frame`; action "forward" when relayed,
    "close" when the proxy closed a side itself. Drop events have action "drop" (the side
    `direction` comes from went away), "cut" (a fault) or "stop" (the proxy stopped).
    """

    direction: Direction
    connection: int
    frame: str | int  # the text of a text frame, the length of a binary one, a close reason
    json: Any  # the parsed JSON of a text frame, or None
    action: str
    kind: EventKind = "text"
    delivered: int = 0
    code: int | None = None
    rule: Rule | None = None

    @property
    def type(self) -> str | None:
        value = self.json.get("type") if isinstance(self.json, dict) else None
        return value if isinstance(value, str) else None

    @property
    def seq(self) -> int | None:
        value = self.json.get("seq") if isinstance(self.json, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def brief(self) -> str:
        what = self.json if self.json is not None else self.frame
        extra = f" code={self.code}" if self.code is not None else ""
        return f"#{self.connection} {self.direction} {self.kind} {self.action}{extra}: {what!r}"


def _parse(data: str | bytes) -> Any:
    if isinstance(data, bytes):
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def _encode(frame: Outgoing) -> str | bytes:
    if isinstance(frame, str | bytes):
        return frame
    return json.dumps(frame, separators=(",", ":"))


def _frames(frames: Outgoing | Iterable[Outgoing]) -> tuple[str | bytes, ...]:
    if isinstance(frames, Mapping | str | bytes):
        return (_encode(frames),)
    return tuple(_encode(frame) for frame in frames)


# --- the event log -----------------------------------------------------------------------


class EventLog(Sequence[ProxyEvent]):
    """Everything the proxy saw, in order, with filters and async waits."""

    def __init__(self) -> None:
        self._events: list[ProxyEvent] = []
        self._waiters: list[tuple[Callable[[ProxyEvent], bool], asyncio.Future[ProxyEvent]]] = []

    @overload
    def __getitem__(self, index: int) -> ProxyEvent: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[ProxyEvent]: ...

    def __getitem__(self, index: int | slice) -> ProxyEvent | Sequence[ProxyEvent]:
        return self._events[index]

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[ProxyEvent]:
        return iter(list(self._events))

    def select(
        self,
        direction: Direction | None = None,
        *,
        kind: EventKind | Collection[EventKind] | None = None,
        type: str | Collection[str] | None = None,
        seq: int | None = None,
        connection: int | None = None,
        action: str | Collection[str] | None = None,
    ) -> list[ProxyEvent]:
        """The events that pass every filter given (None: any)."""
        test = event_filter(
            direction, kind=kind, type=type, seq=seq, connection=connection, action=action
        )
        return [event for event in self._events if test(event)]

    def frames(
        self,
        direction: Direction | None = None,
        *,
        type: str | Collection[str] | None = None,
        seq: int | None = None,
        connection: int | None = None,
        action: str | Collection[str] | None = None,
    ) -> list[ProxyEvent]:
        """Text and binary frame events (received, injected or replacement)."""
        return self.select(
            direction, kind=_FRAME_KINDS, type=type, seq=seq, connection=connection, action=action
        )

    def delivered(
        self,
        direction: Direction | None = None,
        *,
        type: str | Collection[str] | None = None,
        seq: int | None = None,
        connection: int | None = None,
    ) -> list[Any]:
        """What reached the far side, in order: parsed JSON (text, or length, if not JSON),
        once per copy delivered, so dropped frames are absent and duplicates repeat."""
        return [
            event.json if event.json is not None else event.frame
            for event in self.frames(direction, type=type, seq=seq, connection=connection)
            for _ in range(event.delivered)
        ]

    async def wait_for(
        self,
        predicate: Callable[[ProxyEvent], bool],
        *,
        within: float = DEFAULT_WITHIN,
        since: int = 0,
    ) -> ProxyEvent:
        """The first event from index `since` on that satisfies `predicate`, waiting for
        it to be logged if need be. Pass `since=len(proxy.events)` to ignore the past."""
        for event in self._events[since:]:
            if predicate(event):
                return event
        future: asyncio.Future[ProxyEvent] = asyncio.get_running_loop().create_future()
        waiter = (predicate, future)
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(within):
                return await future
        except TimeoutError:
            recent = "\n  ".join(event.brief() for event in self._events[-10:])
            message = f"no matching proxy event within {within} s; latest:\n  {recent}"
            raise TimeoutError(message) from None
        finally:
            self._waiters.remove(waiter)

    async def wait_for_frame(
        self,
        direction: Direction | None = None,
        *,
        type: str | Collection[str] | None = None,
        seq: int | None = None,
        connection: int | None = None,
        action: str | Collection[str] | None = None,
        within: float = DEFAULT_WITHIN,
        since: int = 0,
    ) -> ProxyEvent:
        """`wait_for` a text or binary frame event passing the filters given."""
        test = event_filter(
            direction, kind=_FRAME_KINDS, type=type, seq=seq, connection=connection, action=action
        )
        return await self.wait_for(test, within=within, since=since)

    def _record(self, event: ProxyEvent) -> None:
        self._events.append(event)
        for predicate, future in list(self._waiters):
            if future.done():
                continue
            try:
                matched = predicate(event)
            except Exception as exc:  # a broken predicate fails its waiter, not the relay
                future.set_exception(exc)
                continue
            if matched:
                future.set_result(event)


def _among(value: Any, wanted: Any) -> bool:
    if wanted is None:
        return True
    if isinstance(wanted, str):
        return bool(value == wanted)
    return value in wanted


def event_filter(
    direction: Direction | None = None,
    *,
    kind: EventKind | Collection[EventKind] | None = None,
    type: str | Collection[str] | None = None,
    seq: int | None = None,
    connection: int | None = None,
    action: str | Collection[str] | None = None,
) -> Callable[[ProxyEvent], bool]:
    """A predicate for `EventLog.wait_for`: every filter given must hold (None: any)."""

    def test(event: ProxyEvent) -> bool:
        return (
            (direction is None or event.direction == direction)
            and (connection is None or event.connection == connection)
            and (seq is None or event.seq == seq)
            and _among(event.kind, kind)
            and _among(event.action, action)
            and (type is None or (event.type is not None and _among(event.type, type)))
        )

    return test


# --- actions -----------------------------------------------------------------------------


class Action:
    """What a rule does to the frame it fired on. Build with the functions below."""

    name = "forward"

    async def apply(self, conn: ProxyConnection, frame: Frame, rule: Rule | None) -> None:
        await conn._deliver(frame, self.name, rule)


@dataclass(frozen=True)
class _Forward(Action):
    name = "forward"


@dataclass(frozen=True)
class _Suppress(Action):
    name = "suppress"

    async def apply(self, conn: ProxyConnection, frame: Frame, rule: Rule | None) -> None:
        conn._log_frame(frame, self.name, rule, delivered=0)


@dataclass(frozen=True)
class _Delay(Action):
    seconds: float
    name = "delay"

    async def apply(self, conn: ProxyConnection, frame: Frame, rule: Rule | None) -> None:
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:  # cut while held: logged as never delivered
            conn._log_frame(frame, self.name, rule, delivered=0)
            raise
        await conn._deliver(frame, self.name, rule)


@dataclass(frozen=True)
class _Duplicate(Action):
    n: int
    name = "duplicate"

    async def apply(self, conn: ProxyConnection, frame: Frame, rule: Rule | None) -> None:
        await conn._deliver(frame, self.name, rule, copies=1 + self.n)


@dataclass(frozen=True)
class _Inject(Action):
    frames: tuple[str | bytes, ...]
    before: bool
    direction: Direction | None
    name = "inject"

    async def apply(self, conn: ProxyConnection, frame: Frame, rule: Rule | None) -> None:
        direction = self.direction or frame.direction
        if not self.before:
            await conn._deliver(frame, self.name, rule)
        for data in self.frames:
            await conn._send_own(direction, data, "injected", rule)
        if self.before:
            await conn._deliver(frame, self.name, rule)


@dataclass(frozen=True)
class _Replace(Action):
    by: Outgoing | Callable[[Frame], Outgoing | None]
    name = "replace"

    async def apply(self, conn: ProxyConnection, frame: Frame, rule: Rule | None) -> None:
        replacement = self.by(frame) if callable(self.by) else self.by
        conn._log_frame(frame, self.name, rule, delivered=0)
        if replacement is not None:
            await conn._send_own(frame.direction, _encode(replacement), "replacement", rule)


@dataclass(frozen=True)
class _Cut(Action):
    forward: bool
    name = "cut"

    async def apply(self, conn: ProxyConnection, frame: Frame, rule: Rule | None) -> None:
        if self.forward:
            await conn._deliver(frame, self.name, rule)
            await conn._flush(frame.direction)
        else:
            conn._log_frame(frame, self.name, rule, delivered=0)
        conn._abort("cut", frame.direction)


@dataclass(frozen=True)
class _Close(Action):
    code: int
    reason: str
    forward: bool
    upstream_code: int | None
    name = "close"

    async def apply(self, conn: ProxyConnection, frame: Frame, rule: Rule | None) -> None:
        if self.forward:
            await conn._deliver(frame, self.name, rule)
        else:
            conn._log_frame(frame, self.name, rule, delivered=0)
        await conn.close(self.code, self.reason, upstream_code=self.upstream_code)


def forward() -> Action:
    """Relay the frame unchanged (shields it from the rules after this one)."""
    return _Forward()


def suppress() -> Action:
    """Drop the frame."""
    return _Suppress()


def delay(seconds: float) -> Action:
    """Hold the frame for `seconds`, then relay it; frames behind it on its direction wait."""
    return _Delay(seconds)


def duplicate(n: int = 1) -> Action:
    """Relay the frame, then send it `n` extra times."""
    return _Duplicate(n)


def inject(
    frames: Outgoing | Iterable[Outgoing],
    *,
    before: bool = False,
    direction: Direction | None = None,
) -> Action:
    """Relay the frame and send `frames` (one, or a list) after it, or before it.

    They go the frame's way unless `direction` says otherwise. A mapping is sent as JSON;
    to inject a JSON array, pass its text."""
    return _Inject(_frames(frames), before, direction)


def replace(by: Outgoing | Callable[[Frame], Outgoing | None]) -> Action:
    """Send `by` instead of the frame; a callable gets the frame and may return None
    (send nothing)."""
    return _Replace(by)


def cut(*, forward: bool = False) -> Action:
    """Abort both TCP connections at once, with no close frame, after relaying the frame
    (`forward=True`) or instead of it."""
    return _Cut(forward)


def close(
    code: int = _NORMAL_CLOSURE,
    reason: str = "",
    *,
    forward: bool = False,
    upstream_code: int | None = _NORMAL_CLOSURE,
) -> Action:
    """Close the client side with a close frame (`code`, `reason`), after relaying the
    frame or instead of it. The upstream gets a close frame with `upstream_code`, or is
    aborted without one when that is None."""
    return _Close(code, reason, forward, upstream_code)


# --- rules -------------------------------------------------------------------------------


@dataclass(eq=False)
class Rule:
    """A fault: which frames it matches, and the action it takes when it fires.

    Every filter given must hold: `direction`; the JSON `type` (one, or a collection);
    `seq` (exact, or a predicate on it; frames without an integer seq never match);
    `kind` ("text" or "binary"; a rule with `type` or `seq` only ever matches JSON text);
    `connection` (its index); `where` (any predicate on the `Frame`).
    Counting: the rule fires on the `nth` matching frame and the ones after it, `times`
    times in all (None: forever). The defaults fire once, on the first match.
    `seen` and `fired` count matching frames and firings; matches count across connections.
    """

    action: Action
    direction: Direction | None = None
    type: str | Collection[str] | None = None
    seq: int | Callable[[int], bool] | None = None
    kind: FrameKind | None = None
    connection: int | None = None
    where: Callable[[Frame], bool] | None = None
    nth: int = 1
    times: int | None = 1
    seen: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.nth < 1 or (self.times is not None and self.times < 1):
            raise ValueError("nth and times count from 1")
        if self.direction not in (None, CLIENT_TO_SERVER, SERVER_TO_CLIENT):
            raise ValueError(f"unknown direction {self.direction!r}")

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.fired >= self.times

    def matches(self, frame: Frame) -> bool:
        """Whether the frame passes the rule's filters (counting aside)."""
        return (
            (self.direction is None or frame.direction == self.direction)
            and (self.kind is None or frame.kind == self.kind)
            and (self.connection is None or frame.connection == self.connection)
            and (self.type is None or (frame.type is not None and _among(frame.type, self.type)))
            and self._seq_matches(frame.seq)
            and (self.where is None or self.where(frame))
        )

    def _seq_matches(self, seq: int | None) -> bool:
        if self.seq is None:
            return True
        if seq is None:
            return False
        return self.seq(seq) if callable(self.seq) else seq == self.seq

    def _offer(self, frame: Frame) -> bool:
        """Count a matching frame; True when the rule fires on it."""
        if self.exhausted or not self.matches(frame):
            return False
        self.seen += 1
        if self.seen < self.nth:
            return False
        self.fired += 1
        return True


# --- connections -------------------------------------------------------------------------


def _sendable(code: int) -> int:
    """A close code a peer may put on the wire (1005, 1006, 1015 and no code are not)."""
    valid = 1000 <= code <= 1014 and code not in (1004, 1005, 1006)
    return code if valid or 3000 <= code <= 4999 else _NORMAL_CLOSURE


def _upstream_transport(ws: aiohttp.ClientWebSocketResponse) -> asyncio.BaseTransport | None:
    # aiohttp has no public handle on a client WebSocket's transport; this is the path its
    # own ClientWebSocketResponse.get_extra_info takes.
    connection = ws._response.connection
    return None if connection is None else connection.transport


class ProxyConnection:
    """One client connection and its own upstream connection."""

    def __init__(
        self,
        proxy: FaultProxy,
        index: int,
        request: web.Request,
        client_ws: web.WebSocketResponse,
        upstream_ws: aiohttp.ClientWebSocketResponse,
    ) -> None:
        self.proxy = proxy
        self.index = index
        self.path = request.raw_path  # path and query string, as the client sent them
        self.headers = request.headers
        self.client_ws = client_ws
        self.upstream_ws = upstream_ws
        self._client_transport = request.transport
        self._upstream_transport = _upstream_transport(upstream_ws)
        self._ending = False  # a close or cut is under way: the peers going away is expected
        self._aborted = False
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = asyncio.Event()

    @property
    def open(self) -> bool:
        return not self._closed.is_set()

    async def send(self, direction: Direction, frame: Outgoing) -> bool:
        """Send a frame of the proxy's own on one direction now; True if it went out."""
        return await self._send_own(direction, _encode(frame), "injected", None)

    async def cut(self) -> None:
        """Abort both TCP connections without close frames; return once both are down."""
        self._abort("cut")
        await self.wait_closed()

    async def close(
        self,
        code: int = _NORMAL_CLOSURE,
        reason: str = "",
        *,
        upstream_code: int | None = _NORMAL_CLOSURE,
    ) -> None:
        """Close the client side with (code, reason); close the upstream with
        `upstream_code`, or abort it when that is None. No-op once closing or closed."""
        if self._ending:
            return
        self._ending = True
        self._log_close(SERVER_TO_CLIENT, code, reason, "close")
        await self.client_ws.close(code=code, message=reason.encode())
        if upstream_code is None:
            self._abort_transport(self._upstream_transport)
            return
        self._log_close(CLIENT_TO_SERVER, upstream_code, "", "close")
        await self.upstream_ws.close(code=upstream_code)

    async def wait_closed(self, within: float = DEFAULT_WITHIN) -> None:
        async with asyncio.timeout(within):
            await self._closed.wait()

    # The relay: one task per direction.

    async def _run(self) -> None:
        self._tasks = [
            asyncio.create_task(self._pump(CLIENT_TO_SERVER)),
            asyncio.create_task(self._pump(SERVER_TO_CLIENT)),
        ]
        try:
            results = await asyncio.gather(*self._tasks, return_exceptions=True)
            errors = [r for r in results if isinstance(r, Exception)]
            self.proxy.errors.extend(errors)
        finally:
            if not (self.client_ws.closed and self.upstream_ws.closed):
                self._abort_transport(self._client_transport)
                self._abort_transport(self._upstream_transport)
            self._closed.set()

    def _source(
        self, direction: Direction
    ) -> web.WebSocketResponse | aiohttp.ClientWebSocketResponse:
        return self.client_ws if direction == CLIENT_TO_SERVER else self.upstream_ws

    def _destination(
        self, direction: Direction
    ) -> web.WebSocketResponse | aiohttp.ClientWebSocketResponse:
        return self.upstream_ws if direction == CLIENT_TO_SERVER else self.client_ws

    async def _pump(self, direction: Direction) -> None:
        source, destination = self._source(direction), self._destination(direction)
        try:
            while True:
                msg = await source.receive()
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await self._on_frame(Frame(direction, self.index, msg.data, _parse(msg.data)))
                elif msg.type is WSMsgType.PING:
                    await destination.ping(msg.data)
                elif msg.type is WSMsgType.PONG:
                    await destination.pong(msg.data)
                elif msg.type is WSMsgType.CLOSE:
                    await self._relay_close(direction, msg.data, msg.extra or "")
                    return
                else:  # CLOSING (the other task is closing this side), CLOSED, ERROR
                    break
        except (ConnectionError, aiohttp.ClientError):
            pass
        if not self._ending:
            self._abort("drop", direction)

    async def _on_frame(self, frame: Frame) -> None:
        rule = next((rule for rule in list(self.proxy.rules) if rule._offer(frame)), None)
        action = rule.action if rule is not None else _FORWARD
        await action.apply(self, frame, rule)

    async def _relay_close(self, direction: Direction, code: int, reason: str) -> None:
        self._ending = True
        self._log_close(direction, code, reason, "forward")
        code, message = _sendable(code), reason.encode()
        await self._destination(direction).close(code=code, message=message)
        await self._source(direction).close(code=code, message=message)  # answer the closer

    # Sending and logging, for the actions.

    async def _send(self, direction: Direction, data: str | bytes) -> bool:
        ws = self._destination(direction)
        if ws.closed:
            return False
        try:
            if isinstance(data, str):
                await ws.send_str(data)
            else:
                await ws.send_bytes(data)
        except (ConnectionError, aiohttp.ClientError):
            return False
        return True

    async def _deliver(
        self, frame: Frame, action: str, rule: Rule | None, *, copies: int = 1
    ) -> None:
        delivered = 0
        for _ in range(copies):
            delivered += await self._send(frame.direction, frame.data)
        self._log_frame(frame, action, rule, delivered=delivered)

    async def _send_own(
        self, direction: Direction, data: str | bytes, action: str, rule: Rule | None
    ) -> bool:
        sent = await self._send(direction, data)
        self._log_frame(Frame(direction, self.index, data, _parse(data)), action, rule, int(sent))
        return sent

    async def _flush(self, direction: Direction) -> None:
        """Let what was written toward one side leave the process before an abort (asyncio
        has no event for an emptied write buffer: poll it, for at most a second)."""
        transport = (
            self._upstream_transport if direction == CLIENT_TO_SERVER else self._client_transport
        )
        if not isinstance(transport, asyncio.WriteTransport):
            return
        for _ in range(200):
            if transport.is_closing() or not transport.get_write_buffer_size():
                return
            await asyncio.sleep(0.005)

    def _abort(self, action: str, direction: Direction = SERVER_TO_CLIENT) -> None:
        """Drop both sides at once, no close frames, and log it. A drop noticed while a
        close or cut is under way is expected, and not logged; a cut always goes through."""
        if self._aborted or not self.open or (self._ending and action != "cut"):
            return
        self._aborted = self._ending = True
        self.proxy.events._record(ProxyEvent(direction, self.index, "", None, action, kind="drop"))
        self._abort_transport(self._client_transport)
        self._abort_transport(self._upstream_transport)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()  # a task held in a delay must not wait it out

    @staticmethod
    def _abort_transport(transport: asyncio.BaseTransport | None) -> None:
        if isinstance(transport, asyncio.WriteTransport) and not transport.is_closing():
            transport.abort()

    def _log_frame(self, frame: Frame, action: str, rule: Rule | None, delivered: int) -> None:
        text_or_len = frame.data if isinstance(frame.data, str) else len(frame.data)
        event = ProxyEvent(
            frame.direction,
            self.index,
            text_or_len,
            frame.json,
            action,
            kind=frame.kind,
            delivered=delivered,
            rule=rule,
        )
        self.proxy.events._record(event)

    def _log_close(self, direction: Direction, code: int, reason: str, action: str) -> None:
        event = ProxyEvent(direction, self.index, reason, None, action, kind="close", code=code)
        self.proxy.events._record(event)


_FORWARD = _Forward()


# --- the proxy ---------------------------------------------------------------------------


class FaultProxy:
    """The proxy: `await FaultProxy(upstream).start()`, or `async with FaultProxy(...)`.

    `upstream` is the real server's base URL (http:// or ws://); a client connecting to
    `proxy.url("/v1/session?x=1")` gets an upstream connection to the same path and query.
    Connections are numbered 0, 1, ... in the order they open (refused upgrades get none).
    `stop()` raises an ExceptionGroup if a relay task hit an unexpected error.
    """

    def __init__(
        self,
        upstream: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        forward_headers: Collection[str] = DEFAULT_FORWARD_HEADERS,
        close_timeout: float = 2.0,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.host = host
        self.port = port
        self.forward_headers = tuple(forward_headers)
        self.close_timeout = close_timeout
        self.rules: list[Rule] = []
        self.events = EventLog()
        self.connections: list[ProxyConnection] = []
        self.errors: list[Exception] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def url(self, path: str = "/") -> str:
        """The ws:// URL a client dials to reach `path` (query string included) upstream."""
        return f"ws://{self.host}:{self.port}{path}"

    async def start(self) -> FaultProxy:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.close_timeout)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        # No cap on upstream connections: aiohttp's default of 100 would hold the 101st
        # upgrade of a long chaos run until the timeout (seen with 200 cuts).
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self

    async def stop(self) -> None:
        for conn in self.connections:
            conn._abort("stop")
        for conn in self.connections:
            with contextlib.suppress(TimeoutError):
                await conn.wait_closed()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        if self.errors:
            raise ExceptionGroup("fault proxy relay errors", list(self.errors))

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # Rules.

    def add_rule(self, rule: Rule, *, first: bool = False) -> Rule:
        """Add a rule, last (or first) in order; effective from the next frame on."""
        self.rules.insert(0 if first else len(self.rules), rule)
        return rule

    def remove_rule(self, rule: Rule) -> None:
        self.rules.remove(rule)

    def clear_rules(self) -> None:
        self.rules.clear()

    # Connections.

    @property
    def active(self) -> list[ProxyConnection]:
        return [conn for conn in self.connections if conn.open]

    async def wait_connection(self, index: int, within: float = DEFAULT_WITHIN) -> ProxyConnection:
        """The connection numbered `index`, once it has opened."""
        await self.events.wait_for(event_filter(kind="open", connection=index), within=within)
        return self.connections[index]

    async def cut(self, index: int) -> None:
        await self.connections[index].cut()

    async def cut_all(self) -> None:
        """Cut every open connection; new ones are accepted as usual afterwards."""
        conns = self.active
        for conn in conns:
            conn._abort("cut")
        for conn in conns:
            await conn.wait_closed()

    # The upgrade.

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if not web.WebSocketResponse().can_prepare(request).ok:
            return web.Response(status=400, text="fault proxy: WebSocket upgrades only")
        try:
            upstream_ws = await self._connect_upstream(request)
        except aiohttp.WSServerHandshakeError as exc:
            self._log_refused(request, exc.status)
            return web.Response(status=exc.status, text=exc.message)
        except (aiohttp.ClientError, OSError) as exc:
            self._log_refused(request, 502)
            return web.Response(status=502, text=f"fault proxy: upstream unreachable: {exc}")
        chosen = (upstream_ws.protocol,) if upstream_ws.protocol else ()
        client_ws = web.WebSocketResponse(
            protocols=chosen,
            autoping=False,
            autoclose=False,
            compress=False,
            max_msg_size=0,
            timeout=self.close_timeout,
        )
        try:
            await client_ws.prepare(request)
        except BaseException:
            await upstream_ws.close()
            raise
        conn = ProxyConnection(self, len(self.connections), request, client_ws, upstream_ws)
        self.connections.append(conn)
        self.events._record(
            ProxyEvent(CLIENT_TO_SERVER, conn.index, conn.path, None, "open", kind="open")
        )
        await conn._run()
        return client_ws

    async def _connect_upstream(self, request: web.Request) -> aiohttp.ClientWebSocketResponse:
        assert self._session is not None, "start() first"
        headers = {
            name: request.headers[name] for name in self.forward_headers if name in request.headers
        }
        requested = ",".join(request.headers.getall("Sec-WebSocket-Protocol", []))
        protocols = tuple(p.strip() for p in requested.split(",") if p.strip())
        return await self._session.ws_connect(
            URL(self.upstream + request.raw_path, encoded=True),
            protocols=protocols,
            headers=headers,
            autoping=False,
            autoclose=False,
            max_msg_size=0,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=self.close_timeout),
        )

    def _log_refused(self, request: web.Request, status: int) -> None:
        event = ProxyEvent(
            CLIENT_TO_SERVER, -1, request.raw_path, None, "refused", kind="refused", code=status
        )
        self.events._record(event)
