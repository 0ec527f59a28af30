"""`portico agent serve`: one handler served as `omnia.runtime.v1.RuntimeService`.

The server side of exactly the contract `runtime: grpc` dials (and Omnia's facade):
one `Converse` stream per conversation; per turn a `ClientMessage` with content,
answered by `chunk`, `tool_call` (execution CLIENT), `media_chunk` and exactly one
`done` or `error`; a `client_tool_result` answers a `tool_call`. `Health` and
`HasConversation` are served from what the agent holds. Needs the `grpc` extra.

Rules where the contract is silent (docs/agents.md, "The contract"):
- turns of one stream run one at a time, in the order their messages arrived: content
  that arrives while a turn runs waits for that turn's terminal message (at most
  `max_queued_turns` wait; past that the stream is not read until one starts);
- a `client_tool_result` whose `call_id` matches no call the running turn waits for
  (late, or made up) is dropped and logged; the turn carries on;
- a stream opening with `duplex_start` is a voice call, served to the voice handler
  (`voice_server.py`); without one, or later on a text stream, `duplex_start` is
  answered with one `error` `DUPLEX_ERROR`;
- an unanswered tool call becomes `ToolRejected("timed out")` after
  `client_tool_timeout` (a `turn.memory` call: `memory_timeout`), and
  `ToolRejected("the stream closed")` when the facade closes its side first;
- `turn.memory` is a `RemoteMemory` when the turn's metadata carries Portico's offer
  (`portico.memory`, removed from what the handler sees), else None.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import msgspec

from portico.agent.api import (
    Handler,
    HistoryMessage,
    Media,
    ToolCaller,
    ToolRejected,
    ToolResult,
    Turn,
    client_error_of,
    media_pieces,
)
from portico.agent.api import Usage as AgentUsage
from portico.agent.options import AgentOptions
from portico.agent.pump import (
    Failed,
    Finished,
    PendingTool,
    TurnOutput,
    merge_ready_text,
    run_handler_ready,
)
from portico.agent.remote_memory import RemoteMemory
from portico.agent.voice import VoiceHandler
from portico.agent.voice_server import serve_voice_call
from portico.contract import runtime_pb2 as pb
from portico.contract import runtime_pb2_grpc as pb_grpc
from portico.domain.memory_calls import CAPABILITY as MEMORY_CAPABILITY
from portico.domain.memory_calls import OFFER_KEY, OFFERED, is_memory_call
from portico.domain.model import ContentPart, new_id, text_of_parts
from portico.errors import ConfigError

log = logging.getLogger("portico.agent")
CONTRACT_VERSION = "1.3.0"
CAPABILITIES = ("text", "client_tools", "media", "parts", MEMORY_CAPABILITY)
VOICE_CAPABILITIES = ("duplex_audio",)  # with a voice handler


class Memory:
    """The conversations this agent answered, as history for their next turns.

    The contract carries no history, so the agent keeps it: in memory, bounded by
    conversations (least recently used go first) and by messages per conversation.
    It is lost when the process restarts; `HasConversation` then says NOT_FOUND."""

    def __init__(self, *, max_conversations: int, max_messages: int) -> None:
        self._max_conversations = max_conversations
        self._max_messages = max_messages
        self._sessions: OrderedDict[str, deque[HistoryMessage]] = OrderedDict()

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def messages(self, session_id: str) -> tuple[HistoryMessage, ...]:
        return tuple(self._sessions.get(session_id, ()))

    def append(self, session_id: str, *messages: HistoryMessage) -> None:
        held = self._sessions.get(session_id)
        if held is None:
            held = self._sessions[session_id] = deque(maxlen=self._max_messages)
        self._sessions.move_to_end(session_id)
        held.extend(messages)
        while len(self._sessions) > self._max_conversations:
            self._sessions.popitem(last=False)


class AgentService(pb_grpc.RuntimeServiceServicer):
    def __init__(
        self,
        handler: Handler,
        options: AgentOptions | None = None,
        *,
        voice: VoiceHandler | None = None,
    ) -> None:
        self._handler = handler
        self._voice = voice
        self._options = options or AgentOptions()
        self._memory = Memory(
            max_conversations=self._options.max_conversations,
            max_messages=self._options.max_history_messages,
        )
        self._streams: set[_Stream] = set()

    # grpc.aio also takes a coroutine that writes through `context.write` (the stubs
    # know only iterators): the turn's writes then wait for flow control, no queue.
    async def Converse(  # type: ignore[override]  # noqa: N802 (the contract's name)
        self, request_iterator: AsyncIterator[pb.ClientMessage], context: Any
    ) -> None:
        # The first message tells a voice call (`duplex_start`, docs/agents.md "Voice")
        # from a conversation of text turns.
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.HasField("duplex_start") and self._voice is not None:
            await serve_voice_call(
                self._voice, first, request_iterator, context.write, self._options
            )
            return
        stream = _Stream(self._handler, self._memory, self._options, context.write)
        self._streams.add(stream)
        try:
            await stream.run(_prepended(first, request_iterator))
        finally:
            self._streams.discard(stream)

    def drain(self) -> None:
        """Stopping: every stream ends after the turns it has (idle ones at once)."""
        for stream in list(self._streams):
            stream.drain()

    async def Invoke(  # noqa: N802
        self, request: pb.InvocationRequest, context: Any
    ) -> pb.InvocationResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this agent answers Converse only")
        raise AssertionError("abort raises")

    async def Health(  # noqa: N802
        self, request: pb.HealthRequest, context: Any
    ) -> pb.HealthResponse:
        return pb.HealthResponse(
            healthy=True,
            status="SERVING",
            contract_version=CONTRACT_VERSION,
            capabilities=CAPABILITIES + (VOICE_CAPABILITIES if self._voice else ()),
        )

    async def HasConversation(  # noqa: N802
        self, request: pb.HasConversationRequest, context: Any
    ) -> pb.HasConversationResponse:
        if request.session_id in self._memory:
            return pb.HasConversationResponse(state=pb.RESUME_STATE_RESUMABLE)
        return pb.HasConversationResponse(
            state=pb.RESUME_STATE_NOT_FOUND, detail="this agent holds no such conversation"
        )


Write = Callable[[pb.ServerMessage], Any]


async def _prepended(
    first: pb.ClientMessage, rest: AsyncIterator[pb.ClientMessage]
) -> AsyncIterator[pb.ClientMessage]:
    yield first
    async for message in rest:
        yield message


class _Stream:
    """One `Converse` stream: a reader task routes messages, turns run here in order."""

    def __init__(self, handler: Handler, memory: Memory, options: AgentOptions, write: Write):
        self._handler = handler
        self._memory = memory
        self._options = options
        self._write = write
        self._pending: dict[str, PendingTool] = {}
        self._queue: asyncio.Queue[pb.ClientMessage | None] = asyncio.Queue(
            options.max_queued_turns
        )
        self._session_id = ""
        self._closed = False
        self._draining = False

    def drain(self) -> None:
        self._draining = True
        if self._queue.empty():
            self._queue.put_nowait(None)  # wakes an idle stream: it ends now

    async def run(self, requests: AsyncIterator[pb.ClientMessage]) -> None:
        reader = asyncio.create_task(self._read(requests))
        try:
            while (message := await self._queue.get()) is not None:
                if message.HasField("duplex_start"):
                    await self._send_error("DUPLEX_ERROR", "this agent does not take duplex audio")
                else:
                    await self._turn(message)
                if self._draining and self._queue.empty():
                    return
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[pb.ClientMessage]) -> None:
        try:
            async for message in requests:
                if message.HasField("client_tool_result"):
                    self._answer_tool(message.client_tool_result)
                elif message.HasField("audio_input"):
                    log.warning("audio_input on a text stream dropped session=%s", self._session_id)
                else:
                    await self._queue.put(message)
        finally:
            # The facade closed its side: queued turns still run; nobody answers tools.
            self._closed = True
            for pending in list(self._pending.values()):
                pending.answer(ToolRejected("the stream closed"))
            await self._queue.put(None)

    def _answer_tool(self, result: pb.ClientToolResult) -> None:
        pending = self._pending.pop(result.call_id, None)
        if pending is None:
            log.warning("tool result for no waiting call dropped session=%s", self._session_id)
            return
        if result.is_rejected:
            pending.answer(ToolRejected(result.rejection_reason))
            return
        try:
            value = json.loads(result.result_json) if result.result_json else None
        except ValueError:
            pending.answer(ToolRejected("the client's result is not JSON"))
            return
        error = client_error_of(value)
        pending.answer(ToolResult(value) if error is None else ToolRejected(error))

    async def _turn(self, message: pb.ClientMessage) -> None:
        self._session_id = session_id = message.session_id or self._session_id
        try:
            parts = tuple(_part_from_wire(part) for part in message.parts)
        except msgspec.ValidationError as exc:
            await self._send_error("INVALID_MESSAGE", f"parts: {exc}")
            return
        text = message.content or text_of_parts(parts)
        earlier = self._memory.messages(session_id)
        reply = _Reply()
        try:
            await self._answer(reply, self._build_turn(message, session_id, text, parts, earlier))
        finally:
            # Remembered as Portico archives a reply (what an in-process handler's
            # history reads): with the text streamed so far even when the turn failed,
            # and not at all when it produced neither text nor parts.
            user = HistoryMessage(role="user", content=text, parts=parts)
            content = "".join(reply.texts)
            if content or reply.parts:
                assistant = HistoryMessage(
                    role="assistant", content=content, parts=tuple(reply.parts)
                )
                self._memory.append(session_id, user, assistant)
            else:
                self._memory.append(session_id, user)

    def _build_turn(
        self,
        message: pb.ClientMessage,
        session_id: str,
        text: str,
        parts: tuple[ContentPart, ...],
        earlier: tuple[HistoryMessage, ...],
    ) -> Callable[[ToolCaller], Turn]:
        async def history() -> tuple[HistoryMessage, ...]:
            return earlier

        metadata = dict(message.metadata)
        # Only Portico's facade answers memory calls, and says so per turn; behind another
        # (Omnia's) they would reach the client as tool calls, so there is no memory.
        offered = metadata.pop(OFFER_KEY, None) == OFFERED

        def build(call_tool: ToolCaller) -> Turn:
            return Turn(
                session_id=session_id,
                text=text,
                parts=parts,
                metadata=metadata,
                consent_grants=tuple(message.consent_grants),
                history=history,
                call_tool=call_tool,
                memory=RemoteMemory(call_tool) if offered else None,
            )

        return build

    async def _answer(self, reply: _Reply, build: Callable[[ToolCaller], Turn]) -> None:
        # What the handler yielded while the previous write was in flight is ready
        # at once: its consecutive text leaves as one `chunk` (docs/agents.md).
        async with contextlib.aclosing(run_handler_ready(self._handler, build)) as batches:
            async for batch in batches:
                for output in merge_ready_text(batch):
                    for message in self._on_output(reply, output):
                        await self._write(message)

    def _on_output(self, reply: _Reply, output: TurnOutput) -> list[pb.ServerMessage]:
        if isinstance(output, str):
            reply.texts.append(output)
            return [pb.ServerMessage(chunk=pb.Chunk(content=output))]
        if isinstance(output, PendingTool):
            return [self._tool_call(output)]
        if isinstance(output, Finished):
            return [pb.ServerMessage(done=reply.done())]
        if isinstance(output, Failed):
            return [_error(output.code, output.message)]
        if isinstance(output, Media):
            return _media_chunks(output)
        if isinstance(output, AgentUsage):
            reply.add_usage(output)
        else:
            reply.parts.append(output)
        return []

    def _tool_call(self, pending: PendingTool) -> pb.ServerMessage:
        call_id = new_id("call")
        if self._closed:
            pending.answer(ToolRejected("the stream closed"))
        else:
            self._pending[call_id] = pending
            self._expire_later(call_id, pending)
        request = pending.request
        return pb.ServerMessage(
            tool_call=pb.ToolCall(
                id=call_id,
                name=request.name,
                arguments_json=json.dumps(request.arguments, separators=(",", ":")),
                execution=pb.TOOL_EXECUTION_CLIENT,
                consent_message=request.consent_message,
                categories=request.categories,
            )
        )

    def _expire_later(self, call_id: str, pending: PendingTool) -> None:
        options = self._options
        memory = is_memory_call(pending.request.name)
        timeout = options.memory_timeout if memory else options.client_tool_timeout
        timer = (
            None
            if timeout is None
            else asyncio.get_running_loop().call_later(
                timeout, pending.answer, ToolRejected("timed out")
            )
        )

        def forget(_: object) -> None:
            self._pending.pop(call_id, None)
            if timer is not None:
                timer.cancel()

        pending.future.add_done_callback(forget)

    async def _send_error(self, code: str, message: str) -> None:
        await self._write(_error(code, message))


class _Reply:
    """What a turn's `done` carries, gathered while the handler streams."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.parts: list[ContentPart] = []
        self.input_tokens = 0
        self.output_tokens = 0
        self.cost_usd = 0.0

    def add_usage(self, usage: AgentUsage) -> None:
        self.input_tokens += usage.input_tokens
        self.output_tokens += usage.output_tokens
        self.cost_usd += usage.cost_usd

    def done(self) -> pb.Done:
        return pb.Done(
            final_content="".join(self.texts),
            usage=pb.Usage(
                input_tokens=self.input_tokens,
                output_tokens=self.output_tokens,
                cost_usd=self.cost_usd,
            ),
            parts=[_part_to_wire(part) for part in self.parts],
        )


def _error(code: str, message: str) -> pb.ServerMessage:
    return pb.ServerMessage(error=pb.Error(code=code, message=message))


def _media_chunks(media: Media) -> list[pb.ServerMessage]:
    media_id = media.media_id or new_id("media")
    return [
        pb.ServerMessage(
            media_chunk=pb.MediaChunk(
                media_id=media_id,
                sequence=sequence,
                is_last=is_last,
                mime_type=media.mime_type,
                data=data,
            )
        )
        for sequence, is_last, data in media_pieces(media)
    ]


def _part_from_wire(part: pb.ContentPart) -> ContentPart:
    raw: dict[str, Any] = {"type": part.type}
    if part.text:
        raw["text"] = part.text
    if part.HasField("media"):
        media = part.media
        fields = {
            "mime_type": media.mime_type,
            "data": media.data,
            "url": media.url,
            "storage_ref": media.storage_ref,
        }
        raw["media"] = {key: value for key, value in fields.items() if value}
    return msgspec.convert(raw, ContentPart)


def _part_to_wire(part: ContentPart) -> pb.ContentPart:
    wire = pb.ContentPart(type=part.type, text=part.text or "")
    if part.media is not None:
        media = part.media
        wire.media.CopyFrom(
            pb.MediaContent(
                data=media.data or "",
                url=media.url or "",
                mime_type=media.mime_type,
                storage_ref=media.storage_ref or "",
            )
        )
    return wire


async def serve_agent(
    handler: Handler,
    *,
    host: str = "127.0.0.1",
    port: int = 50051,
    options: AgentOptions | None = None,
    on_ready: Callable[[str], None] = print,
    voice: VoiceHandler | None = None,
) -> None:
    """Serve `handler` (and `voice` for calls) until SIGTERM or SIGINT, then let running
    turns and calls finish (`grace`)."""
    options = options or AgentOptions()
    server = grpc.aio.server()
    service = AgentService(handler, options, voice=voice)
    pb_grpc.add_RuntimeServiceServicer_to_server(service, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        raise ConfigError(f"cannot bind {host}:{port}: {exc}") from exc
    if bound == 0:
        raise ConfigError(f"cannot bind {host}:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    on_ready(f"Portico agent serving grpc://{host}:{bound} (omnia.runtime.v1.RuntimeService)")
    await stop.wait()
    log.info("agent stopping: running turns get %.1f s", options.grace)
    # Streams stay open between turns (one per conversation): ending the idle ones now
    # lets the process exit once the running turns are done, not after the whole grace.
    stopped = asyncio.ensure_future(server.stop(options.grace))
    service.drain()
    await stopped
