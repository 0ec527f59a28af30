"""`turn.memory` behind `portico agent serve`: the archive's agent memory, reached
through Portico's facade (`portico.domain.memory_calls`, docs/agents.md "Memory").

Each operation is a tool call under a reserved name that goes out on the turn's stream
like a client tool call, in order with the handler's text, and waits for the facade's
answer at most `memory_timeout`. The answers raise what the in-process memory raises
(`InvalidMessage`, `MemoryFull`); a call the facade could not run, or that got no
answer, raises `StoreError`, as an archive failure does in process.
"""

from __future__ import annotations

import msgspec

from portico.agent.api import ToolCaller, ToolRejected, ToolRequest
from portico.domain.memory import MemoryEntry
from portico.domain.memory_calls import (
    FORGET,
    SAVE,
    SEARCH,
    ForgetArgs,
    MemoryAnswer,
    SaveArgs,
    SearchArgs,
    raise_refusal,
)
from portico.errors import StoreError


class RemoteMemory:
    """A `portico.agent.api.Memory` whose store is on the facade's side."""

    def __init__(self, call_tool: ToolCaller) -> None:
        self._call_tool = call_tool

    async def save(self, content: str) -> MemoryEntry:
        answer = await self._call(SAVE, SaveArgs(content))
        if answer.refused is not None:
            raise_refusal(answer.refused)
        if answer.entry is None:
            raise StoreError("agent memory: the facade's answer has no entry")
        return answer.entry

    async def search(self, query: str = "", *, limit: int | None = None) -> list[MemoryEntry]:
        answer = await self._call(SEARCH, SearchArgs(query, limit))
        if answer.entries is None:
            raise StoreError("agent memory: the facade's answer has no entries")
        return answer.entries

    async def forget(self, memory_id: str) -> bool:
        answer = await self._call(FORGET, ForgetArgs(memory_id))
        if answer.forgotten is None:
            raise StoreError("agent memory: the facade's answer says nothing forgotten")
        return answer.forgotten

    async def _call(self, name: str, arguments: SaveArgs | SearchArgs | ForgetArgs) -> MemoryAnswer:
        request = ToolRequest(name=name, arguments=msgspec.to_builtins(arguments))
        answer = await self._call_tool(request)
        if isinstance(answer, ToolRejected):
            raise StoreError(f"agent memory: {answer.reason or 'the call was rejected'}")
        try:
            return msgspec.convert(answer.value, MemoryAnswer)
        except msgspec.ValidationError as exc:
            raise StoreError("agent memory: the facade's answer is not a memory answer") from exc
