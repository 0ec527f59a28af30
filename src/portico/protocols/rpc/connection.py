"""The `/v1/rpc` connection, sans-I/O: frames in, events and frames out.

Feed it what arrived (`receive_text`); it answers malformed frames itself and
returns `ConnectReceived` and `RequestReceived` events whose params are already
validated. The adapter answers with `accept`/`refuse`, `reply`/`reply_error`,
and pushes `update`s and `live` chunks; the core keeps the push channels'
rules:

- updates go out in offset order, each once: a replay after `connect` runs
  first, updates pushed meanwhile wait and then follow, repeats are dropped;
- a live chunk never precedes the `created` update of its message (it waits
  for it, bounded), and live frames are dropped rather than overflowing the
  send queue (the final content arrives as the message's `updated` update);
- updates that do not fit the send queue close the connection (4408): the
  client reconnects and recovers from its offset.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Any

import msgspec

from portico.auth.base import Identity
from portico.domain.limits import TokenBucket
from portico.domain.model import Message, ToolCallRecord, Update
from portico.domain.states import ToolCallState
from portico.errors import (
    InvalidRequest,
    MethodNotFound,
    PorticoError,
    RpcCredentialExpired,
    RpcRateLimited,
    RpcUnauthenticated,
    as_rpc_error,
)
from portico.protocols.credential import (
    CLOSE_CREDENTIAL_EXPIRED,
    CREDENTIAL_EXPIRED_REASON,
    CredentialClock,
)
from portico.protocols.outbox import Outbox
from portico.protocols.rpc import frames as f
from portico.protocols.rpc.entities import update_wire

CLOSE_SLOW_CONSUMER = 4408
# Live chunks held for a message whose `created` update has not gone out yet.
MAX_HELD_LIVE = 1024
_FIELD_PATH = re.compile(r"at `\$\.?([^`]*)`")
_REQUIRED_FIELD = re.compile(r"(?:missing required|contains unknown) field `([^`]+)`")
_frame_decoder = msgspec.json.Decoder(f.ClientFrame)
_encode = msgspec.json.Encoder().encode


class State(Enum):
    AWAIT_CONNECT = "await_connect"
    AWAIT_ACCEPT = "await_accept"  # connect received; the adapter authenticates
    REPLAYING = "replaying"  # accepted; missed updates are being sent
    OPEN = "open"
    CLOSED = "closed"


class ConnectReceived(msgspec.Struct, frozen=True):
    connect: f.Connect


class RequestReceived(msgspec.Struct, frozen=True):
    request: f.Request


class CredentialOffered(msgspec.Struct, frozen=True):
    """A `credential` frame: the adapter verifies the token, then calls `refresh`."""

    token: str


Event = ConnectReceived | RequestReceived | CredentialOffered
_FINAL_STATUSES = frozenset({"completed", "failed"})


class RpcConnection:
    def __init__(
        self,
        *,
        max_send_queue_bytes: int,
        requests_per_second: float = math.inf,
        request_burst: int = 1,
        now: float = 0.0,
        credential_margin: float = 30.0,
    ) -> None:
        self.state = State.AWAIT_CONNECT
        self._credential_margin = credential_margin  # close 4401 this long before exp
        self.credential: CredentialClock | None = None  # set once `connect` is accepted
        self._requests = TokenBucket(rate=requests_per_second, burst=request_burst, now=now)
        self.close_request: tuple[int, str] | None = None
        self._outbox = Outbox(max_send_queue_bytes)
        self._sent_offset = 0  # the highest update offset written
        self._waiting: dict[int, Update] = {}  # pushed during the replay
        self._announced: set[str] = set()  # messages whose `created` went out
        self._held: dict[str, list[f.Live]] = {}
        self._held_count = 0
        self._delivered_rtcs: list[str] = []

    # -- output ---------------------------------------------------------------------------

    @property
    def overflowed(self) -> bool:
        return self._outbox.overflowed

    def next_frame(self) -> bytes | None:
        return self._outbox.pop()

    def next_deadline(self) -> float:
        return math.inf if self.credential is None else self.credential.next_deadline()

    def _write(self, frame: Any) -> None:
        if not self._outbox.put(_encode(frame)) and self.close_request is None:
            self._close(CLOSE_SLOW_CONSUMER, "slow consumer")

    def _close(self, code: int, reason: str) -> None:
        if self.close_request is None:
            self.close_request = (code, reason)
        self.state = State.CLOSED

    # -- input ----------------------------------------------------------------------------

    def receive_text(self, data: str | bytes, now: float = 0.0) -> list[Event]:
        if self.state is State.CLOSED:
            return []
        try:
            frame = _frame_decoder.decode(data)
        except (msgspec.DecodeError, RecursionError, ValueError):
            return self._malformed("the frame is not a JSON object")
        if self.state is State.AWAIT_CONNECT:
            return self._first_frame(frame)
        if frame.type == "ping":
            self._write(f.PongFrame())
            return []
        if frame.type == "connect":
            return self._malformed("already connected")
        if frame.type == "credential":
            return self._credential_frame(frame)
        if frame.type is not None:
            return self._malformed(f"unknown frame type {frame.type!r}")
        if self.state is State.AWAIT_ACCEPT:
            return self._malformed("wait for `connected` before sending requests")
        return self._request(frame, now)

    def _malformed(self, message: str) -> list[Event]:
        if self.state is State.AWAIT_CONNECT:
            self.refuse(RpcUnauthenticated("the first frame must be connect"))
        else:
            self._write(f.ErrorFrame(_error_body(InvalidRequest(message))))
        return []

    def _first_frame(self, frame: f.ClientFrame) -> list[Event]:
        if frame.type != "connect":
            return self._malformed("the first frame must be connect")
        try:
            connect = msgspec.convert(
                {"token": frame.token, "offset": frame.offset, "epoch": frame.epoch}, f.Connect
            )
        except msgspec.ValidationError:
            return self._malformed("bad connect")
        if connect.offset is not None and connect.offset < 0:
            return self._malformed("bad connect")
        self.state = State.AWAIT_ACCEPT
        return [ConnectReceived(connect)]

    def _request(self, frame: f.ClientFrame, now: float) -> list[Event]:
        if not isinstance(frame.id, str) or not frame.id:
            self._write(
                f.ErrorFrame(
                    _error_body(InvalidRequest("`id` must be a non-empty string", field="id"))
                )
            )
            return []
        if not isinstance(frame.method, str):
            self.reply_error(frame.id, InvalidRequest("`method` must be a string", field="method"))
            return []
        if self._expired_for(frame.method, now):
            self.reply_error(frame.id, RpcCredentialExpired())
            return []
        if not self._requests.allow(now):
            self.reply_error(frame.id, RpcRateLimited("too many requests; slow down"))
            return []
        method = f.METHODS.get(frame.method)
        if method is None:
            self.reply_error(frame.id, MethodNotFound(f"no method {frame.method!r}"))
            return []
        try:
            params = _params(method, frame.params)
        except InvalidRequest as exc:
            self.reply_error(frame.id, exc)
            return []
        return [RequestReceived(f.Request(id=frame.id, method=frame.method, params=params))]

    def _expired_for(self, method: str, now: float) -> bool:
        """After the deadline requests are refused, but for the Rtc answers that end a
        running turn (the close waits for it)."""
        if self.credential is None or not self.credential.expired(now):
            return False
        return not method.startswith("v1.rtc.")

    def _credential_frame(self, frame: f.ClientFrame) -> list[Event]:
        if not isinstance(frame.credential, str) or not frame.credential:
            return self._malformed("`credential` must be a non-empty string")
        return [CredentialOffered(frame.credential)]

    # -- credential -----------------------------------------------------------------------

    def bind_credential(self, identity: Identity, *, now: float, wall: float) -> None:
        """The `connect` token's verified identity; its `exp` is the deadline."""
        margin = self._credential_margin
        self.credential = CredentialClock(identity, margin=margin, now=now, wall=wall)

    def refresh(self, identity: Identity, *, now: float, wall: float) -> bool:
        """A verified `credential` token: taken, or ignored (never a reply)."""
        clock = self.credential
        if clock is None or clock.expired(now) or self.state is State.CLOSED:
            return False
        return clock.refresh(identity, now=now, wall=wall)

    def check_credential(self, now: float, *, turn_running: bool) -> None:
        """Close 4401 once the credential's close point passed and no turn runs."""
        clock = self.credential
        if clock is None or self.state is State.CLOSED:
            return
        if clock.close_due(now, turn_running=turn_running):
            self._close(CLOSE_CREDENTIAL_EXPIRED, CREDENTIAL_EXPIRED_REASON)

    # -- connect --------------------------------------------------------------------------

    def accept(self, *, user_id: str, epoch: str, offset: int, recovered: bool) -> None:
        """Authenticated: `connected`, then (when recovering) the replay the adapter sends."""
        self._write(f.Connected(user_id=user_id, epoch=epoch, offset=offset, recovered=recovered))
        self.state = State.REPLAYING

    def refuse(self, error: PorticoError) -> None:
        self._write(f.ErrorFrame(_error_body(error)))
        self._close(error.close_code or 4401, error.code)

    def start_from(self, offset: int) -> None:
        """Updates up to `offset` are known to the client: never send them."""
        self._sent_offset = max(self._sent_offset, offset)

    def replayed(self, update: Update) -> None:
        """One update of the replay, in order; missing offsets before it become gaps."""
        self.gaps_until(update.offset - 1)
        self._send_update(update)

    def gaps_until(self, offset: int) -> None:
        """The replay ended at `offset`: offsets not sent up to it are gaps."""
        for missing in range(self._sent_offset + 1, offset + 1):
            self._write(f.GapFrame(missing))
        self._sent_offset = max(self._sent_offset, offset)

    def replay_done(self) -> None:
        """The replay is complete: updates pushed meanwhile follow, in order."""
        waiting, self._waiting = self._waiting, {}
        self.state = State.OPEN if self.state is State.REPLAYING else self.state
        for offset in sorted(waiting):
            self.push_update(waiting[offset])

    # -- replies and pushes ---------------------------------------------------------------

    def reply(self, request_id: str, result: Any, updates: list[Update] | None) -> None:
        wire = None if updates is None else tuple(update_wire(u) for u in updates)
        self._write(f.Result(id=request_id, result=result, updates=wire))

    def reply_error(self, request_id: str, error: PorticoError) -> None:
        self._write(f.Failed(id=request_id, error=_error_body(as_rpc_error(error))))

    def push_update(self, update: Update) -> None:
        """Updates are published in offset order, so a skipped offset has no update."""
        if self.state is State.REPLAYING:
            self._waiting[update.offset] = update
        elif self.state is State.OPEN and update.offset > self._sent_offset:
            self.gaps_until(update.offset - 1)
            self._send_update(update)

    def streaming(self, message_ids: list[str]) -> None:
        """Replies that were already streaming when this connection opened: their
        `created` update went out before it, so their live chunks may flow at once."""
        self._announced.update(message_ids)

    def _send_update(self, update: Update) -> None:
        self._sent_offset = max(self._sent_offset, update.offset)
        self._write(f.UpdateFrame(update_wire(update)))
        for item, entity in zip(update.items, update.data_list, strict=True):
            if item.entity == "message" and isinstance(entity, Message):
                self._track_message(item.action, entity)
            elif isinstance(entity, ToolCallRecord) and entity.state is ToolCallState.PENDING:
                self._delivered_rtcs.append(entity.id)

    def take_delivered_rtcs(self) -> list[str]:
        """Ids of `pending` Rtcs written since the last call: the client has them now."""
        delivered, self._delivered_rtcs = self._delivered_rtcs, []
        return delivered

    def _track_message(self, action: str, message: Message) -> None:
        if message.status in _FINAL_STATUSES:
            # Its final content is in this update: held chunks are stale now.
            self._announced.discard(message.id)
            self._held_count -= len(self._held.pop(message.id, ()))
            return
        if action == "created":
            self._announced.add(message.id)
            for live in self._held.pop(message.id, ()):
                self._held_count -= 1
                self._send_live(live)

    def push_live(self, live: f.Live) -> None:
        if self.state is not State.OPEN:
            return  # lossy by design; the final content comes as an update
        if live.message_id in self._announced:
            self._send_live(live)
        elif self._held_count < MAX_HELD_LIVE:
            self._held.setdefault(live.message_id, []).append(live)
            self._held_count += 1

    def _send_live(self, live: f.Live) -> None:
        data = _encode(f.LiveFrame(live))
        if self._outbox.has_room(len(data)):
            self._outbox.put(data)


def _params(method: f.Method, raw: Any) -> msgspec.Struct:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise InvalidRequest("`params` must be an object", field="params")
    try:
        params = msgspec.convert(raw, method.params)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid params: {exc}", field=_field_of(str(exc))) from None
    limit, most = getattr(params, "limit", None), method.max_limit
    if isinstance(limit, int) and most is not None and not method.min_limit <= limit <= most:
        raise InvalidRequest(
            f"`limit` must be between {method.min_limit} and {method.max_limit}",
            field="params.limit",
        )
    return params


def _field_of(error: str) -> str:
    """`params.<field>` from a msgspec validation message."""
    required = _REQUIRED_FIELD.search(error)
    path = _FIELD_PATH.search(error)
    name = required.group(1) if required else (path.group(1) if path else "")
    if required and path and path.group(1):
        name = f"{path.group(1)}.{name}"
    return f"params.{name}" if name else "params"


def _error_body(error: PorticoError) -> f.ErrorBody:
    return f.ErrorBody(code=error.code, message=error.message, details=error.details)
