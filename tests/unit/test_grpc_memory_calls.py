"""Agent memory over the runtime contract, without a socket: the facade's side (a
reserved tool name is read as a memory call, never as a client tool call; each call is
answered from the turn's memory or rejected) and the SDK's (`RemoteMemory` raises what
the in-process memory raises). docs/runtime-grpc.md, "Agent memory"."""

from __future__ import annotations

import json
from typing import Any

import pytest

from portico.agent.api import ToolAnswer, ToolRejected, ToolRequest, ToolResult, Turn
from portico.agent.remote_memory import RemoteMemory
from portico.contract import runtime_pb2 as pb
from portico.domain.memory import AgentMemory, MemoryKey, MemoryLimits
from portico.domain.memory_calls import FORGET, OFFER_KEY, OFFERED, SAVE, SEARCH
from portico.domain.model import Message
from portico.errors import InvalidMessage, MemoryFull, StoreError
from portico.runtime.base import ToolCall, TurnInput
from portico.runtime.grpc.mapping import MemoryCall, TurnReader, client_message, tool_result
from portico.runtime.grpc.memory import answer_memory_call
from portico.store.memory import MemoryStore

KEY = MemoryKey(principal="alice", agent="a", facet="f")


def memory(max_entries: int = 2) -> AgentMemory:
    return AgentMemory(MemoryStore(), KEY, MemoryLimits(max_entries=max_entries), lambda: 1.0)


def call_message(name: str, arguments: str, execution: int = pb.TOOL_EXECUTION_CLIENT) -> Any:
    return pb.ServerMessage(
        tool_call=pb.ToolCall(id="c1", name=name, arguments_json=arguments, execution=execution)
    )


# -- the facade reads it --------------------------------------------------------------------


@pytest.mark.parametrize("arguments", ['{"content": "x"}', "{not json", "[]", ""])
def test_a_reserved_name_is_a_memory_call_never_a_client_tool_call(arguments: str) -> None:
    reading = TurnReader().receive(call_message(SAVE, arguments))
    # Bad arguments too: the facade rejects them to the runtime and the turn goes on.
    assert reading.events == (MemoryCall("c1", SAVE, arguments),)
    assert not any(isinstance(event, ToolCall) for event in reading.events)


def test_a_reserved_name_of_a_server_call_is_the_runtimes_own() -> None:
    reading = TurnReader().receive(call_message(SAVE, "{}", pb.TOOL_EXECUTION_SERVER))
    assert reading.events == ()


def test_a_name_outside_the_namespace_stays_a_client_tool() -> None:
    (event,) = TurnReader().receive(call_message("portico.memoryx", "{}")).events
    assert isinstance(event, ToolCall)


def turn_input(*, memory: AgentMemory | None, metadata: dict[str, str]) -> TurnInput:
    message = Message(
        id="m", session_id="s", role="user", content="hi", metadata=metadata,
        created_at=1.0, updated_at=1.0,
    )  # fmt: skip
    return TurnInput(
        session_id="s", turn_id="t", agent="a", owner="alice", message=message, memory=memory
    )


def test_the_facade_offers_memory_only_for_a_turn_that_has_some() -> None:
    spoofed = {OFFER_KEY: OFFERED, "k": "v"}  # a client's metadata cannot offer it
    assert client_message(turn_input(memory=None, metadata=spoofed)).metadata == {"k": "v"}
    offered = client_message(turn_input(memory=memory(), metadata={OFFER_KEY: "x"}))
    assert dict(offered.metadata) == {OFFER_KEY: OFFERED}


# -- the facade answers it ------------------------------------------------------------------


async def answer(target: AgentMemory | None, name: str, arguments: Any) -> pb.ClientToolResult:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    outcome = await answer_memory_call(target, MemoryCall("c1", name, text))
    return tool_result("c1", outcome).client_tool_result


async def test_save_search_and_forget_answer_from_the_turns_memory() -> None:
    target = memory()
    saved = json.loads((await answer(target, SAVE, {"content": "likes tea"})).result_json)
    entry = saved["entry"]
    assert (entry["content"], entry["principal"], entry["facet"]) == ("likes tea", "alice", "f")
    found = json.loads((await answer(target, SEARCH, {"query": "TEA", "limit": 5})).result_json)
    assert [item["id"] for item in found["entries"]] == [entry["id"]]
    assert json.loads((await answer(target, SEARCH, {})).result_json)["entries"]
    forget = await answer(target, FORGET, {"id": entry["id"]})
    assert json.loads(forget.result_json) == {"forgotten": True}
    again = await answer(target, FORGET, {"id": entry["id"]})
    assert json.loads(again.result_json) == {"forgotten": False}


async def test_refusals_carry_what_the_in_process_memory_raises() -> None:
    target = memory(max_entries=1)
    await answer(target, SAVE, {"content": "one"})
    full = await answer(target, SAVE, {"content": "two"})
    assert not full.is_rejected
    assert json.loads(full.result_json)["refused"]["kind"] == "full"
    empty = json.loads((await answer(target, SAVE, {"content": " "})).result_json)
    assert empty["refused"] == {"kind": "invalid", "message": "a memory needs some content"}


@pytest.mark.parametrize(
    ("name", "arguments", "reason"),
    [
        (SAVE, "{not json", "malformed portico.memory.save arguments"),
        (SAVE, "[]", "malformed portico.memory.save arguments"),
        (SAVE, {}, "malformed portico.memory.save arguments"),
        (SAVE, {"content": 7}, "malformed portico.memory.save arguments"),
        (SAVE, {"content": "x", "facet": "other"}, "malformed portico.memory.save arguments"),
        (SEARCH, {"limit": "all"}, "malformed portico.memory.search arguments"),
        (FORGET, {}, "malformed portico.memory.forget arguments"),
        ("portico.memory.recall", {}, "no memory operation is named 'portico.memory.recall'"),
    ],
)
async def test_a_malformed_memory_call_gets_a_rejection_and_changes_nothing(
    name: str, arguments: Any, reason: str
) -> None:
    target = memory()
    result = await answer(target, name, arguments)
    assert result.is_rejected
    assert result.rejection_reason.startswith(reason)
    assert await target.search() == []


async def test_a_turn_without_memory_rejects_its_calls() -> None:
    result = await answer(None, SAVE, {"content": "x"})
    assert (result.is_rejected, result.rejection_reason) == (True, "this turn has no agent memory")


# -- the SDK's side -------------------------------------------------------------------------


def facade(*answers: ToolAnswer) -> tuple[RemoteMemory, list[ToolRequest]]:
    sent: list[ToolRequest] = []
    pending = list(answers)

    async def call_tool(request: ToolRequest) -> ToolAnswer:
        sent.append(request)
        return pending.pop(0)

    return RemoteMemory(call_tool), sent


async def test_remote_memory_sends_reserved_calls_and_reads_the_answers() -> None:
    target = memory()
    saved = (await answer(target, SAVE, {"content": "x"})).result_json
    remote, sent = facade(
        ToolResult(json.loads(saved)),
        ToolResult({"entries": [json.loads(saved)["entry"]]}),
        ToolResult({"forgotten": True}),
    )
    entry = await remote.save("x")
    assert entry.key == KEY
    assert await remote.search("x", limit=3) == [entry]
    assert await remote.forget(entry.id) is True
    assert [(request.name, request.arguments) for request in sent] == [
        (SAVE, {"content": "x"}),
        (SEARCH, {"query": "x", "limit": 3}),
        (FORGET, {"id": entry.id}),
    ]


async def test_remote_memory_raises_what_the_in_process_memory_raises() -> None:
    full = ToolResult({"refused": {"kind": "full", "message": "memory is full"}})
    invalid = ToolResult({"refused": {"kind": "invalid", "message": "too large"}})
    remote, _ = facade(full, invalid)
    with pytest.raises(MemoryFull, match="memory is full"):
        await remote.save("x")
    with pytest.raises(InvalidMessage, match="too large") as raised:
        await remote.save("x")
    assert not isinstance(raised.value, MemoryFull)


@pytest.mark.parametrize(
    "reply",
    [ToolRejected("timed out"), ToolResult({"what": 1}), ToolResult(None), ToolResult({})],
)
async def test_no_answer_or_a_wrong_one_is_an_archive_failure(reply: ToolAnswer) -> None:
    remote, _ = facade(reply)
    with pytest.raises(StoreError):
        await remote.search()


async def test_a_handler_cannot_call_a_reserved_name_as_a_client_tool() -> None:
    async def call_tool(request: ToolRequest) -> ToolAnswer:
        raise AssertionError("never sent")

    turn = Turn(session_id="s", text="", call_tool=call_tool)
    answer = await turn.call_client_tool(SAVE, {"content": "x"})
    assert answer == ToolRejected("tool names under 'portico.memory.' are reserved")
