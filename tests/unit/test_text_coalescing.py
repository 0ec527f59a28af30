"""Text ready together crosses the gRPC hop as one chunk (docs/runtime-grpc.md, "Chunk
boundaries"): on the agent's side what the handler queued during a write, on the
facade's side the `chunk` messages already read. Only adjacent text merges, and
nothing ever waits for more."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from portico.agent import Reply, Turn
from portico.agent.api import Media, ToolRequest
from portico.agent.api import Usage as AgentUsage
from portico.agent.pump import (
    Failed,
    Finished,
    PendingTool,
    TurnOutput,
    merge_ready_text,
    run_handler_ready,
)
from portico.contract import runtime_pb2 as pb
from portico.domain.coalesce import merge_adjacent_text
from portico.domain.model import ContentPart
from portico.runtime.base import Chunk, Done, Failure, ToolCall
from portico.runtime.grpc.mapping import TurnReader
from portico.runtime.grpc.runtime import Broken, _Conversation

Out = pb.ServerMessage
DEADLINE = 5.0


def chunk(text: str) -> Out:
    return Out(chunk=pb.Chunk(content=text))


def client_call() -> Out:
    return Out(tool_call=pb.ToolCall(id="c1", name="t", execution=pb.TOOL_EXECUTION_CLIENT))


def done() -> Out:
    return Out(done=pb.Done(final_content="abc"))


# -- the merge itself ------------------------------------------------------------------------


def text(item: object) -> str | None:
    return item if isinstance(item, str) else None


def test_runs_of_text_merge_and_everything_else_keeps_its_place() -> None:
    items: list[object] = ["a", "b", 1, "c", 2, 3, "d", "e", "f"]
    assert merge_adjacent_text(items, text, str) == ["ab", 1, "c", 2, 3, "def"]


def test_a_run_of_one_is_the_item_itself_and_empty_input_is_empty() -> None:
    alone = ["x"]
    assert merge_adjacent_text(alone, text, lambda s: "never called") == ["x"]
    assert merge_adjacent_text([], text, str) == []


# -- the agent's side: outputs the handler queued ----------------------------------------------


async def test_the_agent_merges_text_never_across_anything_else() -> None:
    pending = PendingTool(ToolRequest(name="t", arguments={}))
    part = ContentPart(type="text", text="p")
    media = Media(mime_type="image/png", data=b"x")
    usage = AgentUsage(input_tokens=1)
    outputs: list[TurnOutput] = [
        "a", "b", pending, "c", "d", media, "e", "f", part, "g", "h", usage, "i", "j", Finished()
    ]  # fmt: skip
    assert merge_ready_text(outputs) == [
        "ab", pending, "cd", media, "ef", part, "gh", usage, "ij", Finished()
    ]  # fmt: skip
    assert merge_ready_text(["a", "b", Failed("X", "m")]) == ["ab", Failed("X", "m")]


async def collect(batches: AsyncIterator[tuple[TurnOutput, ...]]) -> list[tuple[Any, ...]]:
    return [batch async for batch in batches]


async def test_what_the_handler_yielded_at_once_is_one_batch_one_chunk() -> None:
    async def handler(turn: Turn) -> AsyncIterator[Reply]:
        for word in ("one ", "two ", "three"):
            yield word

    batches = await asyncio.wait_for(collect(run_handler_ready(handler, turn_of)), DEADLINE)
    assert [merge_ready_text(batch) for batch in batches] == [["one two three", Finished()]]


async def test_a_ready_chunk_never_waits_for_the_next() -> None:
    gate = asyncio.Event()

    async def handler(turn: Turn) -> AsyncIterator[Reply]:
        yield "first"
        await gate.wait()  # the next text comes only once the first was handed on
        yield "second"

    batches = run_handler_ready(handler, turn_of)
    assert await asyncio.wait_for(anext(batches), DEADLINE) == ("first",)
    gate.set()
    assert await asyncio.wait_for(anext(batches), DEADLINE) == ("second", Finished())
    await batches.aclose()


def turn_of(call_tool: Any) -> Turn:
    async def history() -> tuple[()]:
        return ()

    return Turn(session_id="s", text="hi", history=history, call_tool=call_tool)


# -- the facade's side: messages already read ----------------------------------------------


def test_chunks_read_together_are_one_chunk_event() -> None:
    reading = TurnReader().receive_ready([chunk("a"), chunk("b"), chunk("c")])
    assert reading.events == (Chunk("abc"),)


def test_the_reader_never_merges_across_a_tool_call_or_the_done() -> None:
    reader = TurnReader()
    reading = reader.receive_ready([chunk("a"), client_call(), chunk("b"), done()])
    kinds = [type(event) for event in reading.events]
    assert kinds == [Chunk, ToolCall, Chunk, Done]
    assert reader.ended
    assert reader.clean


def test_an_error_after_chunks_ends_the_turn_once() -> None:
    error = Out(error=pb.Error(code="X", message="m"))
    reader = TurnReader()
    reading = reader.receive_ready([chunk("a"), chunk("b"), error, chunk("late")])
    assert reading.events == (Chunk("ab"), Failure(code="X", message="m"))
    assert "after the turn's terminal message" in reading.note


class IdleCall:
    """A `Converse` call nothing more arrives on: the test fills the inbox itself."""

    async def read(self) -> Any:
        await asyncio.Event().wait()

    def cancel(self) -> bool:
        return True


async def test_the_facade_takes_ready_chunks_up_to_the_first_other_message() -> None:
    conversation = _Conversation(IdleCall(), buffer=8, stray=lambda note: None)  # type: ignore[arg-type]
    for message in (chunk("a"), chunk("b"), client_call(), chunk("c")):
        conversation.inbox.put_nowait(message)
    assert [m.chunk.content for m in conversation.ready_chunks()] == ["a", "b"]
    held = conversation.ready()
    assert held is not None
    assert not isinstance(held, Broken)
    assert held.WhichOneof("message") == "tool_call"  # held, then read in its turn
    assert [m.chunk.content for m in conversation.ready_chunks()] == ["c"]
    assert conversation.ready_chunks() == []  # nothing ready: returns, never waits
    conversation.close()


async def test_a_broken_stream_after_chunks_is_held_not_lost() -> None:
    conversation = _Conversation(IdleCall(), buffer=8, stray=lambda note: None)  # type: ignore[arg-type]
    conversation.inbox.put_nowait(chunk("a"))
    conversation.inbox.put_nowait(Broken("reset"))
    assert len(conversation.ready_chunks()) == 1
    assert conversation.ready() == Broken("reset")
    assert conversation.ready() is None
    conversation.close()
