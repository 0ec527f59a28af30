"""The facade's answer to a memory call of a `portico agent serve` handler
(`portico.domain.memory_calls`): the turn's `AgentMemory`, the one an in-process
handler gets, traced the same way, so its key, checks, limits and trace are the same.
Decisions are in docs/runtime-grpc.md, "Agent memory"."""

from __future__ import annotations

import logging

import msgspec

from portico.domain.memory import AgentMemory
from portico.domain.memory_calls import (
    ARGUMENTS,
    ForgetArgs,
    MemoryAnswer,
    SaveArgs,
    SearchArgs,
    TracedMemory,
    refusal,
)
from portico.errors import InvalidMessage
from portico.runtime.base import ToolOutcome
from portico.runtime.grpc.mapping import MemoryCall

log = logging.getLogger("portico.runtime.grpc")
Memory = AgentMemory | TracedMemory


def rejected(reason: str) -> ToolOutcome:
    """A memory call that did not run: the handler's memory raises `StoreError`."""
    return ToolOutcome(status="denied", error=reason)


async def answer_memory_call(memory: Memory | None, call: MemoryCall) -> ToolOutcome:
    """What goes back to the runtime as the call's `client_tool_result`."""
    if memory is None:
        return rejected("this turn has no agent memory")
    arguments_type = ARGUMENTS.get(call.name)
    if arguments_type is None:
        return rejected(f"no memory operation is named {call.name[:64]!r}")
    try:
        arguments = msgspec.json.decode(call.arguments_json or "{}", type=arguments_type)
    except msgspec.DecodeError as exc:  # msgspec names the field and the type, no value
        return rejected(f"malformed {call.name} arguments: {exc}")
    try:
        answer = await _run(memory, arguments)
    except InvalidMessage as exc:  # empty, too large, full: the handler's exception
        return ToolOutcome(status="completed", result=refusal(exc))
    except Exception:
        # The archive failed: the handler's memory raises, as in process; the turn goes on.
        log.exception("agent memory failed answering a %s call", call.name)
        return rejected("the agent memory is unavailable")
    return ToolOutcome(status="completed", result=answer)


async def _run(memory: Memory, arguments: SaveArgs | SearchArgs | ForgetArgs) -> MemoryAnswer:
    if isinstance(arguments, SaveArgs):
        return MemoryAnswer(entry=await memory.save(arguments.content))
    if isinstance(arguments, SearchArgs):
        return MemoryAnswer(entries=await memory.search(arguments.query, limit=arguments.limit))
    return MemoryAnswer(forgotten=await memory.forget(arguments.id))
