"""`SessionClient`: the Python client of resumable sessions (`GET /v1/session`).

One `SessionClient` is one session. It keeps the session across dropped
connections: it reconnects with backoff and jitter, resumes with the last
server message it handled, and resends what the server has not acknowledged,
so every message takes effect exactly once (spec/sessions-protocol.md). The
protocol rules live in the sans-I/O core (`protocols.session`); this module
only runs sockets and timers around it.

    import asyncio
    from portico.client import SessionClient

    def get_time() -> str:
        return "12:00"

    async def main() -> None:
        client = SessionClient("ws://127.0.0.1:8080/v1/session")
        client.register_tool("get_time", get_time, description="the local time")
        async with client:  # hello -> ready; a clean exit sends `end`
            reply = await client.ask("hello")
            print(reply.text)

            turn = await client.start_turn("tell me more")
            async for frame in turn:  # chunk, tool_call ..., then done or error
                print(frame)

    asyncio.run(main())

Where frames go. Every numbered server message is delivered once, in order:

- the frames of a turn started with `start_turn()` or `ask()` go to that `Turn`
  (a turn answers the oldest message still waiting for one, so the match is
  exact even while other messages are in flight);
- everything else goes to the client's own stream: `async for msg in client`.
  What nobody reads waits there (late errors answering a tool result, frames
  of turns started with `send_message()`), so read the stream if you use those.

Audio (the `audio` capability): pass `audio_output=[f.AudioFormat(codec="pcm16")]`
(the formats you accept, preferred first) and the agent's streamed media reach
you as items: an `audio_start` frame, the bytes in binary frames (never
numbered, never resent), an `audio_end` frame. `Reply.audio` has a turn's items
with their bytes (`AudioItem`; `complete` is False for an item cut by a
dropped connection: discard it); when iterating a `Turn` yourself, take an
item's bytes with `client.take_audio(end.item_id)` on its `audio_end`.

Voice (spec/realtime-audio.md): pass `audio_input=[f.AudioFormat(codec="pcm16",
sample_rate=16000, channels=1)]` (and `transcripts=True` for the caller's
recognised speech) to an agent that takes calls. `client.audio_input` is the
format the server chose (None: it hears no audio). `await client.send_audio(pcm)`
sends one frame of the current audio item (opened by the first frame, never
resent: audio sent while no connection is up is dropped, and a new connection
starts a new item), `await client.end_audio()` ends the item, `interrupt()` is the
barge-in. The agent's spoken turns are turns of their own (`turn_id` `vturn-…`) on
the client's stream, as are `transcript` frames; `await client.voice_reply()`
reads that stream up to the end of the next spoken turn and returns a
`VoiceReply` (what was heard, the reply's text, its audio items).

Registered tools are declared in `hello` (register them before connecting) and
answered by the client: it acknowledges the call, asks the tool's `consent`
callback if it has one, runs the function and sends its result. The
`tool_call` frame is still delivered as above, so a user interface can show it.

Continuing after a server restart (opt-in): with `continue_after_restart=True` a
failed resume (`RESUME_FAILED`: the server restarted, or the window passed) is not
terminal once: the client continues the same conversation in a new numbering
(`hello.continue`, docs/session.md) and `on_status` reports `continued=True`.
Messages queued while no connection was up, and sent ones no turn answered yet
(their key makes a second copy harmless), are sent in the new numbering; turns the
old numbering owed (already started) end with an `error` frame `RESUME_FAILED`
(`details.reason = "continued"`), never replayed. To pick up an
archived conversation from the start, pass `continue_session="sess-..."`.

Every message carries an idempotency key (`client_id`, a fresh `cm-...` unless
given; `Turn.client_id`), so such a message may be sent again with its key:
`start_turn(text, client_id=turn.client_id)`. If the old server had archived it,
the answer is an `error` `DUPLICATE_MESSAGE` instead of a second copy, and
`Reply.text` is the earlier answer's archived text (`Reply.duplicate` its details).

Terminal conditions are raised from iteration, from `Turn`s and from the send
methods: `ResumeFailedError` (the session is gone; the client never replays
into a new one), `AuthenticationError`, `SessionReplacedError`,
`ConnectionLostError`. After `end()` or `close()` iteration simply stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

import aiohttp
import msgspec
from aiohttp import WSMsgType

from portico.client.credentials import CredentialProvider, ask, keep_fresh
from portico.client.supervision import (
    ReconnectPolicy,
    Retries,
    Supervision,
    open_socket,
    serve_socket,
)
from portico.domain.model import ContentPart, new_id
from portico.errors import BinaryFrameError, BufferOverflow, DuplicateMessage, ProtocolViolation
from portico.protocols.omnia.binary import BinaryFrame, BinaryMetadata, decode_frame, encode_frame
from portico.protocols.outbox import BinaryData
from portico.protocols.session import frames as f
from portico.protocols.session.channel import Channel
from portico.protocols.session.connection import (
    Event,
    PeerDead,
    ReadyReceived,
    Received,
    Role,
    SessionConnection,
    State,
    Timing,
)

log = logging.getLogger("portico.client")

ServerMessage: TypeAlias = f.ServerNumbered
ToolFunction: TypeAlias = Callable[..., Any]
Consent: TypeAlias = Callable[[f.ToolCall], Awaitable[bool] | bool]

MiB: Final = 1024 * 1024
DECLINED_BY_USER: Final = "declined by the user"
CLOSE_SESSION_ENDED: Final = 1000
CLOSE_GOING_AWAY: Final = 1001
CLOSE_TOO_LARGE: Final = 1009
CLOSE_PROTOCOL_ERROR: Final = 4400
CLOSE_UNAUTHENTICATED: Final = 4401
CLOSE_RESUME_FAILED: Final = 4404
DUPLICATE_MESSAGE: Final = DuplicateMessage.code
CLOSE_REPLACED: Final = 4409
CLOSE_RATE_LIMITED: Final = 4429
# Closes that mean "this client sent something wrong": resuming resends the same
# frames, so a few in a row without a working connection in between is a client bug.
CLIENT_FAULT_CLOSES: Final = frozenset({CLOSE_TOO_LARGE, CLOSE_PROTOCOL_ERROR})
MAX_CLIENT_FAULTS: Final = 3
_SERVER_FRAMES = (
    f.Chunk,
    f.Done,
    f.ToolCall,
    f.ServerToolResult,
    f.Transcript,
    f.AudioStart,
    f.AudioEnd,
    f.Error,
)
MAX_FINISHED_AUDIO: Final = 64  # finished items kept for `take_audio`; the oldest go first


# -- errors ---------------------------------------------------------------------------------


class SessionError(Exception):
    """The session cannot go on. `code` and `close_code` are the server's, when it sent them."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        close_code: int | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.close_code = close_code
        self.details = dict(details or {})


class ConnectError(SessionError):
    """The first connection failed: nothing was opened, the session never existed."""


class ResumeFailedError(SessionError):
    """RESUME_FAILED (4404): the session is gone; open a new client for a new session."""


class AuthenticationError(SessionError):
    """UNAUTHENTICATED (4401) and no `credential_provider` to get a new credential."""


class SessionReplacedError(SessionError):
    """4409: a newer connection resumed this session; this client stops."""


class ConnectionLostError(SessionError):
    """No connection could be made for `ReconnectPolicy.give_up_after` seconds."""


class ProtocolError(SessionError):
    """The server closed with 4400 or 1009 again and again: this client sends bad frames."""


class SessionClosedError(SessionError):
    """The client was closed, or the session ended, before the operation could happen."""


class SendBufferFullError(SessionError):
    """The resend buffer is full (the server has not acknowledged); nothing was sent."""


# -- settings and results ---------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectionStatus:
    """What `on_status` is told: a connection opened, dropped, or the client stopped."""

    state: Literal["open", "dropped", "closed"]
    resumed: bool = False  # "open": this connection resumed the session
    # "open": this connection continued the conversation in a new numbering
    # (`continue_after_restart` after a failed resume, or `continue_session`).
    continued: bool = False
    close_code: int | None = None  # "dropped": the close code, None for an abrupt drop
    retry_in: float | None = None  # "dropped": seconds until the next attempt
    error: SessionError | None = None  # "closed": why, when it was not end() or close()


@dataclass(frozen=True)
class AudioItem:
    """One media item the agent streamed (audio, or an image), with its bytes."""

    item_id: str
    turn_id: str
    format: f.AudioFormat  # `mime_type` says what the bytes are
    data: bytes
    # Every binary frame arrived, in order, through the one marked last, and the
    # server did not end the item `lost`. An incomplete item is not worth playing.
    complete: bool


@dataclass
class _AudioBuffer:
    start: f.AudioStart
    data: bytearray
    next_index: int = 0
    saw_last: bool = False
    gap: bool = False


@dataclass(frozen=True)
class Reply:
    """One turn's frames, collected by `ask()` or `Turn.reply()`."""

    turn_id: str | None
    frames: tuple[ServerMessage, ...]
    audio: tuple[AudioItem, ...] = ()  # the turn's media items, in order

    @property
    def done(self) -> f.Done | None:
        last = self.frames[-1] if self.frames else None
        return last if isinstance(last, f.Done) else None

    @property
    def error(self) -> f.ErrorInfo | None:
        last = self.frames[-1] if self.frames else None
        return last.error if isinstance(last, f.Error) else None

    @property
    def duplicate(self) -> dict[str, Any] | None:
        """`DUPLICATE_MESSAGE` details: the server already had this message (its key)
        and answered it before; `reply` in them is that answer's archived text."""
        error = self.error
        return duplicate_details(error) if error is not None else None

    @property
    def text(self) -> str:
        """The reply's text: `done.content` when the server sent one, else the chunks
        (for a message the server already had, the earlier answer's archived text)."""
        done = self.done
        if done is not None and done.content is not None:
            return done.content
        duplicate = self.duplicate
        if duplicate is not None:
            return str(duplicate.get("reply", ""))
        return "".join(frame.content for frame in self.frames if isinstance(frame, f.Chunk))

    @property
    def cancelled(self) -> bool:
        return self.done is not None and self.done.cancelled

    @property
    def tool_calls(self) -> tuple[f.ToolCallInfo, ...]:
        return tuple(frame.tool_call for frame in self.frames if isinstance(frame, f.ToolCall))


@dataclass(frozen=True)
class VoiceReply:
    """One spoken agent turn and what was heard before it, from `voice_reply()`."""

    turn_id: str | None
    frames: tuple[ServerMessage, ...]  # transcripts, then the turn's frames
    audio: tuple[AudioItem, ...] = ()

    @property
    def heard(self) -> str:
        """The caller's final transcripts, joined."""
        return " ".join(
            t.text for t in self.frames if isinstance(t, f.Transcript) and t.final and t.text
        )

    @property
    def text(self) -> str:
        last = self.frames[-1] if self.frames else None
        if isinstance(last, f.Done) and last.content is not None:
            return last.content
        return "".join(
            c.content for c in self.frames if isinstance(c, f.Chunk) and c.turn_id == self.turn_id
        )

    @property
    def cancelled(self) -> bool:
        last = self.frames[-1] if self.frames else None
        return isinstance(last, f.Done) and last.cancelled

    @property
    def error(self) -> f.ErrorInfo | None:
        last = self.frames[-1] if self.frames else None
        return last.error if isinstance(last, f.Error) else None


def is_voice_turn(turn_id: str | None) -> bool:
    """A spoken agent turn of the session's voice call (the server mints its id)."""
    return turn_id is not None and turn_id.startswith(f.VOICE_TURN_PREFIX + "-")


@dataclass(frozen=True)
class _Tool:
    spec: f.ToolSpec
    func: ToolFunction
    consent: Consent | None


@dataclass
class _Outcome:
    """How one connection ended."""

    opened: bool = False
    close_code: int | None = None  # from the server's close frame; None: abrupt or never open
    error: f.ErrorInfo | None = None  # the connection-level error that preceded the close
    failure: BaseException | None = None  # the socket could not be opened


class _Stop:
    """Put in a queue when the client stops: consumers wake and raise or finish."""


_STOP: Final = _Stop()
_Item: TypeAlias = ServerMessage | _Stop


def _ends_turn(frame: ServerMessage) -> bool:
    return isinstance(frame, f.Done) or (isinstance(frame, f.Error) and frame.turn_id is not None)


def new_message_key() -> str:
    """A fresh idempotency key (`message.client_id`) for one message."""
    return new_id("cm")


def duplicate_details(error: f.ErrorInfo) -> dict[str, Any] | None:
    """The details of a `DUPLICATE_MESSAGE` answer, or None for any other error."""
    if error.code != DUPLICATE_MESSAGE:
        return None
    return dict(error.details or {})


def _running_duplicate(frame: ServerMessage) -> str | None:
    """The running turn that already answers a message sent again with its key."""
    if not isinstance(frame, f.Error) or frame.turn_id is not None:
        return None
    details = duplicate_details(frame.error)
    if details is None or details.get("turn_state") != "running":
        return None
    turn_id = details.get("turn_id")
    return turn_id if isinstance(turn_id, str) and turn_id else None


# -- one turn ----------------------------------------------------------------------------------


class Turn:
    """The frames answering one message, in order, ending with its `done` or `error`.

    Iterate it (`async for frame in turn`) or `await turn.reply()`. A message the
    server refuses (`TURN_IN_PROGRESS`, `INVALID_MESSAGE`, ...) gives a turn of one
    `error` frame with `ref_seq` set and no `turn_id`. A message the server already
    had (its `client_id` key) gives an `error` `DUPLICATE_MESSAGE`: the turn ends
    with it, unless the earlier turn still runs; then that turn's frames follow.
    """

    def __init__(self, client: SessionClient, message_seq: int, client_id: str) -> None:
        self.message_seq = message_seq
        self.client_id = client_id  # the message's key: send it again with this one
        self.turn_id: str | None = None
        self._client = client
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._exhausted = False

    def _put(self, item: _Item) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> Turn:
        return self

    async def __anext__(self) -> ServerMessage:
        if self._exhausted:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, _Stop):
            self._queue.put_nowait(item)  # every later read stops too
            raise self._client._stopped_error("the session stopped before this turn ended")
        if _ends_turn(item) or (
            isinstance(item, f.Error)
            and item.ref_seq == self.message_seq
            and _running_duplicate(item) is None
        ):
            self._exhausted = True
        return item

    async def reply(self) -> Reply:
        """The rest of the turn's frames (bound the wait with `asyncio.timeout` if needed)."""
        frames = [frame async for frame in self]
        audio = (
            self._client.take_audio(frame.item_id)
            for frame in frames
            if isinstance(frame, f.AudioEnd)
        )
        return Reply(self.turn_id, tuple(frames), tuple(item for item in audio if item))


# -- one connection ------------------------------------------------------------------------------


def _frame_type(data: bytes) -> WSMsgType:
    return WSMsgType.BINARY if isinstance(data, BinaryData) else WSMsgType.TEXT


class _Link:
    """One WebSocket of the session: feeds the core, writes what it queues, runs its timers."""

    def __init__(
        self,
        ws: aiohttp.ClientWebSocketResponse,
        core: SessionConnection,
        on_events: Callable[[_Link, list[Event]], None],
        on_binary: Callable[[bytes], bool],
    ) -> None:
        self.ws = ws
        self.core = core
        self.ready: asyncio.Future[f.Ready] = asyncio.get_running_loop().create_future()
        self.close_code: int | None = None
        self.error: f.ErrorInfo | None = None
        self.credential: str | None = None  # the one its hello carried
        self._on_events = on_events
        self._on_binary = on_binary
        self._loop = asyncio.get_running_loop()
        self._writable = asyncio.Event()
        self._rearm = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Until the socket closes; the timers start only once `ready` arrived."""
        self._tasks.append(asyncio.create_task(self._write_loop()))
        self._writable.set()  # hello is queued already
        try:
            await self._read_loop()
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._closing is not None:
                await asyncio.gather(self._closing, return_exceptions=True)

    def start_timers(self) -> None:
        self._tasks.append(asyncio.create_task(self._timer_loop()))

    def keep_credential_fresh(self, credential: str | None, provider: CredentialProvider) -> None:
        """Send a fresh token (`credential`) before this one's deadline closes the link."""
        self._tasks.append(asyncio.create_task(keep_fresh(credential, provider, self._refresh)))

    async def _refresh(self, token: str) -> None:
        self.core.send_credential(token)
        self._after_core()

    def write(self, data: bytes) -> None:
        """A numbered frame the channel encoded: live now if the handshake is done."""
        self.core.write_numbered(data)
        self._after_core()

    def write_binary(self, data: bytes) -> bool:
        """An audio frame (lossy: False when the core dropped it)."""
        queued = self.core.write_binary(data)
        if queued:
            self._writable.set()
        return queued

    def abort(self) -> None:
        """Drop the socket without a close frame, as a network failure would."""
        # aiohttp has no public abort for a client WebSocket; this is the transport
        # its own get_extra_info() reads.
        connection = self.ws._response.connection
        transport = None if connection is None else connection.transport
        if transport is not None:
            transport.abort()
        else:
            self.close(CLOSE_GOING_AWAY, "aborted")

    def close(self, code: int, reason: str) -> None:
        """Close with `code` once what is queued is written (bounded by the ws_close timeout)."""
        if self._closing is None:
            self._closing = asyncio.create_task(self._close(code, reason))

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(ConnectionError, aiohttp.ClientError):
            while (data := self.core.next_frame()) is not None:
                await self.ws.send_frame(data, _frame_type(data))
        await self.ws.close(code=code, message=reason.encode())

    def _after_core(self) -> None:
        if self.core.close_request is not None:
            self.close(*self.core.close_request)
        self._writable.set()

    async def _read_loop(self) -> None:
        while True:
            msg = await self.ws.receive()
            if msg.type is WSMsgType.TEXT:
                self._on_events(self, self.core.receive_text(msg.data, self._loop.time()))
                self._rearm.set()  # an ack may now be due sooner; silence restarts
            elif msg.type is WSMsgType.BINARY:
                self.core.receive_control(self._loop.time())  # any frame counts as liveness
                if self.core.state is State.OPEN and not self._on_binary(msg.data):
                    self.core.fail(ProtocolViolation("binary frames need the audio capability"))
            elif msg.type is WSMsgType.CLOSE:
                self.close_code = int(msg.data)
                return
            else:  # CLOSING, CLOSED, ERROR: gone without a close frame of the server's
                return
            self._after_core()

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._writable.wait()
                self._writable.clear()
                while (data := self.core.next_frame()) is not None:
                    await self.ws.send_frame(data, _frame_type(data))
        except (ConnectionError, aiohttp.ClientError):
            self.abort()  # the read loop then sees the socket gone and ends the link

    async def _timer_loop(self) -> None:
        # The core is CLOSED once it gave up or asked to close; its deadlines mean
        # nothing then, and waiting on them would spin.
        while self.core.state is not State.CLOSED:
            # Not `asyncio.wait_for`: before Python 3.12 it swallows a cancellation that
            # lands as the event is set (a frame, then the drop, in one read), and this
            # loop would outlive its link until the dead timer (2.5 heartbeats) fired.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(self.core.next_deadline()):
                    await self._rearm.wait()
            self._rearm.clear()
            events = self.core.on_timer(self._loop.time())
            if any(isinstance(event, PeerDead) for event in events):
                log.info("server silent for too long; dropping the connection")
                self.abort()
                return
            self._writable.set()


# -- the client ----------------------------------------------------------------------------------


class SessionClient:
    """A resumable session over `GET /v1/session`; see the module docstring.

    Every duration is in seconds. `credential_provider`, when given, is asked for
    a credential before every connection and, for a JWT, again before its `exp`
    (the answer is sent as an unnumbered `credential`, so the connection stays up);
    a 4401 (the credential expired anyway, or was refused) is retried once with a
    fresh one and the session resumes with nothing lost. Without it `credential`
    is sent and a 4401 is terminal.
    """

    def __init__(
        self,
        url: str,
        *,
        credential: str | None = None,
        credential_provider: CredentialProvider | None = None,
        agent: str | None = None,
        tools: Iterable[f.ToolSpec | Mapping[str, Any]] = (),
        context: Mapping[str, Any] | None = None,
        capabilities: Sequence[str] = ("tools", "context"),
        audio_output: Sequence[f.AudioFormat] | None = None,  # given: ask for `audio`
        audio_input: Sequence[f.AudioFormat] | None = None,  # given: ask for `audio`, to speak
        transcripts: bool = False,  # ask for `transcript` frames of what the server heard
        reconnect: ReconnectPolicy | None = None,
        heartbeat_interval: float = 15.0,  # seconds between pings (ready.heartbeat_ms if shorter)
        dead_after: float = 2.5,  # heartbeat intervals of silence before the link is dead
        ack_delay: float = 0.1,  # seconds: acknowledge within this long...
        ack_every: int = 16,  # ...or after this many unacknowledged messages
        max_buffer_messages: int = 1000,  # resend buffer: messages...
        max_buffer_bytes: int = 8 * MiB,  # ...and bytes not yet acknowledged
        max_frame_bytes: int = 8 * MiB,  # the largest server frame accepted
        connect_timeout: float = 10.0,  # seconds for the upgrade plus hello/ready
        close_timeout: float = 5.0,  # seconds to wait for the server's side of a close
        on_status: Callable[[ConnectionStatus], None] | None = None,
        http: aiohttp.ClientSession | None = None,
        continue_session: str | None = None,  # open by continuing this archived session
        continue_after_restart: bool = False,  # on RESUME_FAILED, continue the conversation
    ) -> None:
        self.url = url
        self.session_id: str | None = None
        self.capabilities: tuple[str, ...] = ()
        self.ready: f.Ready | None = None  # the latest `ready`
        self.connections = 0  # how many connections reached `ready`
        self._credential = credential
        self._credential_provider = credential_provider
        self._agent = agent
        self._tool_specs = [_tool_spec(tool) for tool in tools]
        self._context = dict(context) if context is not None else None
        self._requested = tuple(capabilities)
        self._audio_offer: f.AudioOffer | None = None
        if audio_output is not None or audio_input is not None:
            self._audio_offer = f.AudioOffer(
                input=tuple(audio_input or ()), output=tuple(audio_output or ())
            )
            if "audio" not in self._requested:
                self._requested += ("audio",)
        if transcripts and "transcripts" not in self._requested:
            self._requested += ("transcripts",)
        self._items = 0  # audio items sent: their ids
        self._item: tuple[_Link, str, int] | None = None  # the open one: link, id, next seq
        self._audio_open: dict[str, _AudioBuffer] = {}
        self._audio_done: dict[str, AudioItem] = {}
        self._policy = reconnect or ReconnectPolicy()
        self._timing = Timing(
            ack_delay=ack_delay,
            ack_every=ack_every,
            heartbeat_interval=heartbeat_interval,
            dead_after=dead_after,
            # After `ready` the core queues the whole resend backlog at once; a bound
            # below the backlog's would close every resume as a slow consumer.
            max_send_queue_bytes=max_buffer_bytes + MiB,
        )
        self._buffer_limits = (max_buffer_messages, max_buffer_bytes)
        self._channel = self._new_channel()
        self._wire_seq = 0  # our highest seq handed to an open connection
        # The archived session the next hello continues (a new numbering), if any.
        self._continuing = continue_session
        self._continue_after_restart = continue_after_restart
        self._max_frame_bytes = max_frame_bytes
        self._connect_timeout = connect_timeout
        self._close_timeout = close_timeout
        self._on_status = on_status
        self._http = http
        self._own_http = http is None
        self._rng = random.Random()
        self._tools: dict[str, _Tool] = {}
        self._tool_tasks: dict[str, asyncio.Task[None]] = {}
        self._inbox: asyncio.Queue[_Item] = asyncio.Queue()
        # Routing: messages still waiting for their turn, oldest first, and open turns.
        self._pending_messages: deque[int] = deque()
        self._turn_for_message: dict[int, Turn] = {}
        self._open_turns: dict[str, Turn | None] = {}
        self._call_owner: dict[str, Turn] = {}
        self._link: _Link | None = None
        self._supervision = Supervision("SessionClient")
        self._stopped = asyncio.Event()
        self._failure: SessionError | None = None
        self._closing = False
        self._ending = False

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> SessionClient:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """A clean exit ends the session; an exception leaves it resumable until it expires."""
        if exc_type is None:
            await self.end()
        await self.close()

    async def connect(self) -> None:
        """Open the session: connect, send `hello`, wait for `ready` (`connect_timeout`)."""
        if self._http is None:
            self._http = aiohttp.ClientSession()
        await self._supervision.start(self._supervise, self.close)

    async def end(self) -> bool:
        """Send `end` and wait (`close_timeout` at most) for the server's close 1000.

        True when the server confirmed. Either way the client is stopped afterwards.
        """
        if self._stopped.is_set() or self._supervision.task is None:
            return False
        try:
            await self._send(f.End(seq=0))
            self._ending = True
            async with asyncio.timeout(self._close_timeout):
                await self._stopped.wait()
        except (SessionError, TimeoutError):
            await self.close()
            return False
        return self._failure is None

    async def close(self) -> None:
        """Stop without ending the session: the server keeps it for its resume window."""
        self._closing = True
        supervisor = self._supervision.task
        if supervisor is not None and not supervisor.done():
            if self._link is not None:
                # A close frame lets the server start the resume window at once.
                self._link.close(CLOSE_GOING_AWAY, "client closed")
                await asyncio.wait({supervisor}, timeout=self._close_timeout)
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
        self._stop(None)
        if self._own_http and self._http is not None:
            await self._http.close()

    def abort_connection(self) -> None:
        """Drop the current connection abruptly; the client resumes on a new one.

        For an application that knows the network changed (and for tests).
        """
        if self._link is not None:
            self._link.abort()

    @property
    def closed(self) -> bool:
        return self._stopped.is_set()

    # -- receiving ----------------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[ServerMessage]:
        return self.messages()

    async def messages(self) -> AsyncIterator[ServerMessage]:
        """Server messages not claimed by a `Turn`, each once, in order, across reconnects.

        Ends after `end()` or `close()`; raises the terminal `SessionError` otherwise.
        """
        while True:
            item = await self._inbox.get()
            if isinstance(item, _Stop):
                self._inbox.put_nowait(item)
                if self._failure is not None:
                    raise self._failure
                return
            yield item

    async def start_turn(
        self,
        content: str | None = None,
        *,
        parts: Sequence[ContentPart] | None = None,
        metadata: Mapping[str, str] | None = None,
        client_id: str | None = None,
    ) -> Turn:
        """Send a message; the returned `Turn` receives the frames that answer it.

        `client_id` is the message's idempotency key (a fresh one when None): send a
        message again with its `Turn.client_id` and the server never takes it twice.
        """
        self._check_open()
        key = client_id or new_message_key()
        seq = self._queue_message(content, parts, metadata, key)
        turn = Turn(self, seq, key)
        self._turn_for_message[seq] = turn
        return turn

    async def ask(
        self,
        content: str | None = None,
        *,
        parts: Sequence[ContentPart] | None = None,
        metadata: Mapping[str, str] | None = None,
        client_id: str | None = None,
    ) -> Reply:
        """Send a message and collect its turn.

        The server ends every turn with `done` or `error`, across reconnects too; to
        bound the wait anyway, wrap the call in `asyncio.timeout(...)`.
        """
        turn = await self.start_turn(content, parts=parts, metadata=metadata, client_id=client_id)
        return await turn.reply()

    # -- sending ------------------------------------------------------------------------------

    async def send_message(
        self,
        content: str | None = None,
        *,
        parts: Sequence[ContentPart] | None = None,
        metadata: Mapping[str, str] | None = None,
        client_id: str | None = None,
    ) -> int:
        """Send a message (it starts a turn); its frames arrive in `messages()`. Returns seq.
        `client_id`: its idempotency key, as for `start_turn`."""
        self._check_open()
        return self._queue_message(content, parts, metadata, client_id or new_message_key())

    async def ack_tool_call(self, call_id: str) -> int:
        return await self._send(f.ToolCallAck(seq=0, call_id=call_id))

    async def nack_tool_call(self, call_id: str, reason: str) -> int:
        return await self._send(f.ToolCallNack(seq=0, call_id=call_id, reason=reason))

    async def send_tool_result(
        self, call_id: str, result: Any = None, *, error: str | None = None
    ) -> int:
        """Answer a tool call with `result`, or with `error` (then `result` is ignored)."""
        if error is not None:
            return await self._send(f.ClientToolResult(seq=0, call_id=call_id, error=error))
        return await self._send(f.ClientToolResult(seq=0, call_id=call_id, result=result))

    async def send_context(self, context: Mapping[str, Any]) -> int:
        """New application context for server code and tools (never model instructions)."""
        if "context" not in self.capabilities:
            raise ValueError("the context capability is not in effect for this session")
        return await self._send(f.Context(seq=0, context=dict(context)))

    async def interrupt(self) -> int:
        """Cancel the running turn; it ends with a `done` carrying `cancelled: true`."""
        return await self._send(f.Interrupt(seq=0))

    # -- speaking -------------------------------------------------------------------------------

    @property
    def audio_input(self) -> f.AudioFormat | None:
        """The format the server hears (`ready.audio.input`); None: it hears no audio."""
        ready = self.ready
        if ready is None or ready.audio is None or "audio" not in self.capabilities:
            return None
        return ready.audio.input

    async def send_audio(self, data: bytes, *, last: bool = False) -> bool:
        """One frame of the current audio item (opened by the first); `last` ends it.

        False when it was dropped: no connection is up, or the send queue is too full
        (audio is never resent). A new connection starts a new item.
        """
        self._check_open()
        fmt = self.audio_input
        if fmt is None:
            raise SessionError("the server hears no audio: ready.audio.input is null")
        link = self._link
        if link is None or link.core.state is not State.OPEN:
            self._item = None  # what was in flight is lost; the next audio starts anew
            return False
        if self._item is None or self._item[0] is not link:
            self._items += 1
            self._item = (link, f"c{self._items}", 0)
        _, item_id, sequence = self._item
        metadata = (
            BinaryMetadata(codec=fmt.codec, sample_rate=fmt.sample_rate, channels=fmt.channels)
            if sequence == 0
            else BinaryMetadata()
        )
        frame = BinaryFrame(
            media_id=item_id, sequence=sequence, is_last=last, metadata=metadata, payload=data
        )
        self._item = None if last else (link, item_id, sequence + 1)
        return link.write_binary(encode_frame(frame))

    async def end_audio(self) -> bool:
        """End the current audio item (an empty frame marked last); False if none is open."""
        if self._item is None:
            return False
        return await self.send_audio(b"", last=True)

    async def voice_reply(self, *, within: float | None = None) -> VoiceReply:
        """Read the client's stream up to the end (`done` or `error`) of the next spoken
        turn, or a call-level `error`; what was heard before it comes with it. Frames of
        other kinds on the stream are kept in the reply's `frames` too: read the stream
        with this or with `messages()`, not both at once."""
        frames: list[ServerMessage] = []
        audio: list[AudioItem] = []
        turn_id: str | None = None
        async with asyncio.timeout(within):
            async for frame in self.messages():
                frames.append(frame)
                if isinstance(frame, f.AudioEnd) and is_voice_turn(frame.turn_id):
                    item = self.take_audio(frame.item_id)
                    if item is not None:
                        audio.append(item)
                turn = getattr(frame, "turn_id", None)
                if is_voice_turn(turn):
                    turn_id = turn
                    if _ends_turn(frame):
                        break
                elif isinstance(frame, f.Error) and turn is None and frame.ref_seq is None:
                    break  # the call's own error (refused, failed, a bad frame)
        return VoiceReply(turn_id=turn_id, frames=tuple(frames), audio=tuple(audio))

    async def _send(self, frame: f.ClientNumbered) -> int:
        self._check_open()
        return self._number(frame)

    def _queue_message(
        self,
        content: str | None,
        parts: Sequence[ContentPart] | None,
        metadata: Mapping[str, str] | None,
        client_id: str,
    ) -> int:
        if not content and not parts:
            raise ValueError("a message needs content or parts")
        # The key travels in the frame: a resend or a continuation keeps it.
        message = f.Message(
            seq=0,
            content=content,
            parts=tuple(parts) if parts is not None else None,
            metadata=dict(metadata) if metadata is not None else None,
            client_id=client_id,
        )
        seq = self._number(message)
        self._pending_messages.append(seq)
        return seq

    def _number(self, frame: f.ClientNumbered) -> int:
        """Number `frame` into the channel (kept until acknowledged) and write it if live."""
        try:
            data = self._channel.send(frame)
        except BufferOverflow as exc:
            raise SendBufferFullError(exc.message) from exc
        seq = self._channel.next_seq - 1
        if self._link is not None:
            if self._link.core.state is State.OPEN:
                self._wire_seq = seq
            self._link.write(data)
        return seq

    def _new_channel(self) -> Channel:
        messages, size = self._buffer_limits
        return Channel(max_messages=messages, max_bytes=size)

    # -- continuing after a restart -----------------------------------------------------------

    def _start_continuation(self) -> None:
        """The resume failed: the next hello continues the conversation in a new numbering.

        Old messages are never replayed blindly (they may have taken effect on the
        server that went away), so turns already answering them end with a
        `RESUME_FAILED` error. Messages queued while no connection was up never reached
        any server, and keyed ones nothing answered yet are harmless to send again (the
        server answers a key it already has with `DUPLICATE_MESSAGE`): they move to the
        new numbering with their keys, so nothing typed is lost or taken twice.
        """
        assert self.session_id is not None
        old, self._channel = self._channel, self._new_channel()
        waiting = set(self._pending_messages)
        unsent: list[tuple[int, f.Message]] = []
        for data in old.unacknowledged():
            frame = f.client_frame_decoder.decode(data)
            if isinstance(frame, f.Message) and (
                frame.seq > self._wire_seq or (bool(frame.client_id) and frame.seq in waiting)
            ):
                unsent.append((frame.seq, frame))
        self._end_lost_turns({seq for seq, _ in unsent})
        renumbered: dict[int, int] = {}
        for seq, frame in unsent:
            self._channel.send(frame)
            renumbered[seq] = self._channel.next_seq - 1
        self._pending_messages = deque(renumbered[seq] for seq in self._pending_messages)
        self._turn_for_message = {
            renumbered[seq]: turn for seq, turn in self._turn_for_message.items()
        }
        for turn in self._turn_for_message.values():
            turn.message_seq = renumbered[turn.message_seq]
        self._wire_seq = 0
        self._continuing = self.session_id
        log.info("resume failed; continuing the conversation session=%s", self.session_id)

    def _end_lost_turns(self, kept: set[int]) -> None:
        """End every turn the old numbering owed, but those of the `kept` messages."""
        for seq in [seq for seq in self._pending_messages if seq not in kept]:
            self._pending_messages.remove(seq)
            turn = self._turn_for_message.pop(seq, None)
            self._lost(seq, turn, None)
        for turn_id, open_turn in self._open_turns.items():
            self._lost(None, open_turn, turn_id)
        self._open_turns.clear()
        self._call_owner.clear()
        self._audio_open.clear()
        for task in list(self._tool_tasks.values()):
            task.cancel()

    def _lost(self, message_seq: int | None, turn: Turn | None, turn_id: str | None) -> None:
        info = f.ErrorInfo(
            code="RESUME_FAILED",
            message="the server lost this turn (it restarted); send the message again",
            details={"reason": "continued"},
        )
        frame = f.Error(seq=0, turn_id=turn_id, ref_seq=message_seq, error=info)
        if turn is not None:
            turn._put(frame)
        else:
            self._inbox.put_nowait(frame)

    def _check_open(self) -> None:
        if self._supervision.task is None:
            raise SessionClosedError("not connected: use `async with` or await connect()")
        if self._stopped.is_set():
            raise self._stopped_error("the session is closed")
        if self._ending:
            # The server ignores what follows `end`; refusing here says so.
            raise SessionClosedError("the session is ending")

    def _stopped_error(self, message: str) -> SessionError:
        return self._failure or SessionClosedError(message)

    # -- tools --------------------------------------------------------------------------------

    def register_tool(
        self,
        name: str,
        func: ToolFunction,
        *,
        description: str = "",
        parameters: Mapping[str, Any] | None = None,
        consent: Consent | None = None,
    ) -> None:
        """Answer `tool_call`s for `name` with `func(**arguments)` (sync or async).

        Sync functions run in a worker thread so they never hold up heartbeats. An
        exception becomes the result's `error`; a refused `consent` a nack with
        reason "declined by the user". Register before connecting: tools are
        declared in the first `hello` and fixed for the session.
        """
        spec = f.ToolSpec(name=name, description=description, parameters=dict(parameters or {}))
        self._tools[name] = _Tool(spec, func, consent)

    @property
    def tools(self) -> frozenset[str]:
        """Names of the registered tools, which the client answers by itself."""
        return frozenset(self._tools)

    def _start_tool(self, frame: f.ToolCall) -> None:
        tool = self._tools.get(frame.tool_call.name)
        if tool is None:
            return
        call_id = frame.tool_call.id
        task = asyncio.create_task(self._run_tool(tool, frame))
        self._tool_tasks[call_id] = task
        task.add_done_callback(lambda _: self._tool_tasks.pop(call_id, None))

    async def _run_tool(self, tool: _Tool, frame: f.ToolCall) -> None:
        call = frame.tool_call
        try:
            await self.ack_tool_call(call.id)
            if tool.consent is not None and not await _consented(tool.consent, frame):
                await self.nack_tool_call(call.id, DECLINED_BY_USER)
                return
            try:
                value = await _call_tool(tool.func, call.arguments)
            except Exception as exc:
                await self.send_tool_result(call.id, error=_describe(exc))
                return
            try:
                await self.send_tool_result(call.id, value)
            except (TypeError, msgspec.EncodeError):
                await self.send_tool_result(call.id, error="the tool's result is not JSON")
        except SessionError:
            pass  # the session stopped: nobody is left to answer

    # -- routing received messages ------------------------------------------------------------

    def _on_events(self, link: _Link, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, ReadyReceived):
                if not link.ready.done():
                    link.ready.set_result(event.ready)
            elif isinstance(event, Received):
                frame = event.frame
                if isinstance(frame, f.Error) and frame.seq is None:
                    link.error = frame.error  # explains the close that follows
                elif isinstance(frame, _SERVER_FRAMES):
                    self._deliver(frame)

    # -- audio ----------------------------------------------------------------------------------

    def take_audio(self, item_id: str) -> AudioItem | None:
        """A finished media item (its `audio_end` was delivered), once; None if unknown."""
        return self._audio_done.pop(item_id, None)

    def _on_binary(self, data: bytes) -> bool:
        """A binary frame: a chunk of an open media item. False: not acceptable here."""
        if "audio" not in self.capabilities:
            return False
        try:
            frame = decode_frame(data)
        except BinaryFrameError:
            return False
        item = self._audio_open.get(frame.media_id)
        if item is None:
            # The item's audio_start was handled on an earlier connection: the rest of a
            # lost item, never a new one (a new item starts with a fresh audio_start).
            return True
        if frame.sequence != item.next_index:
            item.gap = True
        item.next_index = frame.sequence + 1
        item.saw_last = item.saw_last or frame.is_last
        item.data += frame.payload
        return True

    def _audio_frame(self, frame: f.AudioStart | f.AudioEnd) -> None:
        if isinstance(frame, f.AudioStart):
            self._audio_open[frame.item_id] = _AudioBuffer(frame, bytearray())
            return
        buffer = self._audio_open.pop(frame.item_id, None)
        if buffer is None:
            return
        self._audio_done[frame.item_id] = AudioItem(
            item_id=frame.item_id,
            turn_id=frame.turn_id,
            format=buffer.start.format,
            data=bytes(buffer.data),
            complete=buffer.saw_last and not buffer.gap and not frame.lost,
        )
        while len(self._audio_done) > MAX_FINISHED_AUDIO:
            del self._audio_done[next(iter(self._audio_done))]

    def _deliver(self, frame: ServerMessage) -> None:
        if isinstance(frame, f.AudioStart | f.AudioEnd):
            self._audio_frame(frame)
        if isinstance(frame, f.ToolCall):
            self._start_tool(frame)
        elif isinstance(frame, f.ServerToolResult):
            # The server gave up on the call: stop working on it.
            task = self._tool_tasks.pop(frame.call_id, None)
            if task is not None:
                task.cancel()
        turn = self._route(frame)
        if turn is not None:
            turn._put(frame)
        else:
            self._inbox.put_nowait(frame)

    def _route(self, frame: ServerMessage) -> Turn | None:
        """The `Turn` this frame belongs to, or None for the client's own stream."""
        if isinstance(frame, f.Error) and frame.turn_id is None:
            running = _running_duplicate(frame)
            if running is not None and running in self._open_turns:
                return self._open_turns[running]  # its frames came first and claimed it
            turn = self._refusal(frame.ref_seq)
            if running is not None and turn is not None:
                turn.turn_id = running  # the earlier turn answers it: follow that one
                self._open_turns[running] = turn
            return turn
        if isinstance(frame, f.ServerToolResult):
            return self._call_owner.pop(frame.call_id, None)
        turn_id = getattr(frame, "turn_id", None)
        if not isinstance(turn_id, str):
            return None
        if turn_id not in self._open_turns:
            # A spoken turn answers no message: it goes to the client's stream.
            claimed = None if is_voice_turn(turn_id) else self._claim_new_turn(turn_id)
            self._open_turns[turn_id] = claimed
        turn = self._open_turns[turn_id]
        if isinstance(frame, f.ToolCall) and turn is not None:
            self._call_owner[frame.tool_call.id] = turn
        if _ends_turn(frame):
            del self._open_turns[turn_id]
            self._call_owner = {k: v for k, v in self._call_owner.items() if v is not turn}
        return turn

    def _claim_new_turn(self, turn_id: str) -> Turn | None:
        # Messages are handled in seq order and each either starts one turn or is
        # refused with an error naming it (ref_seq), and a session runs one turn at a
        # time: so a new turn answers the oldest message still waiting for an answer.
        if not self._pending_messages:
            return None
        turn = self._turn_for_message.pop(self._pending_messages.popleft(), None)
        if turn is not None:
            turn.turn_id = turn_id
        return turn

    def _refusal(self, ref_seq: int | None) -> Turn | None:
        if ref_seq is None or ref_seq not in self._pending_messages:
            return None
        self._pending_messages.remove(ref_seq)
        return self._turn_for_message.pop(ref_seq, None)

    # -- connections --------------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Connect, and after every drop reconnect, until a terminal condition."""
        retries = Retries(self._policy, self._rng, ConnectionLostError)
        faults = 0  # consecutive closes that blame this client
        auth_retried = False
        try:
            while True:
                outcome = await self._connect_once()
                if outcome.opened:
                    retries.connected()
                    auth_retried = False
                try:
                    self._check_terminal(outcome, auth_retried)
                except _ContinueNow:
                    continue  # a new numbering on the same conversation, at once
                auth_retried = outcome.close_code == CLOSE_UNAUTHENTICATED
                faults = faults + 1 if outcome.close_code in CLIENT_FAULT_CLOSES else 0
                if faults >= MAX_CLIENT_FAULTS:
                    raise ProtocolError(
                        "the server refused this client's frames repeatedly",
                        close_code=outcome.close_code,
                    )
                delay = retries.next_delay()
                self._status(
                    ConnectionStatus("dropped", close_code=outcome.close_code, retry_in=delay)
                )
                await asyncio.sleep(delay)
        except SessionError as exc:
            self._stop(exc)
        except _Finished:
            self._stop(None)
        except Exception as exc:
            # Consumers wait on the stop; a bug here must not leave them waiting forever.
            log.exception("session client failed")
            self._stop(SessionError(f"internal error: {_describe(exc)}"))

    def _check_terminal(self, outcome: _Outcome, auth_retried: bool) -> None:
        """Raise when `outcome` ends the client; return when a resume should follow."""
        code, info = outcome.close_code, outcome.error
        kwargs: dict[str, Any] = {
            "code": info.code if info else None,
            "close_code": code,
            "details": info.details if info else None,
        }
        message = _close_message(outcome)
        if self._closing or code == CLOSE_SESSION_ENDED:
            raise _Finished()
        if self._ending and code == CLOSE_RESUME_FAILED:
            raise _Finished()  # the `end` took effect before its confirmation got lost
        if code == CLOSE_UNAUTHENTICATED and (self._credential_provider is None or auth_retried):
            raise AuthenticationError(message, **kwargs)
        if code == CLOSE_REPLACED:
            raise SessionReplacedError("a newer connection took over the session", **kwargs)
        if self.session_id is None:
            # Nothing to resume: the first connection failed, so report it as is.
            if code == CLOSE_UNAUTHENTICATED:
                return
            raise ConnectError(f"could not open the session: {message}", **kwargs)
        if code == CLOSE_RESUME_FAILED:
            if self._continue_after_restart and self._continuing is None:
                self._start_continuation()
                raise _ContinueNow()
            raise ResumeFailedError(message, **kwargs)

    async def _connect_once(self) -> _Outcome:
        """One connection, from the upgrade to its close."""
        assert self._http is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout
        try:
            credential = await self._current_credential()
        except Exception as exc:
            return _Outcome(failure=exc)
        try:
            ws = await open_socket(
                self._http,
                self.url,
                deadline,
                max_frame_bytes=self._max_frame_bytes,
                close_timeout=self._close_timeout,
                autoping=True,
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return _Outcome(failure=exc)
        core = SessionConnection(role=Role.CLIENT, timing=self._timing, now=loop.time())
        core.start(self._hello(credential), self._channel)
        link = _Link(ws, core, self._on_events, self._on_binary)
        link.credential = credential
        self._link = link
        running = asyncio.create_task(link.run())

        def forget() -> None:
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
        """Wait for `ready` until `deadline`; True once the session is (re)opened."""
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        waiting: set[asyncio.Future[Any]] = {running, link.ready}
        await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not link.ready.done():
            link.ready.cancel()
            link.abort()  # too slow, or closed before ready: `running` ends by itself
            return False
        self._opened(link.ready.result())
        if not running.done():  # ready and the close can arrive in one read
            link.start_timers()
            if self._credential_provider is not None:
                link.keep_credential_fresh(link.credential, self._credential_provider)
        return True

    def _opened(self, ready: f.Ready) -> None:
        self.ready = ready
        self.connections += 1
        continued, self._continuing = self._continuing is not None, None
        if self.session_id is None or continued:
            self.session_id = ready.session_id
            self.capabilities = ready.capabilities
        self._wire_seq = self._channel.next_seq - 1  # the core resends the backlog now
        how = "continued" if continued else "resumed" if ready.resumed else "opened"
        log.info("session %s session=%s", how, self.session_id)
        self._status(ConnectionStatus("open", resumed=ready.resumed, continued=continued))
        self._supervision.connected()

    def _hello(self, credential: str | None) -> f.Hello:
        # A registered tool replaces a declared spec of the same name.
        specs = {spec.name: spec for spec in self._tool_specs}
        specs.update((name, tool.spec) for name, tool in self._tools.items())
        common: dict[str, Any] = {
            "credential": credential,
            "agent": self._agent,
            "tools": tuple(specs.values()),
            "capabilities": self._requested,
            "audio": self._audio_offer,
        }
        if self._continuing is not None:
            # A new numbering: negotiated afresh, like an open.
            return f.Hello(continue_session=self._continuing, context=self._context, **common)
        if self.session_id is None:
            return f.Hello(context=self._context, **common)
        # Capabilities, tools and agent are fixed at open; a resume sends them for
        # completeness and the server keeps the original set.
        return f.Hello(session_id=self.session_id, last_seq=self._channel.handled, **common)

    async def _current_credential(self) -> str | None:
        if self._credential_provider is None:
            return self._credential
        return await ask(self._credential_provider)

    # -- stopping -----------------------------------------------------------------------------

    def _stop(self, error: SessionError | None) -> None:
        if self._stopped.is_set():
            return
        self._failure = error
        self._stopped.set()
        if error is not None:
            log.info("session stopped session=%s reason=%s", self.session_id, type(error).__name__)
        # Wake every consumer: the stream, turns still waiting, and connect().
        self._inbox.put_nowait(_STOP)
        for turn in {*self._turn_for_message.values(), *self._call_owner.values()}:
            turn._put(_STOP)
        for open_turn in self._open_turns.values():
            if open_turn is not None:
                open_turn._put(_STOP)
        for task in list(self._tool_tasks.values()):
            task.cancel()
        self._supervision.failed(error or SessionClosedError("closed before ready"))
        self._status(ConnectionStatus("closed", error=error))

    def _status(self, status: ConnectionStatus) -> None:
        if self._on_status is None:
            return
        try:
            self._on_status(status)
        except Exception:
            log.exception("on_status callback failed")


class _ContinueNow(Exception):
    """The resume failed and the client continues the conversation instead."""


class _Finished(Exception):
    """The session ended (`end`, 1000) or the user closed the client."""


def _close_message(outcome: _Outcome) -> str:
    if outcome.error is not None:
        return outcome.error.message
    if outcome.close_code is not None:
        return f"closed with {outcome.close_code}"
    if outcome.failure is not None:
        return _describe(outcome.failure)
    return "the connection dropped"


def _tool_spec(tool: f.ToolSpec | Mapping[str, Any]) -> f.ToolSpec:
    if isinstance(tool, f.ToolSpec):
        return tool
    return msgspec.convert(dict(tool), f.ToolSpec)


async def _consented(consent: Consent, frame: f.ToolCall) -> bool:
    try:
        answer = consent(frame)
        return bool(await answer if inspect.isawaitable(answer) else answer)
    except Exception:
        log.exception("consent callback failed; treating the call as declined")
        return False


async def _call_tool(func: ToolFunction, arguments: Mapping[str, Any]) -> Any:
    if inspect.iscoroutinefunction(func):
        return await func(**arguments)
    value = await asyncio.to_thread(func, **arguments)
    return await value if inspect.isawaitable(value) else value


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


__all__ = [
    "AudioItem",
    "AuthenticationError",
    "ConnectError",
    "ConnectionLostError",
    "ConnectionStatus",
    "ProtocolError",
    "ReconnectPolicy",
    "Reply",
    "ResumeFailedError",
    "SendBufferFullError",
    "ServerMessage",
    "SessionClient",
    "SessionClosedError",
    "SessionError",
    "SessionReplacedError",
    "Turn",
    "VoiceReply",
    "duplicate_details",
    "is_voice_turn",
    "new_message_key",
]
