"""The connection-scoped half of `/v1/session`, sans-I/O, for both roles.

One `SessionConnection` per WebSocket. It runs the handshake, decodes frames,
discards duplicates, paces acknowledgements, and keeps the heartbeat deadlines;
the session's `Channel` does the numbering. Feed it what arrived
(`receive_text`) and the time (`on_timer`); drain `next_frame()` and act on the
returned events and on `close_request`.

Server role: waits for `hello` (-> `HelloReceived`); the adapter authenticates
and calls `accept` or `fail`. Client role: `start(hello)` sends it; `ready`
comes back as `ReadyReceived` and the client's backlog is resent.
"""

from __future__ import annotations

import math
from enum import Enum

import msgspec

from portico.auth.base import Identity
from portico.errors import (
    BufferOverflow,
    PorticoError,
    ProtocolViolation,
    SessionCredentialExpired,
)
from portico.protocols.credential import (
    CLOSE_CREDENTIAL_EXPIRED,
    CREDENTIAL_EXPIRED_REASON,
    CredentialClock,
)
from portico.protocols.outbox import BinaryData, Outbox
from portico.protocols.session import frames as f
from portico.protocols.session.channel import Channel, Numbered

CLOSE_NORMAL = 1000
CLOSE_IDLE = 4000
CLOSE_SLOW_CONSUMER = 4408
CLOSE_REPLACED = 4409


class Role(Enum):
    SERVER = "server"
    CLIENT = "client"


class State(Enum):
    AWAIT_HELLO = "await_hello"  # server: nothing received yet
    AWAIT_ACCEPT = "await_accept"  # server: hello received, the adapter is deciding
    AWAIT_READY = "await_ready"  # client: hello sent
    OPEN = "open"
    CLOSED = "closed"


class Timing(msgspec.Struct, frozen=True, kw_only=True):
    """Every protocol duration and count; each a setting with the spec's default."""

    ack_delay: float = 0.1  # acknowledge within this many seconds of handling
    ack_every: int = 16  # ...or after this many unacknowledged messages
    heartbeat_interval: float = 15.0  # client pings this often (ready.heartbeat_ms if shorter)
    dead_after: float = 2.5  # client: dead after this many silent intervals
    idle_timeout: float = 45.0  # server: close 4000 after this much silence
    max_send_queue_bytes: int = 4 * 1024 * 1024  # per connection; past it close 4408
    credential_margin: float = 30.0  # server: close 4401 this long before the token's exp


class HelloReceived(msgspec.Struct, frozen=True):
    hello: f.Hello


class ReadyReceived(msgspec.Struct, frozen=True):
    ready: f.Ready


class Received(msgspec.Struct, frozen=True):
    """A numbered message taking effect now: new, in order, never a duplicate."""

    frame: Numbered


class PeerDead(msgspec.Struct, frozen=True):
    """Client role: nothing arrived for `dead_after` heartbeat intervals."""


class CredentialOffered(msgspec.Struct, frozen=True):
    """Server role: an unnumbered `credential`; the adapter verifies it, then `refresh`."""

    token: str


class Acknowledged(msgspec.Struct, frozen=True):
    """Ledger mode: the peer acknowledged up to `seq`; the adapter trims its ledger."""

    seq: int


Event = HelloReceived | ReadyReceived | Received | PeerDead | CredentialOffered | Acknowledged

_DECODERS: dict[Role, msgspec.json.Decoder[f.ClientFrame | f.ServerFrame]] = {
    Role.SERVER: f.client_frame_decoder,  # type: ignore[dict-item]
    Role.CLIENT: f.server_frame_decoder,  # type: ignore[dict-item]
}


def check_hello(hello: f.Hello) -> None:
    """`continue` opens a new numbering, so it names no position and resumes nothing."""
    if hello.continue_session is None:
        return
    if hello.session_id is not None:
        raise ProtocolViolation("hello takes `session_id` (resume) or `continue`, not both")
    if hello.last_seq != 0:
        raise ProtocolViolation("`last_seq` belongs to a resume, not to `continue`")


class SessionConnection:
    def __init__(self, *, role: Role, timing: Timing, now: float, ledger: bool = False) -> None:
        """`ledger`: the session's positions live outside the connection (the server's
        session-state port). Acks are then reported (`Acknowledged`), and a message
        counts as handled, for the acks this side sends, only once the adapter
        `confirm`s it: an ack never runs ahead of what the ledger holds."""
        self.role = role
        self._ledger = ledger
        self._confirmed = 0  # ledger mode: the highest peer seq the ledger holds handled
        self.state = State.AWAIT_HELLO if role is Role.SERVER else State.CLOSED
        self.channel: Channel | None = None
        self.close_request: tuple[int, str] | None = None
        self._timing = timing
        self._decoder = _DECODERS[role]
        self._outbox = Outbox(timing.max_send_queue_bytes)
        self._last_received = now
        # Client role: the ping interval in effect; `ready.heartbeat_ms` may shorten it.
        self._heartbeat = timing.heartbeat_interval
        self._next_ping = now + self._heartbeat
        self._unacked = 0  # handled peer messages not yet acknowledged
        self._ack_deadline: float | None = None
        self._hello: f.Hello | None = None  # client role: the hello this connection sent
        self.credential: CredentialClock | None = None  # server role, once authenticated

    # -- output ---------------------------------------------------------------------------

    @property
    def overflowed(self) -> bool:
        """The peer stopped reading and its send queue filled."""
        return self._outbox.overflowed

    def next_frame(self) -> bytes | None:
        return self._outbox.pop()

    def data_to_send(self) -> list[bytes]:
        return self._outbox.drain()

    def _write(self, data: bytes, *, bounded: bool = True) -> None:
        """Queue a frame; live frames count against the send-queue bound."""
        if not self._outbox.put(data, bounded=bounded) and self.close_request is None:
            # The client stopped reading; it resumes and gets the backlog again.
            self._request_close(CLOSE_SLOW_CONSUMER, "slow consumer")

    def _write_frame(self, frame: f.ClientFrame | f.ServerFrame) -> None:
        self._write(f.encode(frame))

    def write_numbered(self, data: bytes) -> None:
        """A numbered message the channel just encoded; live only once the handshake is done.

        An ack this side owes goes out right behind it, in the same write: earlier
        than its deadline (the spec asks for *within* `ack_delay`), with no timer and no
        write of its own (a turn's first chunk carries the ack of the message that
        started it). Behind, not before: an answer to a message still precedes its ack.
        """
        if self.state is State.OPEN:
            self._write(data)
            if self._ack_deadline is not None:
                self._send_ack()

    def write_binary(self, data: bytes) -> bool:
        """A binary (media) frame; False when it was dropped instead of queued.

        Binary frames are lossy: never resent, so never worth closing for. One is
        queued only while the connection is open and the send queue stays under half
        its bound, which leaves the other half to the numbered messages: audio alone
        never makes a slow client overflow (4408).
        """
        if self.state is not State.OPEN:
            return False
        if not self._outbox.has_room(len(data) + self._timing.max_send_queue_bytes // 2):
            return False
        return self._outbox.put(BinaryData(data))

    def send(self, frame: Numbered) -> None:
        """Number `frame` on the session's channel and write it."""
        if self.channel is None:
            raise ProtocolViolation("no session yet: the handshake has not completed")
        self.write_numbered(self.channel.send(frame))

    def send_credential(self, token: str) -> None:
        """Client: a fresh token for this connection, before the old one's deadline."""
        if self.state is State.OPEN:
            self._write_frame(f.Credential(credential=token))

    def _request_close(self, code: int, reason: str) -> None:
        if self.close_request is None:
            self.close_request = (code, reason)
        self.state = State.CLOSED

    def fail(self, error: PorticoError) -> None:
        """An unnumbered error, then a close with the error's code."""
        if self.state is State.CLOSED and self.close_request is not None:
            return
        info = f.ErrorInfo(code=error.code, message=error.message, details=error.details)
        self._write_frame(f.Error(error=info))
        self._request_close(error.close_code or 4400, error.code)

    def close(self, code: int, reason: str) -> None:
        self._request_close(code, reason)

    # -- handshake ------------------------------------------------------------------------

    def accept(self, channel: Channel, ready: f.Ready, peer_last_seq: int) -> None:
        """Server: the hello is good. Send `ready`, then what the client missed."""
        self.channel = channel
        self._confirmed = channel.handled
        try:
            channel.acknowledge(peer_last_seq)
        except ProtocolViolation as exc:
            self.fail(exc)
            return
        self._write_frame(ready)
        self.state = State.OPEN
        self._resend(channel)

    def bind_credential(self, identity: Identity, *, now: float, wall: float) -> None:
        """Server: the hello's verified credential; its `exp` is the deadline."""
        margin = self._timing.credential_margin
        self.credential = CredentialClock(identity, margin=margin, now=now, wall=wall)

    def refresh(self, identity: Identity, *, now: float, wall: float) -> bool:
        """A verified `credential` token: taken, or ignored (never a reply)."""
        clock = self.credential
        if clock is None or clock.expired(now) or self.state is not State.OPEN:
            return False
        return clock.refresh(identity, now=now, wall=wall)

    def check_credential(self, now: float, *, turn_running: bool) -> None:
        """Close 4401 once the credential's close point passed and no turn runs."""
        clock = self.credential
        if clock is None or self.state is not State.OPEN:
            return
        if clock.close_due(now, turn_running=turn_running):
            self._request_close(CLOSE_CREDENTIAL_EXPIRED, CREDENTIAL_EXPIRED_REASON)

    def _resend(self, channel: Channel) -> None:
        # The backlog is bounded by the resend buffer and shares its bytes; counting it
        # against the live send queue would make a large backlog unresumable.
        for data in channel.unacknowledged():
            self._write(data, bounded=False)

    def start(self, hello: f.Hello, channel: Channel) -> None:
        """Client: send `hello` on a fresh connection.

        A continuing hello starts a new numbering: its channel must not have handled
        or had acknowledged anything (old messages are never replayed into it).
        """
        check_hello(hello)
        if hello.continue_session is not None and (channel.handled or channel.peer_acked):
            raise ProtocolViolation("continuing a conversation needs a fresh channel")
        self.channel = channel
        self._hello = hello
        self._write_frame(hello)
        self.state = State.AWAIT_READY

    # -- input ----------------------------------------------------------------------------

    def receive_text(self, data: str | bytes, now: float) -> list[Event]:
        self._last_received = now
        if self.state is State.CLOSED:
            return []  # whatever arrives after we decided to close is ignored
        try:
            frame = self._decoder.decode(data)
        except (msgspec.DecodeError, RecursionError, ValueError) as exc:
            # ValueError covers a str that is not encodable UTF-8 (lone surrogates).
            self.fail(ProtocolViolation(f"malformed frame: {exc}"))
            return []
        try:
            if type(frame) is f.Ack and self.state is State.OPEN:
                # Most frames a client sends while a turn streams: straight to the
                # channel, past the handshake's checks and the match.
                return self._acknowledge(frame.seq)
            return self._dispatch(frame, now)
        except BufferOverflow as exc:
            self.fail(exc)
        except ProtocolViolation as exc:
            self.fail(exc)
        return []

    def _dispatch(self, frame: f.ClientFrame | f.ServerFrame, now: float) -> list[Event]:
        if self.state is State.AWAIT_HELLO:
            if not isinstance(frame, f.Hello):
                raise ProtocolViolation("the first frame must be hello")
            check_hello(frame)
            self.state = State.AWAIT_ACCEPT
            return [HelloReceived(frame)]
        if isinstance(frame, f.Hello):
            raise ProtocolViolation("hello was already received on this connection")
        if self.state is State.AWAIT_ACCEPT:
            raise ProtocolViolation("nothing but hello may come before ready")
        if self.state is State.AWAIT_READY:
            return self._on_ready(frame, now)
        match frame:
            case f.Ack(seq=seq):
                return self._acknowledge(seq)
            case f.Ping():
                self._write_frame(f.Pong())
                return []
            case f.Pong():
                return []
            case f.Credential(credential=token) if self.role is Role.SERVER:
                return [CredentialOffered(token)]
            case f.Ready():
                raise ProtocolViolation("ready was already received on this connection")
            case f.Error(seq=None) as error:
                # A connection-level error from the server precedes its close.
                return [Received(error)] if self.role is Role.CLIENT else []
        return self._numbered(frame, now)

    def _acknowledge(self, seq: int) -> list[Event]:
        assert self.channel is not None
        self.channel.acknowledge(seq)
        return [Acknowledged(seq)] if self._ledger else []

    def _on_ready(self, frame: f.ClientFrame | f.ServerFrame, now: float) -> list[Event]:
        if isinstance(frame, f.Error) and frame.seq is None:
            return [Received(frame)]
        if not isinstance(frame, f.Ready):
            raise ProtocolViolation("the first frame from the server must be ready")
        assert self.channel is not None
        continued = self._hello.continue_session if self._hello is not None else None
        if continued is not None and (frame.resumed or frame.session_id != continued):
            raise ProtocolViolation("a continued conversation must keep its id, not resume")
        self.channel.acknowledge(frame.last_seq)
        self.state = State.OPEN
        if frame.heartbeat_ms > 0:
            # The server's idle timeout (4000) is sized for the interval it announces:
            # pinging less often than that would have the connection closed again and again.
            self._heartbeat = min(self._timing.heartbeat_interval, frame.heartbeat_ms / 1000)
        self._next_ping = now + self._heartbeat
        self._resend(self.channel)
        return [ReadyReceived(frame)]

    def _numbered(self, frame: f.ClientFrame | f.ServerFrame, now: float) -> list[Event]:
        seq = getattr(frame, "seq", None)
        if not isinstance(seq, int) or seq < 1:
            raise ProtocolViolation(f"{type(frame).__name__} needs a seq of 1 or more")
        if (
            isinstance(frame, f.Message)
            and self.credential is not None
            and self.credential.expired(now)
        ):
            # Not handled: the client resumes with a fresh token and resends it. Tool
            # replies are still taken: they end a running turn.
            self.fail(SessionCredentialExpired())
            return []
        assert self.channel is not None
        fresh = self.channel.receive(seq)
        if not fresh or not self._ledger:
            self._schedule_ack(now)  # duplicates are acknowledged again
        return [Received(frame)] if fresh else []  # type: ignore[arg-type]

    def confirm(self, seq: int, now: float) -> None:
        """Ledger mode: the ledger holds client message `seq` handled; acknowledge it."""
        if self.state is not State.OPEN or seq <= self._confirmed:
            return
        self._confirmed = seq
        self._schedule_ack(now)

    # -- acknowledgements and heartbeats ----------------------------------------------------

    def _schedule_ack(self, now: float) -> None:
        self._unacked += 1
        if self._unacked >= self._timing.ack_every:
            self._send_ack()
        elif self._ack_deadline is None:
            self._ack_deadline = now + self._timing.ack_delay

    def _send_ack(self) -> None:
        assert self.channel is not None
        handled = self._confirmed if self._ledger else self.channel.handled
        self._write_frame(f.Ack(seq=handled))
        self._unacked = 0
        self._ack_deadline = None

    def next_deadline(self) -> float:
        if self.state is State.CLOSED:
            return math.inf  # nothing is due on a closed connection
        # Asked after every frame received: comparisons, no list.
        deadline = self._last_received + self._silence_limit()
        ack = self._ack_deadline
        if ack is not None and ack < deadline:
            deadline = ack
        if self.role is Role.CLIENT and self.state is State.OPEN:
            deadline = min(deadline, self._next_ping)
        if self.credential is not None:
            deadline = min(deadline, self.credential.next_deadline())
        return deadline

    def receive_control(self, now: float) -> None:
        """A WebSocket-level ping or pong: any frame counts as liveness."""
        self._last_received = now

    def _silence_limit(self) -> float:
        if self.role is Role.SERVER:
            return self._timing.idle_timeout
        return self._heartbeat * self._timing.dead_after

    def on_timer(self, now: float) -> list[Event]:
        """Do what is due at `now`: an ack, a ping, or give up on a silent peer."""
        if self.state is State.CLOSED:
            return []
        if self._ack_deadline is not None and now >= self._ack_deadline:
            self._send_ack()
        if now - self._last_received >= self._silence_limit():
            if self.role is Role.SERVER:
                self._request_close(CLOSE_IDLE, "idle timeout")
                return []
            self.state = State.CLOSED
            return [PeerDead()]
        if self.role is Role.CLIENT and self.state is State.OPEN and now >= self._next_ping:
            self._write_frame(f.Ping())
            self._next_ping = now + self._heartbeat
        return []
