"""Agent memory as server-side tools (save, search, forget): a model runtime offers
them through the same mechanism as configured and MCP tools. Each turn gets its own,
bound to the turn's memory key, so the model can name no other principal or facet."""

from __future__ import annotations

from typing import Any

from portico.domain.memory import AgentMemory, MemoryEntry
from portico.errors import InvalidMessage
from portico.runtime.server_tools import ServerTool, ToolError

SAVE, SEARCH, FORGET = "memory_save", "memory_search", "memory_forget"


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _entry(entry: MemoryEntry) -> dict[str, Any]:
    return {"id": entry.id, "content": entry.content}


class _MemoryTool:
    name: str
    description: str
    parameters: dict[str, Any]

    def __init__(self, memory: AgentMemory) -> None:
        self._memory = memory

    async def run(self, arguments: dict[str, Any]) -> Any:
        try:
            return await self._run(arguments)
        except InvalidMessage as exc:  # empty, too large, memory full: the model is told
            raise ToolError(exc.message) from None

    async def _run(self, arguments: dict[str, Any]) -> Any:
        raise NotImplementedError


class MemorySave(_MemoryTool):
    name = SAVE
    description = "Remember a fact about the user or this work for later conversations."
    parameters = _object({"content": {"type": "string", "minLength": 1}}, ["content"])

    async def _run(self, arguments: dict[str, Any]) -> Any:
        return _entry(await self._memory.save(arguments["content"]))


class MemorySearch(_MemoryTool):
    name = SEARCH
    description = "Find remembered facts containing the query (empty: the newest ones)."
    parameters = _object({"query": {"type": "string"}}, [])

    async def _run(self, arguments: dict[str, Any]) -> Any:
        found = await self._memory.search(arguments.get("query", ""))
        return {"memories": [_entry(entry) for entry in found]}


class MemoryForget(_MemoryTool):
    name = FORGET
    description = "Forget one remembered fact, by the id a search returned."
    parameters = _object({"id": {"type": "string", "minLength": 1}}, ["id"])

    async def _run(self, arguments: dict[str, Any]) -> Any:
        if not await self._memory.forget(arguments["id"]):
            raise ToolError("no memory has this id")
        return {"forgotten": arguments["id"]}


def memory_tools(memory: AgentMemory | None) -> list[ServerTool]:
    """The memory tools of one turn; none when the turn has no memory."""
    if memory is None:
        return []
    return [MemorySave(memory), MemorySearch(memory), MemoryForget(memory)]
