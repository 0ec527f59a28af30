"""The `grpc` runtime answers a runtime's memory calls itself, over a real stream: an
in-process runtime sends `portico.memory.*` tool calls (well-formed and not), and the
turn Portico reads from it never carries them to the engine (so never to a client, never
into the archive as client tool calls); each gets its `client_tool_result`, a malformed
one a rejection, and the turn goes on to its `done` (docs/runtime-grpc.md, "Agent
memory"). The same stream shape with a plain name is forwarded, as a control."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from portico.config import AgentSettings
from portico.contract import runtime_pb2 as pb
from portico.domain.memory import AgentMemory, MemoryKey, MemoryLimits
from portico.domain.memory_calls import OFFER_KEY, SAVE, SEARCH
from portico.domain.model import Message
from portico.runtime.base import Done, RuntimeEvent, ToolCall, ToolOutcome, TurnInput
from portico.runtime.grpc.runtime import GrpcRuntime
from portico.store.memory import MemoryStore
from support.grpc_runtime import start_converse_server

WITHIN = 10.0
KEY = MemoryKey(principal="alice", agent="agent", facet="f")
CALLS = [
    (SAVE, '{"content": "likes tea"}'),
    (SAVE, "{not json"),  # malformed: rejected, the turn goes on
    ("portico.memory.recall", "{}"),  # no such operation: rejected
    (SEARCH, '{"query": "tea"}'),
]


class Scripted:
    """Per turn: the tool calls named by the turn's `calls` metadata (JSON), each answer
    read before the next; then a `done` whose content is the answers, and the offer."""

    async def converse(self, requests: AsyncIterator[pb.ClientMessage], context: Any) -> None:
        requests = aiter(requests)
        async for opening in requests:
            answers: list[dict[str, Any]] = []
            for index, (name, arguments) in enumerate(json.loads(opening.metadata["calls"])):
                call = pb.ToolCall(
                    id=f"c{index}",
                    name=name,
                    arguments_json=arguments,
                    execution=pb.TOOL_EXECUTION_CLIENT,
                )
                await context.write(pb.ServerMessage(tool_call=call))
                result = (await anext(requests)).client_tool_result
                answers.append(
                    {
                        "id": result.call_id,
                        "result": json.loads(result.result_json or "null"),
                        "rejected": result.is_rejected,
                        "reason": result.rejection_reason,
                    }
                )
            report = {"answers": answers, "offer": opening.metadata.get(OFFER_KEY)}
            await context.write(pb.ServerMessage(done=pb.Done(final_content=json.dumps(report))))


@pytest.fixture
async def runtime() -> AsyncIterator[GrpcRuntime]:
    server, port = await start_converse_server(Scripted().converse)
    settings = AgentSettings(runtime="grpc", grpc_target=f"127.0.0.1:{port}")
    runtime = GrpcRuntime("memory", settings, env={})
    yield runtime
    await runtime.close()
    await server.stop(0)


def turn_input(
    calls: list[tuple[str, str]], memory: AgentMemory | None, **fields: Any
) -> TurnInput:
    message = Message(
        id="m",
        session_id="s",
        role="user",
        content="go",
        metadata={"calls": json.dumps(calls)},
        created_at=1.0,
        updated_at=1.0,
    )
    return TurnInput(
        session_id="s",
        turn_id="t",
        agent="agent",
        owner="alice",
        message=message,
        memory=memory,
        **fields,
    )


async def run_turn(runtime: GrpcRuntime, turn: TurnInput) -> list[RuntimeEvent]:
    """Every event the engine gets; a client tool call is answered with a result."""
    events: list[RuntimeEvent] = []
    stream = runtime.run(turn)
    outcome: ToolOutcome | None = None
    async with asyncio.timeout(WITHIN):
        while True:
            try:
                event = await stream.asend(outcome) if events else await anext(stream)
            except StopAsyncIteration:
                return events
            events.append(event)
            outcome = ToolOutcome(status="completed", result="client")
            outcome = outcome if isinstance(event, ToolCall) else None


def report(events: list[RuntimeEvent]) -> dict[str, Any]:
    (done,) = events
    assert isinstance(done, Done)
    assert done.content is not None
    answers: dict[str, Any] = json.loads(done.content)
    return answers


async def test_memory_calls_are_answered_by_the_facade_and_never_reach_the_engine(
    runtime: GrpcRuntime,
) -> None:
    store = MemoryStore()
    memory = AgentMemory(store, KEY, MemoryLimits())
    traced: list[tuple[str, str]] = []
    turn = turn_input(CALLS, memory, tool_outcome=lambda *outcome: traced.append(outcome))
    found = report(await run_turn(runtime, turn))  # the done alone: no ToolCall event
    assert found["offer"] == "1"
    saved, malformed, unknown, searched = found["answers"]
    assert (saved["rejected"], saved["result"]["entry"]["content"]) == (False, "likes tea")
    assert malformed["rejected"]
    assert malformed["reason"].startswith("malformed")
    assert unknown["rejected"]
    assert unknown["reason"].startswith("no memory operation")
    assert [entry["content"] for entry in searched["result"]["entries"]] == ["likes tea"]
    # Kept under the turn's key; traced like server tools (the malformed ones never ran).
    assert [entry.content for entry in await store.search_memory(KEY, "", limit=5)] == ["likes tea"]
    assert traced == [(SAVE, "completed"), (SEARCH, "completed")]


async def test_a_turn_without_memory_is_not_offered_any_and_its_calls_are_rejected(
    runtime: GrpcRuntime,
) -> None:
    found = report(await run_turn(runtime, turn_input(CALLS[:1], None)))
    assert found["offer"] is None
    (answer,) = found["answers"]
    assert (answer["rejected"], answer["reason"]) == (True, "this turn has no agent memory")


async def test_a_plain_name_is_still_a_client_tool_call(runtime: GrpcRuntime) -> None:
    events = await run_turn(runtime, turn_input([("memory_save", "{}")], None))
    assert [type(event) for event in events] == [ToolCall, Done]
    (answer,) = report(events[1:])["answers"]
    assert answer["result"] == "client"
