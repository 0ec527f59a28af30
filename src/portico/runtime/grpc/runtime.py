"""The `grpc` runtime: Portico as the facade that dials an agent runtime.

One `Converse` stream per conversation, kept between turns and opened again
when it broke; a turn writes its `ClientMessage` and reads until `TurnReader`
says the turn ended. Every read and write has a deadline of its own (first
token, then idle), never across a `yield`. A turn that did not end cleanly (the
runtime's own `done` or `error`) drops its stream, so nothing left of it can
reach the next turn. Decisions are in docs/runtime-grpc.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import grpc
import grpc.aio

from portico.config import AgentSettings
from portico.contract import runtime_pb2 as pb
from portico.domain.memory_calls import traced
from portico.runtime.base import (
    Failure,
    ResumeVerdict,
    RuntimeHealth,
    ToolCall,
    ToolOutcome,
    TurnInput,
    TurnStream,
)
from portico.runtime.grpc.channel import (
    UNDECODABLE,
    Unreachable,
    call_metadata,
    classify,
    connect,
    converse,
    credential_refusal,
    final_cause,
    open_channel,
)
from portico.runtime.grpc.mapping import (
    MemoryCall,
    Reading,
    TurnReader,
    client_message,
    tool_result,
)
from portico.runtime.grpc.memory import answer_memory_call, rejected

if TYPE_CHECKING:
    from portico.contract.runtime_pb2_grpc import RuntimeServiceAsyncStub

log = logging.getLogger("portico.runtime.grpc")

Call = grpc.aio.StreamStreamCall[pb.ClientMessage, pb.ServerMessage]
RESUME_VERDICTS: dict[int, ResumeVerdict] = {
    pb.RESUME_STATE_RESUMABLE: "resumable",
    pb.RESUME_STATE_NOT_FOUND: "not_found",
    pb.RESUME_STATE_UNAVAILABLE: "unavailable",
}


class Broken(NamedTuple):
    """The stream ended or failed; `cause` is safe to log."""

    cause: str


class _Conversation:
    """A session's `Converse` stream and the task that reads it.

    The stream is read all the time, not only during turns: what arrives while no
    turn waits (a `done` after an `error`, say) is logged and dropped, so it cannot
    be taken for the next turn's answer, and a stream that breaks between turns is
    known broken before the next turn writes to it.
    """

    def __init__(self, call: Call, *, buffer: int, stray: Callable[[str], None]) -> None:
        self.call = call
        self.idle_close: asyncio.TimerHandle | None = None
        self.in_turn = False
        self.released = False  # its session ended during the turn: closed after it
        self.inbox: asyncio.Queue[pb.ServerMessage | Broken] = asyncio.Queue(buffer)
        self._held: pb.ServerMessage | Broken | None = None  # taken from inbox, not yet read
        self._stray = stray
        self._reading = asyncio.ensure_future(self._read())

    @property
    def usable(self) -> bool:
        return not self._reading.done()

    async def _read(self) -> None:
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    await self.inbox.put(Broken("the runtime ended the stream"))
                    return
                if message is UNDECODABLE:
                    # The stream can no longer be trusted: the turn fails on it and drops
                    # it. Not cancelled here: a tool answer being written would see the
                    # cancel as its own task's.
                    await self.inbox.put(Broken("a message that is not a ServerMessage"))
                    return
                assert isinstance(message, pb.ServerMessage)
                if self.in_turn:
                    await self.inbox.put(message)
                else:
                    kind = message.WhichOneof("message") or "empty message"
                    self._stray(f"{kind} outside a turn ignored")
        except grpc.aio.AioRpcError as exc:
            await self.inbox.put(Broken(classify(exc)))
        except Exception as exc:  # a bug or a gRPC internal: the turn must still end
            log.exception("reading a grpc stream failed")
            await self.inbox.put(Broken(f"unexpected {type(exc).__name__}"))

    def ready(self) -> pb.ServerMessage | Broken | None:
        """The next message already read, if any; never waits."""
        if self._held is not None:
            held, self._held = self._held, None
            return held
        return self.inbox.get_nowait() if self.inbox.qsize() else None

    def ready_chunks(self) -> list[pb.ServerMessage]:
        """The `chunk`s already read, up to the first message that is not one (held
        for the next `ready`); never waits."""
        chunks: list[pb.ServerMessage] = []
        while (message := self.ready()) is not None:
            if isinstance(message, Broken) or message.WhichOneof("message") != "chunk":
                self._held = message
                break
            chunks.append(message)
        return chunks

    def begin_turn(self) -> None:
        self._discard_left("from before")
        self.in_turn = True

    def _discard_left(self, when: str) -> None:
        while (left := self.ready()) is not None:  # what arrived after its turn had ended
            if isinstance(left, pb.ServerMessage):
                self._stray(f"{left.WhichOneof('message') or 'empty message'} {when} ignored")

    def close(self) -> None:
        self._discard_left("after the turn's end")
        if self.idle_close is not None:
            self.idle_close.cancel()
        self._reading.cancel()
        self.call.cancel()


class GrpcRuntime:
    def __init__(self, name: str, settings: AgentSettings, *, env: Mapping[str, str]) -> None:
        assert settings.grpc_target, "check_startable() requires it"
        self._name = name
        self._settings = settings
        self._target = settings.grpc_target
        self._metadata = call_metadata(settings, env)
        self._channel: grpc.aio.Channel | None = None
        self._stub: RuntimeServiceAsyncStub | None = None
        self._conversations: dict[str, _Conversation] = {}
        self._health: tuple[float, RuntimeHealth] | None = None
        self._health_check: asyncio.Future[RuntimeHealth] | None = None

    @property
    def health_required(self) -> bool:
        return self._settings.grpc_health_required

    # -- the channel --------------------------------------------------------------------

    def _runtime_stub(self) -> RuntimeServiceAsyncStub:
        # Created in the running loop, at first use, and shared by every conversation.
        if self._stub is None:
            self._channel = open_channel(self._settings)
            self._stub = converse(self._channel)
        return self._stub

    async def _connect(self) -> RuntimeServiceAsyncStub:
        """The stub once the channel is connected, or `Unreachable` naming the cause."""
        stub = self._runtime_stub()
        assert self._channel is not None
        within = self._settings.grpc_connect_timeout
        await connect(self._channel, stub, within=within, metadata=self._metadata)
        return stub

    async def close(self) -> None:
        """At server stop: every stream, then the channel."""
        for conversation in self._conversations.values():
            conversation.close()
        self._conversations.clear()
        if self._channel is not None:
            await self._channel.close()

    # -- conversations ------------------------------------------------------------------

    async def _open_stream(self, session_id: str) -> _Conversation:
        stub = await self._connect()

        def stray(note: str) -> None:
            log.info("grpc runtime agent=%s target=%s session=%s: %s", *where, note)

        where = self._where(session_id)
        call = stub.Converse(metadata=self._metadata)
        buffer = self._settings.grpc_read_buffer_messages
        conversation = _Conversation(call, buffer=buffer, stray=stray)
        self._conversations[session_id] = conversation
        log.info("grpc stream opened agent=%s target=%s session=%s", *self._where(session_id))
        return conversation

    def _where(self, session_id: str) -> tuple[str, str, str]:
        return self._name, self._target, session_id

    def _take(self, session_id: str) -> _Conversation | None:
        """The session's open stream, if it still stands; its idle timer stops."""
        conversation = self._conversations.get(session_id)
        if conversation is None:
            return None
        if conversation.idle_close is not None:
            conversation.idle_close.cancel()
            conversation.idle_close = None
        if not conversation.usable:  # it broke between turns
            self._drop(session_id, conversation)
            return None
        return conversation

    def _drop(self, session_id: str, conversation: _Conversation) -> None:
        if self._conversations.get(session_id) is conversation:
            del self._conversations[session_id]
        conversation.close()

    def release(self, session_id: str) -> None:
        conversation = self._conversations.get(session_id)
        if conversation is None:
            return
        if conversation.in_turn:
            conversation.released = True
            return
        log.info(
            "grpc stream closed: session ended agent=%s target=%s session=%s",
            *self._where(session_id),
        )
        self._drop(session_id, conversation)

    def _keep(self, session_id: str, conversation: _Conversation) -> None:
        def expire() -> None:
            if self._conversations.get(session_id) is conversation:
                log.info(
                    "grpc stream idle, closed agent=%s target=%s session=%s",
                    *self._where(session_id),
                )
                self._drop(session_id, conversation)

        loop = asyncio.get_running_loop()
        conversation.idle_close = loop.call_later(self._settings.grpc_stream_idle_close, expire)

    # -- turns --------------------------------------------------------------------------

    async def run(self, turn: TurnInput) -> TurnStream:
        try:
            conversation, reader, reading = await self._start_turn(turn)
        except Unreachable as exc:
            self._log_failure(turn, f"runtime unreachable: {exc.cause}")
            (failure,) = TurnReader().fail("the runtime is unreachable").events
            assert isinstance(failure, Failure)
            yield failure
            return
        try:
            while True:
                self._log_reading(turn, reader, reading)
                answered: Reading | None = None
                for event in reading.events:
                    if isinstance(event, MemoryCall):  # alone in its reading
                        answer = await self._memory_call(turn, event)
                        answered = await self._answer(conversation, event.id, answer, reader)
                        break
                    if isinstance(event, ToolCall):  # alone in its reading
                        outcome = yield event
                        answered = await self._answer(conversation, event.id, outcome, reader)
                        break
                    yield event
                if answered is not None:
                    reading = answered
                elif reader.ended:
                    return
                else:
                    reading = await self._next(conversation, reader, first_token=False)
        finally:
            conversation.in_turn = False
            if reader.clean and not conversation.released:
                self._keep(turn.session_id, conversation)
            else:
                self._drop(turn.session_id, conversation)

    async def _start_turn(self, turn: TurnInput) -> tuple[_Conversation, TurnReader, Reading]:
        """Send the turn's message and read the runtime's first answer to it.

        A kept stream may have broken unnoticed between turns (the runtime restarted):
        when it breaks before anything of this turn was read, the turn is sent again,
        once, on a new stream.
        """
        opening = client_message(turn)
        kept = self._take(turn.session_id)
        if kept is not None:
            reader = TurnReader()
            reading = await self._first_reading(turn.session_id, kept, opening, reader)
            if not reader.broken:
                return kept, reader, reading
            self._log_note(turn, f"kept stream unusable ({reading.note}); opening a new one")
            self._drop(turn.session_id, kept)
        conversation = await self._open_stream(turn.session_id)
        reader = TurnReader()
        reading = await self._first_reading(turn.session_id, conversation, opening, reader)
        return conversation, reader, reading

    async def _first_reading(
        self,
        session_id: str,
        conversation: _Conversation,
        opening: pb.ClientMessage,
        reader: TurnReader,
    ) -> Reading:
        try:
            return await self._send_and_read(conversation, opening, reader)
        except BaseException:
            # Stopped before the turn had begun (a user's stop, a shutdown): the runtime
            # may be mid-turn on this stream, which must not carry the next one.
            self._drop(session_id, conversation)
            raise

    async def _send_and_read(
        self, conversation: _Conversation, message: pb.ClientMessage, reader: TurnReader
    ) -> Reading:
        conversation.begin_turn()
        failed = await self._write(conversation, message, reader)
        if failed is not None:
            return failed
        return await self._next(conversation, reader, first_token=True)

    async def _answer(
        self,
        conversation: _Conversation,
        call_id: str,
        outcome: ToolOutcome | None,
        reader: TurnReader,
    ) -> Reading:
        failed = await self._write(conversation, tool_result(call_id, outcome), reader)
        if failed is not None:
            return failed
        return await self._next(conversation, reader, first_token=True)

    async def _memory_call(self, turn: TurnInput, call: MemoryCall) -> ToolOutcome:
        """Answered here from the turn's memory, never forwarded to the client, not
        archived as a client tool call; traced as a server tool's outcome."""
        memory = traced(turn.memory, turn.tool_outcome)
        try:
            async with asyncio.timeout(self._settings.stream_idle_timeout):
                outcome = await answer_memory_call(memory, call)
        except TimeoutError:
            outcome = rejected("the agent memory did not answer in time")
        if outcome.status == "denied":
            self._log_note(turn, f"memory call rejected: {outcome.error}")
        return outcome

    async def _write(
        self, conversation: _Conversation, message: pb.ClientMessage, reader: TurnReader
    ) -> Reading | None:
        try:
            # `asyncio.timeout`, not `wait_for`: no task of its own per write.
            async with asyncio.timeout(self._settings.stream_idle_timeout):
                await conversation.call.write(message)
        except TimeoutError:
            return reader.fail("the runtime did not read the turn's message in time")
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            cause = "stream closed"
            if isinstance(exc, grpc.aio.AioRpcError):  # the call ended: its status is due
                within = self._settings.grpc_connect_timeout
                stub, metadata = self._runtime_stub(), self._metadata

                async def probe() -> str | None:
                    return await credential_refusal(stub, metadata, within)

                cause = await final_cause(
                    conversation.call, classify(exc), within=within, probe=probe
                )
            return reader.fail(f"stream broken: {cause}", broken=True)
        return None

    async def _next(
        self, conversation: _Conversation, reader: TurnReader, *, first_token: bool
    ) -> Reading:
        """The next message's reading; a silence past its timeout or a broken stream
        is a failure reading."""
        settings = self._settings
        timeout = settings.first_token_timeout if first_token else settings.stream_idle_timeout
        try:
            # A message already read is taken at once; else a deadline without a task of
            # its own (`wait_for` wraps the `get` in one).
            message = conversation.ready()
            if message is None:
                async with asyncio.timeout(timeout):
                    message = await conversation.inbox.get()
        except TimeoutError:
            kind = "first message" if first_token else "next message"
            return reader.fail(f"no {kind} from the runtime within {timeout:g}s")
        if isinstance(message, Broken):
            return reader.fail(f"stream broken: {message.cause}", broken=True)
        if message.WhichOneof("message") != "chunk":
            return reader.receive(message)
        # Chunks read meanwhile are handed on with it, as one (docs/runtime-grpc.md).
        return reader.receive_ready([message, *conversation.ready_chunks()])

    def _log_reading(self, turn: TurnInput, reader: TurnReader, reading: Reading) -> None:
        if not reading.note:
            return
        if reader.ended and not reader.clean and reading.events:
            self._log_failure(turn, reading.note)
        else:
            self._log_note(turn, reading.note)

    def _log_note(self, turn: TurnInput, note: str) -> None:
        log.info(
            "grpc runtime agent=%s target=%s session=%s turn=%s: %s",
            self._name,
            self._target,
            turn.session_id,
            turn.turn_id,
            note,
        )

    def _log_failure(self, turn: TurnInput, why: str) -> None:
        log.warning(
            "grpc turn failed agent=%s target=%s session=%s turn=%s: %s",
            self._name,
            self._target,
            turn.session_id,
            turn.turn_id,
            why,
        )

    # -- resume and health --------------------------------------------------------------

    async def has_conversation(self, session_id: str) -> ResumeVerdict:
        stub = self._runtime_stub()
        try:
            answer = await stub.HasConversation(
                pb.HasConversationRequest(session_id=session_id),
                timeout=self._settings.grpc_connect_timeout,
                metadata=self._metadata,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                return "unknown"
            log.warning(
                "grpc HasConversation failed agent=%s target=%s session=%s cause=%s",
                *self._where(session_id),
                classify(exc),
            )
            return "unavailable"
        return RESUME_VERDICTS.get(answer.state, "unknown")

    async def health(self) -> RuntimeHealth:
        """The runtime's `Health`, reused for `grpc_health_interval`; one call at a time."""
        now = time.monotonic()
        if self._health is not None and now - self._health[0] < self._settings.grpc_health_interval:
            return self._health[1]
        if self._health_check is None or self._health_check.done():
            self._health_check = asyncio.ensure_future(self._check_health())
        return await asyncio.shield(self._health_check)

    async def _check_health(self) -> RuntimeHealth:
        stub = self._runtime_stub()
        try:
            # Not waiting for a connection: a call fails at once while gRPC cannot
            # connect, naming why.
            answer = await stub.Health(
                pb.HealthRequest(),
                timeout=self._settings.grpc_health_timeout,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            found = RuntimeHealth(healthy=False, reason=f"unreachable: {classify(exc)}")
        else:
            reason = "" if answer.healthy else answer.status or "the runtime reports unhealthy"
            found = RuntimeHealth(healthy=answer.healthy, reason=reason[:200])
        self._health = (time.monotonic(), found)
        if not found.healthy:
            log.warning(
                "grpc runtime unhealthy agent=%s target=%s: %s",
                self._name,
                self._target,
                found.reason,
            )
        return found


def build(name: str, settings: AgentSettings) -> GrpcRuntime:
    # The token is read from the environment here, so it never sits in the settings.
    return GrpcRuntime(name, settings, env=os.environ)
