"""Runs a handler for one turn and turns it into a plain stream of outputs.

A handler `await`s client tool calls from inside its generator, which an adapter
cannot intercept by iterating it; so the handler runs in a task of its own and
everything it produces, tool requests included, comes out of one queue in order.
Both adapters (the in-process plugin, the gRPC server) read this stream: the tool
request carries the future the adapter resolves with the client's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Iterable

import msgspec

from portico.agent.api import Handler, Media, Reply, ToolAnswer, ToolCaller, ToolRequest, Turn
from portico.agent.api import Usage as AgentUsage
from portico.domain.coalesce import merge_adjacent_text
from portico.domain.model import ContentPart
from portico.errors import GENERIC_INTERNAL_MESSAGE, AgentError, InternalError

log = logging.getLogger("portico.agent")
# Outputs the handler may run ahead of its adapter: enough to batch, small enough that a
# handler streaming faster than the client reads is held back.
QUEUE_DEPTH = 64


class PendingTool:
    """A tool call the handler awaits; `answer` hands it the client's answer."""

    def __init__(self, request: ToolRequest) -> None:
        self.request = request
        self.future: asyncio.Future[ToolAnswer] = asyncio.get_running_loop().create_future()

    def answer(self, answer: ToolAnswer) -> None:
        if not self.future.done():
            self.future.set_result(answer)


class Finished(msgspec.Struct, frozen=True):
    """The handler returned: the turn is done."""


class Failed(msgspec.Struct, frozen=True):
    """The handler raised: `AgentError` keeps its code, anything else is internal."""

    code: str
    message: str


TurnOutput = str | ContentPart | Media | AgentUsage | PendingTool | Finished | Failed
_REPLY_TYPES = (str, ContentPart, Media, AgentUsage)


async def run_handler(
    handler: Handler, build_turn: Callable[[ToolCaller], Turn]
) -> AsyncGenerator[TurnOutput, None]:
    """The turn's outputs in order, ending with exactly one `Finished` or `Failed`.

    Closing the stream early (the turn was stopped) cancels the handler."""
    async with contextlib.aclosing(run_handler_ready(handler, build_turn)) as batches:
        async for batch in batches:
            for output in batch:
                yield output


async def run_handler_ready(
    handler: Handler, build_turn: Callable[[ToolCaller], Turn]
) -> AsyncGenerator[tuple[TurnOutput, ...], None]:
    """`run_handler`'s outputs, each time all that is ready: it waits for the first of a
    batch only, then takes what the handler queued meanwhile, without waiting more."""
    queue: asyncio.Queue[TurnOutput] = asyncio.Queue(QUEUE_DEPTH)

    async def call_tool(request: ToolRequest) -> ToolAnswer:
        pending = PendingTool(request)
        await queue.put(pending)
        return await pending.future

    task = asyncio.create_task(_produce(handler, build_turn(call_tool), queue))
    try:
        while True:
            batch = [await queue.get()]
            while not isinstance(batch[-1], Finished | Failed) and queue.qsize():
                batch.append(queue.get_nowait())
            yield tuple(batch)
            if isinstance(batch[-1], Finished | Failed):
                return
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def merge_ready_text(outputs: Iterable[TurnOutput]) -> list[TurnOutput]:
    """Consecutive text outputs as one: never across anything else (a tool call, media,
    a part, usage, the terminal output), which keeps its place between them."""
    return merge_adjacent_text(outputs, _text_of, str)


def _text_of(output: TurnOutput) -> str | None:
    return output if isinstance(output, str) else None


async def _produce(handler: Handler, turn: Turn, queue: asyncio.Queue[TurnOutput]) -> None:
    terminal: Finished | Failed = Finished()
    try:
        async for reply in handler(turn):
            await queue.put(_checked(reply))
    except AgentError as exc:
        terminal = Failed(exc.runtime_code, exc.message)
    except Exception:
        # The traceback is for the agent's operator; the client gets a generic error.
        log.exception("agent handler raised session=%s", turn.session_id)
        terminal = Failed(InternalError.code, GENERIC_INTERNAL_MESSAGE)
    await queue.put(terminal)


def _checked(reply: Reply) -> Reply:
    if not isinstance(reply, _REPLY_TYPES):
        raise TypeError(
            f"an agent handler yields str, Part, Media or Usage, not {type(reply).__name__}"
        )
    return reply
