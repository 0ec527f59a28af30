"""The `grpc` duplex runtime: a voice call over the runtime contract's duplex half.

One `Converse` stream per call (spec/runtime-contract.md: "a separate one per duplex
audio session"), on a channel made exactly as the text runtime makes its own
(`runtime/grpc/channel.py`: TLS, bearer token, backoff, message limit). The stream
opens with `duplex_start`, caller frames go out as `audio_input`, and what comes back
is mapped by the sans-I/O `CallReader` (`grpc_mapping.py`). A task reads the stream
into a bounded inbox (a full one stops reading: gRPC flow control holds the runtime),
and `events()` takes from it with the deadline the reader names (agent audio arriving
while `events()` waits with nothing unread is mapped by that task and handed over
instead: base.py `EventQueue`), so a silence, a
broken stream, a malformed message and a runtime's `error` each end the call with one
`DuplexFailure`, and `close()` ends it at once. Decisions: docs/runtime-grpc.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import grpc
import grpc.aio

from portico.config import AgentSettings
from portico.contract import runtime_pb2 as pb
from portico.contract.runtime_pb2_grpc import RuntimeServiceStub
from portico.runtime.duplex.base import (
    AudioIn,
    DuplexCall,
    DuplexEvent,
    DuplexFailure,
    DuplexStart,
    EventQueue,
    EventTaker,
    FailedCall,
)
from portico.runtime.duplex.grpc_mapping import (
    BROKEN,
    DUPLEX_ERROR,
    SILENT,
    UNREACHABLE,
    CallReader,
    Reading,
    audio_input,
    duplex_start,
)
from portico.runtime.grpc.channel import (
    Unreachable,
    call_metadata,
    classify,
    connect,
    credential_refusal,
    final_cause,
    open_channel,
)

if TYPE_CHECKING:
    from portico.contract.runtime_pb2_grpc import RuntimeServiceAsyncStub

log = logging.getLogger("portico.runtime.grpc")

Stream = grpc.aio.StreamStreamCall[pb.ClientMessage, pb.ServerMessage]
WRITE_ERRORS = (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError)


class Broken(NamedTuple):
    cause: str


class WriteFailed(NamedTuple):
    why: str


class _Marker(NamedTuple):
    name: str


ENDED = _Marker("ended")  # the runtime ended the stream, status OK
CLOSED = _Marker("closed")  # the facade closed the call
WAKE = _Marker("wake")  # the reader's deadline changed (the caller's last audio went out)
# What the reading task queues; a `Reading` is a message it mapped itself (`_hand_over`).
Inbox = pb.ServerMessage | Reading | Broken | WriteFailed | _Marker


class GrpcDuplexCall:
    """One call's stream: `send` writes `audio_input`, `events` maps what comes back."""

    def __init__(
        self,
        stream: Stream,
        start: DuplexStart,
        settings: AgentSettings,
        where: tuple[str, str, str],
        on_end: Callable[[GrpcDuplexCall], None] = lambda call: None,
        probe: Callable[[], Awaitable[str | None]] | None = None,
    ) -> None:
        self._stream = stream
        self._probe = probe  # names a credential refusal that grpc.aio reports as INTERNAL
        self._on_end = on_end
        self._session_id = start.session_id
        self._settings = settings
        self._where = where  # agent, target, session: for the log
        self._reader = CallReader(start.format)
        self._inbox: EventQueue[Inbox] = EventQueue(settings.grpc_read_buffer_messages)
        self._deadline: asyncio.Timeout | None = None  # `events()` waiting: its silence
        self._waited: float | None = None  # ...and that deadline's length
        self._write_lock = asyncio.Lock()
        self._closed = False
        self._caller_done = False  # `is_last` went out: later audio is ignored
        self._pump = asyncio.ensure_future(self._read())

    # -- facade to runtime ----------------------------------------------------------------

    async def open(self, start: DuplexStart) -> None:
        await self._write(duplex_start(start), "duplex_start")

    async def send(self, audio: AudioIn) -> None:
        if self._closed or self._caller_done:
            return  # the caller may still be talking after the call ended
        self._caller_done = audio.is_last
        await self._write(audio_input(self._session_id, audio), "the caller's audio")
        if audio.is_last:
            async with self._write_lock:
                if not self._closed:
                    with contextlib.suppress(*WRITE_ERRORS):
                        await self._stream.done_writing()
            self._reader.caller_finished()
            if not self._inbox.full():  # else `events` is woken by what fills it
                self._inbox.put(WAKE)

    async def _write(self, message: pb.ClientMessage, what: str) -> None:
        idle = self._settings.stream_idle_timeout
        async with self._write_lock:
            if self._closed:
                return
            try:
                async with asyncio.timeout(idle):
                    await self._stream.write(message)
            except TimeoutError:
                self._end_with(WriteFailed(f"the runtime did not read {what} within {idle:g}s"))
            except WRITE_ERRORS:
                pass  # the stream ended or broke: its reader reports how

    # -- runtime to facade ----------------------------------------------------------------

    async def _read(self) -> None:
        try:
            while True:
                message = await self._stream.read()
                if message is grpc.aio.EOF:
                    await self._inbox.put_wait(ENDED)
                    return
                assert isinstance(message, pb.ServerMessage)
                if not self._hand_over(message):
                    await self._inbox.put_wait(message)
        except grpc.aio.AioRpcError as exc:
            within = self._settings.grpc_connect_timeout
            cause = await final_cause(self._stream, classify(exc), within=within, probe=self._probe)
            await self._inbox.put_wait(Broken(cause))
        except Exception as exc:  # a bug or a gRPC internal: the call must still end
            log.exception("reading a grpc duplex stream failed")
            await self._inbox.put_wait(Broken(f"unexpected {type(exc).__name__}"))

    def hand_over(self, taker: EventTaker) -> None:
        """Agent audio `events()` would be woken for goes to `taker` (base.py)."""
        self._inbox.hand_over(taker)

    def _hand_over(self, message: pb.ServerMessage) -> bool:
        """While `events()` waits with nothing unread, `message` is the next it would
        read: mapped here, its events are offered to the taker; what is left (events not
        taken, replies to write, the call's end) goes to `events()` as the `Reading`.
        False: not mapped (nobody takes now), the message is queued as it came."""
        if not self._inbox.taking:
            return False
        reading = self._reader.receive(message)
        self._log(reading)
        events, taken = reading.events, 0
        if not reading.replies:  # written by `events()` before its events go on
            while taken < len(events) and self._inbox.offer(events[taken]):
                taken += 1
        if taken < len(events) or reading.replies or self._reader.ended:
            self._inbox.put(Reading(events[taken:], reading.replies))
        else:
            self._restart_deadline()  # it read a message, as `events()` would have
        return True

    def _restart_deadline(self) -> None:
        deadline = self._deadline
        if deadline is None:
            return
        self._waited = self._timeout()
        at = None if self._waited is None else asyncio.get_running_loop().time() + self._waited
        deadline.reschedule(at)

    def events(self) -> AsyncIterator[DuplexEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[DuplexEvent]:
        try:
            while not self._reader.ended:
                reading = await self._next()
                self._log(reading)
                for reply in reading.replies:
                    await self._write(reply, "a client tool result")
                for event in reading.events:
                    yield event
        finally:
            await self.close()

    def _timeout(self) -> float | None:
        settings = self._settings
        return {
            "hello": settings.first_token_timeout,
            "turn": settings.stream_idle_timeout,
            "ending": settings.first_token_timeout,
        }.get(self._reader.wait())

    async def _next(self) -> Reading:
        self._waited = self._timeout()
        try:
            async with asyncio.timeout(self._waited) as self._deadline:
                item = await self._inbox.get()
        except TimeoutError:
            assert self._waited is not None
            return self._reader.silence(self._waited)
        finally:
            self._deadline = None
        if isinstance(item, pb.ServerMessage):
            return self._reader.receive(item)
        if isinstance(item, Reading):
            return item  # mapped (and logged) by the reading task
        if isinstance(item, Broken):
            return self._reader.fail(BROKEN, f"stream broken: {item.cause}")
        if isinstance(item, WriteFailed):
            return self._reader.fail(SILENT, item.why)
        if item is ENDED:
            return self._reader.stream_ended()
        if item is CLOSED:
            self._reader.closed()
        return Reading()

    def _log(self, reading: Reading) -> None:
        if not reading.note:
            return
        if any(isinstance(event, DuplexFailure) for event in reading.events):
            log.warning(
                "grpc call failed agent=%s target=%s session=%s: %s", *self._where, reading.note
            )
        else:
            log.info("grpc call agent=%s target=%s session=%s: %s", *self._where, reading.note)

    # -- the end --------------------------------------------------------------------------

    async def close(self) -> None:
        self._end_with(CLOSED)

    def _end_with(self, last: Inbox) -> None:
        """Stop the stream and the reading task; `last` is the one thing left to read."""
        if self._closed:
            return
        self._closed = True
        self._on_end(self)
        self._pump.cancel()  # it puts nothing more: the inbox is this method's now
        self._stream.cancel()
        self._inbox.clear()
        self._inbox.end(last)


class GrpcDuplexRuntime:
    """Calls to one agent's runtime, over a channel of their own."""

    def __init__(self, name: str, settings: AgentSettings, *, env: Mapping[str, str]) -> None:
        assert settings.grpc_target, "check_startable() requires it"
        self._name = name
        self._settings = settings
        self._metadata = call_metadata(settings, env)
        self._channel: grpc.aio.Channel | None = None
        self._stub: RuntimeServiceAsyncStub | None = None
        self._calls: set[GrpcDuplexCall] = set()

    def _runtime_stub(self) -> tuple[grpc.aio.Channel, RuntimeServiceAsyncStub]:
        # Made in the running loop, at the first call, and shared by every call.
        if self._channel is None or self._stub is None:
            self._channel = open_channel(self._settings)
            self._stub = RuntimeServiceStub(self._channel)
        return self._channel, self._stub

    async def start(self, start: DuplexStart) -> DuplexCall:
        channel, stub = self._runtime_stub()
        where = (self._name, self._settings.grpc_target or "", start.session_id)
        try:
            within = self._settings.grpc_connect_timeout
            await connect(channel, stub, within=within, metadata=self._metadata)
        except Unreachable as exc:
            log.warning(
                "grpc call failed agent=%s target=%s session=%s: runtime unreachable: %s",
                *where,
                exc.cause,
            )
            return FailedCall(DuplexFailure(DUPLEX_ERROR, UNREACHABLE))
        stream = stub.Converse(metadata=self._metadata)
        metadata, within = self._metadata, self._settings.grpc_connect_timeout

        async def probe() -> str | None:
            return await credential_refusal(stub, metadata, within)

        call = GrpcDuplexCall(
            stream, start, self._settings, where, on_end=self._calls.discard, probe=probe
        )
        self._calls.add(call)
        try:
            await call.open(start)
        except BaseException:
            await call.close()  # stopped while opening: the stream must not stay open
            raise
        log.info("grpc call opened agent=%s target=%s session=%s", *where)
        return call

    async def close(self) -> None:
        """At server stop: the calls still live end (as by their own `close()`: no
        failure), then the channel closes."""
        for call in list(self._calls):
            await call.close()
        if self._channel is not None:
            await self._channel.close()


def build(name: str, settings: AgentSettings) -> GrpcDuplexRuntime:
    # The token is read from the environment here, so it never sits in the settings.
    return GrpcDuplexRuntime(name, settings, env=os.environ)
