"""`RpcClient`: the Python client of `GET /v1/rpc` (spec/rpc-protocol.md, websocket-rpc.md).

One `RpcClient` is one user's connection to all of their sessions: a typed method
for each of the 17 calls, the ordered update stream and the live chunks. It
reconnects by itself with backoff and jitter, sending the offset and epoch of the
last update it received, so the server replays what the client missed.

    import asyncio
    from portico.client import Reset, RpcClient, TurnEntity

    async def main() -> None:
        async with RpcClient("ws://127.0.0.1:8080/v1/rpc", token="key-1") as client:
            sent = await client.message_send("hello")  # creates the session too
            session_id = sent.result.session_id
            async for item in client.updates():
                if isinstance(item, Reset):
                    continue  # history was lost: reload state with the query methods
                turns = item.entities(TurnEntity)
                if any(t.session_id == session_id and t.status == "completed" for t in turns):
                    break
            page = await client.message_list(session_id)
            print(page.items[-1].content_data)  # "Hello world"
            # Persist client.offset and client.epoch to resume the stream next time.

    asyncio.run(main())

Results. Queries return the entity (`SessionEntity`, `MessageEntity`, `TurnEntity`,
`RtcEntity`) or a `Page` of them; actions return an `ActionResult` holding the
`result` and the `updates` the action produced. Those same updates also arrive,
in order, on the stream: apply updates from `updates()` only and treat
`ActionResult.updates` as information about this call, or the state is applied
twice.

The update stream. `updates()` yields every pushed update in offset order, each
once across reconnects (repeats are dropped by offset, `gap`s advance the offset
silently), and a `Reset` where continuity was lost: the server could not replay
from the client's position (another epoch, or an offset it no longer retains),
or the application fell more than `max_buffered_updates` behind. After a `Reset`
reload state with the query methods; updates after it may predate that reload,
so compare `updated_at` when it matters. `client.offset` and `client.epoch` are
the position of the last item taken from `updates()` (after a first connect
without one: the server's head): persist them and pass them to the next
`RpcClient` to resume. `updates()` has one reader at a time.

Live chunks (`live()`) are lossy by design: at most `max_buffered_live` wait, the
oldest are dropped first, and the final content arrives as the message's update.

Retries. Calls made while the client reconnects wait for the connection. A
request whose connection drops before its reply is sent again on the next
connection only when repeating it cannot take effect twice; otherwise the call
raises `RpcConnectionLostError` (its outcome is unknown):

- queries: read-only, always repeated;
- `message_send`: the server deduplicates `client_id`. A `client_id_conflict`
  answering the repeat means the first attempt landed: its ids (from the
  error's `details`) are returned with `deduplicated=True` and no updates
  (those reach the stream through the replay). A conflict on a first attempt
  is raised as `RpcConflictError`;
- `session_close`, `session_open`: no-ops on a session already in that state;
- `session_update`: sets absolute values (title, deleted_at); a repeat sets them
  again, as any last-writer-wins write would;
- `rtc_submit_result`: a terminal Rtc answers with its stored outcome;
- `rtc_update_status`: `executing` repeated by its owner, and `rejected` on a
  rejected Rtc, return it unchanged;
- never repeated: `session_fork` (no dedup, a repeat forks twice),
  `session_compact` (deduplicated only while queued) and `turn_stop` (a repeat
  could stop a turn started after the first stop).

Bounds. At most `max_in_flight` calls are outstanding (more wait for a slot, within
their `request_timeout`); unread updates are bounded by `max_buffered_updates`
(past it: a `Reset`), unread live chunks by `max_buffered_live` (the oldest are
dropped), and server frames by `max_frame_bytes`.

Errors. An error reply raises `RpcCallError` (`code`, `message`, `details`), as
`RpcNotFoundError` for `*.not_found` and `RpcConflictError` for
`client_id_conflict`. Terminal conditions stop the client and are raised from
pending calls, from `updates()` and `live()`: `RpcAuthenticationError`
(`unauthenticated`, close 4401, never retried), `RpcConnectError` (the first
connection failed), `RpcConnectionLostError` (no connection for
`ReconnectPolicy.give_up_after`), `RpcProtocolError` (an unreadable frame). After
`close()` iteration simply ends and calls raise `RpcClosedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Generic, Literal, TypeAlias, TypeVar

import aiohttp
import msgspec
from aiohttp import WSMsgType

from portico.client.credentials import CredentialProvider, ask, keep_fresh
from portico.client.session import ReconnectPolicy
from portico.client.supervision import Retries, Supervision, open_socket, serve_socket
from portico.domain.model import ContentPart

log = logging.getLogger("portico.client.rpc")

T = TypeVar("T")
E = TypeVar("E")
MiB: Final = 1024 * 1024
CLOSE_NORMAL: Final = 1000
CLOSE_UNAUTHENTICATED: Final = 4401
# Methods whose repeat cannot take effect twice (see the module docstring).
QUERIES: Final = frozenset(
    {
        "v1.session.list",
        "v1.session.get",
        "v1.message.list",
        "v1.message.get",
        "v1.turn.list",
        "v1.turn.get",
        "v1.rtc.list",
        "v1.rtc.get",
    }
)
RETRY_SAFE: Final = QUERIES | {
    "v1.message.send",
    "v1.session.close",
    "v1.session.open",
    "v1.session.update",
    "v1.rtc.update_status",
    "v1.rtc.submit_result",
}


# -- errors ---------------------------------------------------------------------------------


class RpcClientError(Exception):
    """Base of every error `RpcClient` raises."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class RpcCallError(RpcClientError):
    """The server answered a call with an error (rpc-protocol.md section 6)."""

    def __init__(self, method: str, code: str, message: str, details: Any = None) -> None:
        super().__init__(f"{method}: {code}: {message}")
        self.method = method
        self.code = code
        self.message = message
        self.details = details


class RpcNotFoundError(RpcCallError):
    """`session.not_found`, `message.not_found`, ... (also another user's entity)."""


class RpcConflictError(RpcCallError):
    """`client_id_conflict`: `details` holds the ids the first request created."""


class RpcConnectionLostError(RpcClientError):
    """The connection dropped before the reply of a call that is not safe to repeat
    (its outcome is unknown), or no connection could be made for `give_up_after`."""


class RpcAuthenticationError(RpcClientError):
    """The server refused the token (`unauthenticated`, close 4401): terminal."""

    def __init__(self, message: str, *, close_code: int | None = None) -> None:
        super().__init__(message)
        self.code = "unauthenticated"
        self.close_code = close_code


class RpcConnectError(RpcClientError):
    """The first connection failed; nothing was opened."""


class RpcProtocolError(RpcClientError):
    """The server sent something this client cannot read."""


class RpcTimeoutError(RpcClientError, TimeoutError):
    """No reply within `request_timeout` (if the request was sent, its outcome is unknown)."""


class RpcClosedError(RpcClientError):
    """The client is not connected yet, or was closed."""


# -- entities (rpc-protocol.md section 4): defaults keep older or newer servers readable ------


class SessionEntity(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    client_session_id: str = ""
    title: str = ""
    status: str = ""  # idle, active, closed
    created_at: str | None = None
    updated_at: str | None = None
    closed_at: str | None = None
    deleted_at: str | None = None
    parent_session_id: str = ""
    root_session_id: str = ""
    forked_from_message_id: str = ""
    agent: str = ""


class MessageEntity(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    session_id: str = ""
    turn_id: str = ""
    client_id: str = ""
    role: str = ""  # user, assistant, tool, system
    content_type: str = ""  # markdown, text, thinking, summary, toolcall_input, ...
    content_data: Any = None  # a string, or JSON for summary and toolcall_* types
    status: str = ""  # pending, streaming, completed, failed
    global_offset: int = 0
    turn_offset: int = 0
    parent_message_id: str = ""
    created_at: str | None = None
    updated_at: str | None = None
    parts: tuple[ContentPart, ...] = ()  # Portico addition: media parts
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    # Portico addition, `message_list` of a reply being streamed: `content_data` is its
    # text so far and holds live chunks 0 ... streamed_chunks - 1.
    streamed_chunks: int = 0


class TurnFailure(msgspec.Struct, frozen=True):
    code: str
    message: str = ""


class TurnEntity(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    session_id: str = ""
    status: str = ""  # pending, running, completed, failed, cancelled, interrupted, merged
    merged_into: str = ""
    error: TurnFailure | None = None
    created_at: str | None = None
    started_at: str | None = None
    ended_at: str | None = None


class RtcEntity(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    session_id: str = ""
    turn_id: str = ""
    message_id: str = ""
    name: str = ""
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    status: str = ""  # pending, sent, executing, completed, failed, timeout, rejected
    result: Any = None
    error: str = ""
    client_id: str = ""
    created_at: str | None = None
    updated_at: str | None = None


class OtherEntity(msgspec.Struct, frozen=True):
    """An entity of a kind this client does not know, as the server sent it."""

    entity: str
    data: Any


Entity: TypeAlias = SessionEntity | MessageEntity | TurnEntity | RtcEntity | OtherEntity


class UpdateItem(msgspec.Struct, frozen=True):
    entity: str  # session, message, turn, rtc
    action: str  # created, updated
    entity_id: str


@dataclass(frozen=True, slots=True)
class Update:
    """One persisted update: `items[i]` describes `data_list[i]`, the full entity."""

    id: str
    offset: int
    items: tuple[UpdateItem, ...]
    data_list: tuple[Entity, ...]

    def changes(self) -> Iterator[tuple[UpdateItem, Entity]]:
        return zip(self.items, self.data_list, strict=True)

    def entities(self, kind: type[E]) -> list[E]:
        """The entities of one type, e.g. `update.entities(MessageEntity)`."""
        return [entity for entity in self.data_list if isinstance(entity, kind)]


@dataclass(frozen=True, slots=True)
class Reset:
    """Continuity was lost before this point: reload state with the query methods.

    `reason`: "epoch_changed" (the server's history was reset), "not_recovered"
    (the offset is older than the retained history, or unknown to the server) or
    "overflow" (the application fell `max_buffered_updates` behind). `epoch` and
    `offset` are the position the stream continues from.
    """

    reason: Literal["epoch_changed", "not_recovered", "overflow"]
    epoch: str
    offset: int


class LiveChunk(msgspec.Struct, frozen=True):
    """A streaming chunk of an assistant message (lossy; the final text comes as an update)."""

    session_id: str
    turn_id: str
    message_id: str
    index: int
    delta: str


class Page(msgspec.Struct, Generic[T], frozen=True):
    """One page of a list; pass `next_cursor` back as `cursor` for the next one."""

    items: tuple[T, ...] = ()
    next_cursor: str = ""  # empty: this was the last page

    @property
    def has_more(self) -> bool:
        return bool(self.next_cursor)


@dataclass(frozen=True, slots=True)
class ActionResult(Generic[T]):
    """An action's result and the updates it produced (also pushed to `updates()`).

    `deduplicated`: the call was repeated after a dropped connection and the server
    reported the first attempt as done; `result` describes that attempt and
    `updates` is empty (its updates reach the stream through the replay).
    """

    result: T
    updates: tuple[Update, ...] = ()
    deduplicated: bool = False


class SendResult(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    message_id: str
    turn_id: str = ""  # always "": the turn is created asynchronously


class ForkResult(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    turn_id: str = ""
    message_ids: tuple[str, ...] = ()


class CompactResult(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    queued: bool = False  # False: a compaction of the session was already queued


class StopResult(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str


# -- wire decoding --------------------------------------------------------------------------


class _ErrorBody(msgspec.Struct, frozen=True):
    code: str
    message: str = ""
    details: Any = None


class _WireUpdate(msgspec.Struct, frozen=True):
    id: str
    items: tuple[UpdateItem, ...]
    data_list: tuple[msgspec.Raw, ...]  # decoded by the kind its item names
    offset: int


class _ServerFrame(msgspec.Struct, frozen=True):
    """Any server frame: pushes have `type`, replies have `id`."""

    type: str | None = None
    id: str | None = None
    result: msgspec.Raw = msgspec.Raw()  # decoded by the caller, which knows its type
    updates: tuple[_WireUpdate, ...] | None = None
    error: _ErrorBody | None = None
    update: _WireUpdate | None = None
    offset: int | None = None
    live: LiveChunk | None = None
    user_id: str = ""
    epoch: str = ""
    recovered: bool = False


@dataclass(frozen=True, slots=True)
class _Gap:
    """An offset with no update: it only moves `client.offset` (never yielded)."""

    offset: int


_StreamItem: TypeAlias = Update | Reset | _Gap
_frame_decoder = msgspec.json.Decoder(_ServerFrame)
_entity_decoders: dict[str, msgspec.json.Decoder[Any]] = {
    "session": msgspec.json.Decoder(SessionEntity),
    "message": msgspec.json.Decoder(MessageEntity),
    "turn": msgspec.json.Decoder(TurnEntity),
    "rtc": msgspec.json.Decoder(RtcEntity),
}
_result_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}
_encode = msgspec.json.Encoder().encode


def _decode_update(wire: _WireUpdate) -> Update:
    if len(wire.items) != len(wire.data_list):
        raise RpcProtocolError(f"update {wire.offset}: items and data_list differ in length")
    pairs = zip(wire.items, wire.data_list, strict=True)
    entities = tuple(_decode_entity(item.entity, raw) for item, raw in pairs)
    return Update(id=wire.id, offset=wire.offset, items=wire.items, data_list=entities)


def _decode_entity(kind: str, raw: msgspec.Raw) -> Entity:
    decoder = _entity_decoders.get(kind)
    try:
        if decoder is None:
            return OtherEntity(kind, msgspec.json.decode(raw))
        entity: Entity = decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise RpcProtocolError(f"unreadable {kind} entity: {exc}") from None
    return entity


def _decode_result(raw: msgspec.Raw, kind: type[T], method: str) -> T:
    decoder = _result_decoders.get(kind)
    if decoder is None:
        decoder = _result_decoders[kind] = msgspec.json.Decoder(kind)
    try:
        result: T = decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise RpcProtocolError(f"{method}: unreadable result: {exc}") from None
    return result


def _call_error(method: str, body: _ErrorBody) -> RpcCallError:
    if body.code.endswith(".not_found"):
        return RpcNotFoundError(method, body.code, body.message, body.details)
    if body.code == "client_id_conflict":
        return RpcConflictError(method, body.code, body.message, body.details)
    return RpcCallError(method, body.code, body.message, body.details)


def _rfc3339(value: str | datetime | None) -> str | None:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    return value


# -- buffers ------------------------------------------------------------------------------------


class _Buffer(Generic[T]):
    """A FIFO with one reader. Past `limit`, `put` refuses, or drops the oldest item."""

    def __init__(self, limit: int, *, drop_oldest: bool = False) -> None:
        self._items: deque[T] = deque(maxlen=limit if drop_oldest else None)
        self._limit = limit
        self._ready = asyncio.Event()
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> bool:
        if self._items.maxlen is None and len(self._items) >= self._limit:
            return False
        self._items.append(item)
        self._ready.set()
        return True

    def clear(self) -> None:
        self._items.clear()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    async def get(self) -> T | None:
        """The next item; None once closed and empty (what was buffered is still read)."""
        while not self._items:
            if self._closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


# -- one connection -------------------------------------------------------------------------


@dataclass
class _Reply:
    frame: _ServerFrame
    repeated: bool  # an earlier attempt may have reached the server


class _Link:
    """One WebSocket: requests sent on it wait here for their replies."""

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        offset: int | None,
        epoch: str | None,
        on_drop: Callable[[], None],
    ) -> None:
        self.ws = ws
        self._on_drop = on_drop
        self.sent_offset = offset  # the position sent in `connect`
        self.sent_epoch = epoch
        self.ready = False  # `connected` arrived
        self.dropped = False
        self.connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.close_code: int | None = None
        self.error: _ErrorBody | None = None  # a frame-level error (the refusal of connect)
        # None as a result: the link dropped before the reply.
        self._waiting: dict[str, asyncio.Future[_ServerFrame | None]] = {}

    async def request(self, call_id: str, data: bytes) -> _ServerFrame | None:
        """The reply, or None when the link dropped first (the request may have arrived)."""
        future: asyncio.Future[_ServerFrame | None] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        try:
            await self.ws.send_frame(data, WSMsgType.TEXT)
            return await future
        except (ConnectionError, aiohttp.ClientError):
            # The socket is gone although the read loop may not have seen it yet: mark
            # the link dropped at once, or retries would pick it again without waiting.
            self.abort()
            self.drop()
            return None
        finally:
            self._waiting.pop(call_id, None)

    async def refresh(self, token: str) -> None:
        """A fresh token for this connection (`credential`); no reply comes."""
        with contextlib.suppress(ConnectionError, aiohttp.ClientError):
            await self.ws.send_frame(
                _encode({"type": "credential", "credential": token}), WSMsgType.TEXT
            )

    def resolve(self, frame: _ServerFrame) -> None:
        future = self._waiting.get(frame.id or "")
        if future is not None and not future.done():
            future.set_result(frame)
        elif future is None:
            log.debug("reply to an unknown request id=%s", frame.id)

    def drop(self) -> None:
        if not self.dropped:
            self.dropped = True
            self._on_drop()
        for future in self._waiting.values():
            if not future.done():
                future.set_result(None)

    def abort(self) -> None:
        """Drop the socket without a close frame, as a network failure would."""
        # aiohttp has no public abort for a client WebSocket; this is the transport
        # its own get_extra_info() reads.
        connection = self.ws._response.connection
        transport = None if connection is None else connection.transport
        if transport is not None:
            transport.abort()


@dataclass
class _Outcome:
    """How one connection ended."""

    opened: bool = False
    close_code: int | None = None
    error: _ErrorBody | None = None
    failure: BaseException | None = None


class _Finished(Exception):
    """The application closed the client."""


# -- the client -----------------------------------------------------------------------------


class RpcClient:
    """A `/v1/rpc` connection with typed calls and a resumable update stream.

    See the module docstring. Durations are in seconds. `offset` and `epoch` are a
    position persisted from an earlier client (`client.offset`, `client.epoch`);
    without them the stream starts at the server's head. `token_provider`, when
    given, is asked for the token of every connection and, for a JWT, again before
    its `exp` (sent as a `credential` frame, so the connection stays up); a 4401
    after a connection worked (the token expired anyway) reconnects once with a
    fresh token and the stream recovers from its offset. Without it `token` is sent
    and a 4401 is terminal.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        token_provider: CredentialProvider | None = None,
        offset: int | None = None,
        epoch: str | None = None,
        reconnect: ReconnectPolicy | None = None,
        request_timeout: float = 30.0,  # whole call, reconnect waits included
        connect_timeout: float = 10.0,  # the upgrade plus connect/connected
        close_timeout: float = 5.0,
        heartbeat: float | None = 15.0,  # ping interval; a missing pong drops the link
        max_in_flight: int = 64,  # concurrent calls (the server's own limit is 64)
        max_buffered_updates: int = 10_000,  # unread updates before a Reset("overflow")
        max_buffered_live: int = 1_000,  # unread live chunks; the oldest are dropped
        max_frame_bytes: int = 16 * MiB,
        http: aiohttp.ClientSession | None = None,
    ) -> None:
        if max_buffered_updates < 1 or max_buffered_live < 1 or max_in_flight < 1:
            raise ValueError("buffer and in-flight limits must be at least 1")
        self.url = url
        self.offset = offset  # position of the last item taken from updates()
        self.epoch = epoch
        self.user_id: str | None = None
        self.connections = 0  # connections that got `connected`
        self.recovered = False  # the latest `connected.recovered`
        self._token = token
        self._token_provider = token_provider
        self._received = offset  # highest offset queued: sent in `connect`
        self._received_epoch = epoch
        self._policy = reconnect or ReconnectPolicy()
        self._request_timeout = request_timeout
        self._connect_timeout = connect_timeout
        self._close_timeout = close_timeout
        self._heartbeat = heartbeat
        self._max_frame_bytes = max_frame_bytes
        self._slots = asyncio.Semaphore(max_in_flight)
        self._updates: _Buffer[_StreamItem] = _Buffer(max_buffered_updates)
        self._live: _Buffer[LiveChunk] = _Buffer(max_buffered_live, drop_oldest=True)
        self._http = http
        self._own_http = http is None
        self._rng = random.Random()
        self._ids = itertools.count(1)
        self._link: _Link | None = None
        self._online = asyncio.Event()  # set while a link is ready, and once stopped
        self._supervision = Supervision("RpcClient")
        self._stopped = False
        self._failure: RpcClientError | None = None
        self._closing = False

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> RpcClient:
        await self.connect()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect and wait for `connected`; raises `RpcAuthenticationError`/`RpcConnectError`."""
        if self._http is None:
            self._http = aiohttp.ClientSession()
        await self._supervision.start(self._supervise, self.close)

    async def close(self) -> None:
        """Close the connection and stop: pending calls raise `RpcClosedError`."""
        self._closing = True
        supervisor = self._supervision.task
        if supervisor is not None and not supervisor.done():
            if self._link is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self._close_timeout):
                        await self._link.ws.close(code=CLOSE_NORMAL)
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
        self._stop(None)
        if self._own_http and self._http is not None:
            await self._http.close()

    def abort_connection(self) -> None:
        """Drop the current connection abruptly; the client reconnects (for apps that know
        the network changed, and for tests)."""
        if self._link is not None:
            self._link.abort()

    @property
    def connected(self) -> bool:
        return self._online.is_set() and not self._stopped

    @property
    def closed(self) -> bool:
        return self._stopped

    # -- streams ------------------------------------------------------------------------------

    async def updates(self) -> AsyncIterator[Update | Reset]:
        """Updates in offset order, each once, and `Reset`s; see the module docstring.

        Ends after `close()`; raises the terminal error when the client failed.
        """
        while True:
            item = await self._updates.get()
            if item is None:
                if self._failure is not None:
                    raise self._failure
                return
            self.offset = item.offset
            if isinstance(item, Reset):
                self.epoch = item.epoch
            if not isinstance(item, _Gap):
                yield item

    async def live(self) -> AsyncIterator[LiveChunk]:
        """Live chunks as they arrive (lossy: see the module docstring)."""
        while True:
            chunk = await self._live.get()
            if chunk is None:
                if self._failure is not None:
                    raise self._failure
                return
            yield chunk

    @property
    def buffered_updates(self) -> int:
        """Items waiting in `updates()` (bounded by `max_buffered_updates`)."""
        return len(self._updates)

    # -- session methods ----------------------------------------------------------------------

    async def session_list(self, *, cursor: str = "", limit: int = 20) -> Page[SessionEntity]:
        params = {"cursor": cursor, "limit": limit}
        return await self._query("v1.session.list", params, Page[SessionEntity])

    async def session_get(self, session_id: str) -> SessionEntity:
        return await self._query("v1.session.get", {"session_id": session_id}, SessionEntity)

    async def session_close(
        self, session_id: str, *, client_id: str = ""
    ) -> ActionResult[SessionEntity]:
        params = {"session_id": session_id, "client_id": client_id}
        return await self._action("v1.session.close", params, SessionEntity)

    async def session_open(self, session_id: str) -> ActionResult[SessionEntity]:
        """Reopen a closed session (a session that is not closed is returned unchanged)."""
        return await self._action("v1.session.open", {"session_id": session_id}, SessionEntity)

    async def session_update(
        self,
        session_id: str,
        *,
        title: str | msgspec.UnsetType = msgspec.UNSET,
        deleted_at: str | datetime | msgspec.UnsetType | None = msgspec.UNSET,
    ) -> ActionResult[SessionEntity]:
        """Rename, soft-delete (`deleted_at` a time) or restore (`deleted_at=None`);
        what is left out is unchanged."""
        params: dict[str, Any] = {"session_id": session_id}
        if not isinstance(title, msgspec.UnsetType):
            params["title"] = title
        if not isinstance(deleted_at, msgspec.UnsetType):
            params["deleted_at"] = _rfc3339(deleted_at)
        return await self._action("v1.session.update", params, SessionEntity)

    async def session_fork(
        self,
        *,
        old_server_session_id: str,
        old_server_message_id: str,
        content_data: str,
        new_client_session_id: str = "",
        new_client_message_id: str = "",
        limit: int = 200,
    ) -> ActionResult[ForkResult]:
        """A new session with up to `limit` messages before the fork point, then
        `content_data` in place of it. Never repeated after a drop."""
        params = {
            "old_server_session_id": old_server_session_id,
            "old_server_message_id": old_server_message_id,
            "content_data": content_data,
            "new_client_session_id": new_client_session_id,
            "new_client_message_id": new_client_message_id,
            "limit": limit,
        }
        return await self._action("v1.session.fork", params, ForkResult)

    async def session_compact(
        self, session_id: str, *, custom_instruction: str = ""
    ) -> ActionResult[CompactResult]:
        """Queue a compaction; its summary message arrives later as an update."""
        params = {"session_id": session_id, "custom_instruction": custom_instruction}
        return await self._action("v1.session.compact", params, CompactResult)

    # -- message methods ----------------------------------------------------------------------

    async def message_send(
        self,
        content_data: str,
        *,
        client_id: str | None = None,
        client_session_id: str = "",
        server_session_id: str = "",
        agent_prompt: str = "",
        agent: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> ActionResult[SendResult]:
        """Send a message (a new session when `server_session_id` is empty).

        `client_id` deduplicates: a fresh one is made when it is None. The reply
        comes as updates and live chunks.
        """
        params: dict[str, Any] = {
            "content_data": content_data,
            "client_id": client_id or uuid.uuid4().hex,
            "client_session_id": client_session_id,
            "server_session_id": server_session_id,
            "agent_prompt": agent_prompt,
            "agent": agent,
        }
        if metadata is not None:
            params["metadata"] = dict(metadata)
        reply = await self._call("v1.message.send", params)
        error = reply.frame.error
        if reply.repeated and error is not None and error.code == "client_id_conflict":
            return ActionResult(_sent_by_first_attempt(error), deduplicated=True)
        return _action_result(reply.frame, "v1.message.send", SendResult)

    async def message_list(
        self, session_id: str, *, cursor: str | int = "", limit: int = 50
    ) -> Page[MessageEntity]:
        """Messages after `cursor` (a global_offset), oldest first."""
        params = {"session_id": session_id, "cursor": cursor, "limit": limit}
        return await self._query("v1.message.list", params, Page[MessageEntity])

    async def message_get(self, message_id: str) -> MessageEntity:
        return await self._query("v1.message.get", {"message_id": message_id}, MessageEntity)

    # -- turn methods -------------------------------------------------------------------------

    async def turn_stop(self, session_id: str, *, client_id: str = "") -> ActionResult[StopResult]:
        """Cancel the session's running turn (no-op when none runs). Never repeated."""
        params = {"session_id": session_id, "client_id": client_id}
        return await self._action("v1.turn.stop", params, StopResult)

    async def turn_list(
        self, session_id: str, *, cursor: str = "", limit: int = 50
    ) -> Page[TurnEntity]:
        params = {"session_id": session_id, "cursor": cursor, "limit": limit}
        return await self._query("v1.turn.list", params, Page[TurnEntity])

    async def turn_get(self, turn_id: str) -> TurnEntity:
        return await self._query("v1.turn.get", {"turn_id": turn_id}, TurnEntity)

    # -- rtc methods --------------------------------------------------------------------------

    async def rtc_update_status(
        self,
        rtc_id: str,
        *,
        status: Literal["executing", "rejected"],
        client_id: str = "",
        reason: str = "",
    ) -> ActionResult[RtcEntity]:
        params = {"rtc_id": rtc_id, "status": status, "client_id": client_id, "reason": reason}
        reply = await self._call("v1.rtc.update_status", params)
        return _action_result(reply.frame, "v1.rtc.update_status", RtcEntity)

    async def rtc_submit_result(
        self,
        rtc_id: str,
        *,
        success: bool,
        result: Any = None,
        error: str = "",
        client_id: str = "",
    ) -> ActionResult[RtcEntity]:
        """End an Rtc; on an Rtc that already ended, its stored outcome is returned."""
        params = {
            "rtc_id": rtc_id,
            "success": success,
            "result": result,
            "error": error,
            "client_id": client_id,
        }
        return await self._action("v1.rtc.submit_result", params, RtcEntity)

    async def rtc_list(
        self, session_id: str, *, cursor: str = "", limit: int = 50
    ) -> Page[RtcEntity]:
        params = {"session_id": session_id, "cursor": cursor, "limit": limit}
        return await self._query("v1.rtc.list", params, Page[RtcEntity])

    async def rtc_get(self, rtc_id: str) -> RtcEntity:
        return await self._query("v1.rtc.get", {"rtc_id": rtc_id}, RtcEntity)

    # -- calls --------------------------------------------------------------------------------

    async def _query(self, method: str, params: dict[str, Any], kind: type[T]) -> T:
        reply = await self._call(method, params)
        return _result(reply.frame, method, kind)

    async def _action(self, method: str, params: dict[str, Any], kind: type[T]) -> ActionResult[T]:
        reply = await self._call(method, params)
        return _action_result(reply.frame, method, kind)

    async def _call(self, method: str, params: dict[str, Any]) -> _Reply:
        """The reply frame (error replies included), sent again after drops when allowed."""
        self._check_usable()
        call_id = str(next(self._ids))
        data = _encode({"id": call_id, "method": method, "params": params})
        try:
            async with asyncio.timeout(self._request_timeout), self._slots:
                return await self._attempts(call_id, method, data)
        except TimeoutError:
            raise RpcTimeoutError(f"{method}: no reply within {self._request_timeout} s") from None

    async def _attempts(self, call_id: str, method: str, data: bytes) -> _Reply:
        repeated = False
        while True:
            link = await self._wait_link()
            frame = await link.request(call_id, data)
            if frame is not None:
                return _Reply(frame, repeated)
            self._check_usable()
            # Whether the request reached the server is unknown: only a call whose
            # repeat cannot take effect twice goes out again.
            if method not in RETRY_SAFE:
                raise RpcConnectionLostError(
                    f"{method}: the connection dropped before the reply; the outcome is unknown"
                )
            repeated = True

    async def _wait_link(self) -> _Link:
        while True:
            self._check_usable()
            link = self._link
            if link is not None and link.ready and not link.dropped:
                return link
            await self._online.wait()

    def _check_usable(self) -> None:
        if self._supervision.task is None:
            raise RpcClosedError("not connected: use `async with` or await connect()")
        if self._stopped or self._closing:
            raise self._failure or RpcClosedError("the client is closed")

    # -- received frames ------------------------------------------------------------------------

    def _on_frame(self, link: _Link, data: str | bytes) -> None:
        try:
            frame = _frame_decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise RpcProtocolError(f"unreadable frame from the server: {exc}") from None
        if frame.id is not None:
            link.resolve(frame)
        elif frame.type == "update" and frame.update is not None:
            self._take_update(frame.update)
        elif frame.type == "gap" and frame.offset is not None:
            self._take_gap(frame.offset)
        elif frame.type == "live" and frame.live is not None:
            self._live.put(frame.live)
        elif frame.type == "connected" and frame.offset is not None:
            self._on_connected(link, frame)
        elif frame.type == "error" and frame.error is not None:
            link.error = frame.error  # the close that follows is explained by it
            log.warning("rpc error frame code=%s: %s", frame.error.code, frame.error.message)

    def _on_connected(self, link: _Link, frame: _ServerFrame) -> None:
        assert frame.offset is not None
        self.user_id = frame.user_id
        self.recovered = frame.recovered
        self.connections += 1
        reason = _reset_reason(link, frame)
        if reason is not None:
            self._reset(reason, frame.epoch, frame.offset)
        elif link.sent_offset is None:
            # A first connect: the application loads its state with queries, and the
            # stream starts at the server's head.
            self._received = self.offset = frame.offset
            self._received_epoch = self.epoch = frame.epoch
        log.info(
            "rpc connected user=%s offset=%s recovered=%s reset=%s",
            frame.user_id,
            frame.offset,
            frame.recovered,
            reason,
        )
        link.ready = True
        if not link.connected.done():
            link.connected.set_result(None)
        self._online.set()
        self._supervision.connected()

    def _take_update(self, wire: _WireUpdate) -> None:
        if self._received is not None and wire.offset <= self._received:
            return  # a repeat (a replay overlapping what arrived before)
        update = _decode_update(wire)
        self._received = wire.offset
        if not self._updates.put(update):
            self._reset("overflow", self._received_epoch or "", wire.offset)

    def _take_gap(self, offset: int) -> None:
        if self._received is not None and offset <= self._received:
            return
        self._received = offset
        if not self._updates.put(_Gap(offset)):
            self._reset("overflow", self._received_epoch or "", offset)

    def _reset(
        self, reason: Literal["epoch_changed", "not_recovered", "overflow"], epoch: str, offset: int
    ) -> None:
        # What was buffered is covered by the reload the application does now.
        self._updates.clear()
        self._received, self._received_epoch = offset, epoch
        self._updates.put(Reset(reason, epoch, offset))
        log.info("rpc update stream reset reason=%s offset=%s", reason, offset)

    # -- connections ----------------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Connect, and after every drop reconnect, until a terminal condition."""
        retries = Retries(self._policy, self._rng, RpcConnectionLostError)
        auth_retried = False  # the previous connection was refused 4401 before opening
        try:
            while True:
                outcome = await self._connect_once()
                if outcome.opened:
                    retries.connected()
                    auth_retried = False
                self._check_terminal(outcome, auth_retried)
                auth_retried = outcome.close_code == CLOSE_UNAUTHENTICATED
                delay = retries.next_delay()
                log.info("rpc connection dropped code=%s retry_in=%.2f", outcome.close_code, delay)
                await asyncio.sleep(delay)
        except RpcClientError as exc:
            self._stop(exc)
        except _Finished:
            self._stop(None)
        except Exception as exc:
            # Callers wait on the stop; a bug here must not leave them waiting forever.
            log.exception("rpc client failed")
            self._stop(RpcClientError(f"internal error: {exc!r}"))

    def _check_terminal(self, outcome: _Outcome, auth_retried: bool = False) -> None:
        """Raise when `outcome` ends the client; return when a reconnect should follow."""
        if self._closing:
            raise _Finished()
        error = outcome.error
        refused = outcome.close_code == CLOSE_UNAUTHENTICATED or (
            error is not None and error.code == "unauthenticated"
        )
        # With a provider, an expired credential (4401 on a connection that worked) is
        # retried once with a fresh token.
        retry = self._token_provider is not None and not auth_retried and self.connections > 0
        if refused and not retry:
            message = error.message if error is not None else "unauthenticated"
            raise RpcAuthenticationError(message, close_code=outcome.close_code)
        if self.connections == 0:
            raise RpcConnectError(f"could not connect: {_describe_outcome(outcome)}")

    async def _connect_once(self) -> _Outcome:
        """One connection, from the upgrade to its close."""
        assert self._http is not None
        deadline = asyncio.get_running_loop().time() + self._connect_timeout
        try:
            ws = await open_socket(
                self._http,
                self.url,
                deadline,
                max_frame_bytes=self._max_frame_bytes,
                close_timeout=self._close_timeout,
                heartbeat=self._heartbeat,
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return _Outcome(failure=exc)
        link = _Link(ws, self._received, self._received_epoch, self._online.clear)
        self._link = link
        running = asyncio.create_task(self._run_link(link))

        def forget() -> None:
            link.drop()  # clears `_online`: callers wait for the next link
            self._link = None

        opened = await serve_socket(
            ws,
            running,
            self._handshake(link, running, deadline),
            abort=link.abort,
            before_cleanup=forget,
        )
        return _Outcome(opened=opened, close_code=link.close_code, error=link.error)

    async def _handshake(self, link: _Link, running: asyncio.Task[None], deadline: float) -> bool:
        """Wait for `connected` until `deadline`; True once it arrived."""
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        waiting: set[asyncio.Future[Any]] = {running, link.connected}
        await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not link.ready:
            link.abort()  # too slow, or closed before `connected`: `running` ends by itself
        return link.ready

    async def _run_link(self, link: _Link) -> None:
        """Send `connect`, then read until the socket closes."""
        try:
            token = self._token if self._token_provider is None else await ask(self._token_provider)
        except Exception as exc:  # the app's callback
            log.warning("token callback failed: %s", type(exc).__name__)
            return
        connect: dict[str, Any] = {"type": "connect"}
        for key, value in (
            ("token", token),
            ("offset", link.sent_offset),
            ("epoch", link.sent_epoch),
        ):
            if value is not None:
                connect[key] = value
        try:
            await link.ws.send_frame(_encode(connect), WSMsgType.TEXT)
        except (ConnectionError, aiohttp.ClientError):
            return
        refreshing = None
        if self._token_provider is not None:
            refreshing = asyncio.create_task(keep_fresh(token, self._token_provider, link.refresh))
        try:
            await self._read_link(link)
        finally:
            if refreshing is not None:
                refreshing.cancel()
                await asyncio.gather(refreshing, return_exceptions=True)

    async def _read_link(self, link: _Link) -> None:
        while True:
            msg = await link.ws.receive()
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                self._on_frame(link, msg.data)
            elif msg.type is WSMsgType.CLOSE:
                link.close_code = int(msg.data)
                return
            else:  # CLOSING, CLOSED, ERROR: gone without a close frame of the server's
                return

    def _stop(self, error: RpcClientError | None) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._failure = error
        if error is not None:
            log.info("rpc client stopped reason=%s", type(error).__name__)
        # Wake every waiter: callers waiting for a link, both streams, and connect().
        self._online.set()
        self._updates.close()
        self._live.close()
        self._supervision.failed(error or RpcClosedError("closed before connected"))


def _reset_reason(
    link: _Link, frame: _ServerFrame
) -> Literal["epoch_changed", "not_recovered"] | None:
    """Why the stream cannot continue from the position sent, if it cannot."""
    if link.sent_offset is None:
        return None  # nothing to recover
    if link.sent_epoch is not None and frame.epoch != link.sent_epoch:
        return "epoch_changed"
    return None if frame.recovered else "not_recovered"


def _result(frame: _ServerFrame, method: str, kind: type[T]) -> T:
    if frame.error is not None:
        raise _call_error(method, frame.error)
    return _decode_result(frame.result, kind, method)


def _action_result(frame: _ServerFrame, method: str, kind: type[T]) -> ActionResult[T]:
    result = _result(frame, method, kind)
    return ActionResult(result, tuple(_decode_update(u) for u in frame.updates or ()))


def _sent_by_first_attempt(error: _ErrorBody) -> SendResult:
    details = error.details if isinstance(error.details, dict) else {}
    session_id, message_id = details.get("session_id"), details.get("message_id")
    if not isinstance(session_id, str) or not isinstance(message_id, str):
        raise _call_error("v1.message.send", error)
    return SendResult(session_id=session_id, message_id=message_id)


def _describe_outcome(outcome: _Outcome) -> str:
    if outcome.error is not None:
        return f"{outcome.error.code}: {outcome.error.message}"
    if outcome.failure is not None:
        return str(outcome.failure) or type(outcome.failure).__name__
    if outcome.close_code is not None:
        return f"closed with {outcome.close_code}"
    return "the connection dropped before `connected`"


__all__ = [
    "ActionResult",
    "CompactResult",
    "Entity",
    "ForkResult",
    "LiveChunk",
    "MessageEntity",
    "OtherEntity",
    "Page",
    "Reset",
    "RpcAuthenticationError",
    "RpcCallError",
    "RpcClient",
    "RpcClientError",
    "RpcClosedError",
    "RpcConflictError",
    "RpcConnectError",
    "RpcConnectionLostError",
    "RpcNotFoundError",
    "RpcProtocolError",
    "RpcTimeoutError",
    "RtcEntity",
    "SendResult",
    "SessionEntity",
    "StopResult",
    "TurnEntity",
    "TurnFailure",
    "Update",
    "UpdateItem",
]
