"""Agent memory over the runtime contract: a `portico.agent` handler behind `portico
agent serve` reaches the archive's memory through its facade (docs/memory.md).

The contract (spec/runtime-contract.md) has no memory messages, so a memory operation
travels as a `tool_call` with `execution = CLIENT`, a reserved name in Portico's
namespace and JSON arguments; Portico's `grpc` runtime answers it itself with
`client_tool_result` and never forwards it to the client. Portico's facade offers this
per turn with a metadata key: behind any other facade (Omnia's, which would forward an
unknown client tool to the client) the handler's `turn.memory` is None.

Both ends import this module: the names, the argument and answer shapes live here once.
The same names are what the session trace records of a handler's memory operations, in
either host (`TracedMemory`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec

from portico.domain.memory import AgentMemory, MemoryEntry
from portico.errors import InvalidMessage, MemoryFull

NAMESPACE = "portico.memory."  # every tool name under it is reserved
SAVE, SEARCH, FORGET = NAMESPACE + "save", NAMESPACE + "search", NAMESPACE + "forget"
# In a turn's `ClientMessage.metadata`: "1" when the facade answers memory calls for it.
OFFER_KEY = "portico.memory"
OFFERED = "1"
CAPABILITY = "portico.memory"  # what `portico agent serve` lists in `Health`


def is_memory_call(name: str) -> bool:
    """A reserved name: the facade answers it; it never reaches a client."""
    return name.startswith(NAMESPACE)


class _Args(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class SaveArgs(_Args, frozen=True):
    content: str


class SearchArgs(_Args, frozen=True):
    query: str = ""
    limit: int | None = None


class ForgetArgs(_Args, frozen=True):
    id: str


ARGUMENTS: dict[str, type[SaveArgs | SearchArgs | ForgetArgs]] = {
    SAVE: SaveArgs,
    SEARCH: SearchArgs,
    FORGET: ForgetArgs,
}


class Refusal(msgspec.Struct, frozen=True):
    """Why the memory refused a save: `full` is `MemoryFull`, `invalid` `InvalidMessage`
    (empty or too large), as the in-process memory raises them."""

    kind: Literal["full", "invalid"]
    message: str


class MemoryAnswer(msgspec.Struct, frozen=True, omit_defaults=True):
    """The `result_json` of a memory call the facade ran (one field set per operation)."""

    entry: MemoryEntry | None = None  # save
    entries: list[MemoryEntry] | None = None  # search
    forgotten: bool | None = None  # forget
    refused: Refusal | None = None  # save refused


def refusal(exc: InvalidMessage) -> MemoryAnswer:
    kind: Literal["full", "invalid"] = "full" if isinstance(exc, MemoryFull) else "invalid"
    return MemoryAnswer(refused=Refusal(kind, exc.message))


def raise_refusal(refused: Refusal) -> None:
    """The handler's side of `refusal`: the exception the in-process memory raises."""
    raise (MemoryFull if refused.kind == "full" else InvalidMessage)(refused.message)


class TracedMemory:
    """A handler's memory whose operations the session trace records as server tool
    outcomes (the reserved name and a status, never content), wherever the handler
    runs: `error` for a refused save or an unknown id, as for the model's memory tools."""

    def __init__(self, memory: AgentMemory, record: Callable[[str, str], None]) -> None:
        self._memory = memory
        self._record = record

    async def save(self, content: str) -> MemoryEntry:
        try:
            entry = await self._memory.save(content)
        except InvalidMessage:
            self._record(SAVE, "error")
            raise
        self._record(SAVE, "completed")
        return entry

    async def search(self, query: str = "", *, limit: int | None = None) -> list[MemoryEntry]:
        found = await self._memory.search(query, limit=limit)
        self._record(SEARCH, "completed")
        return found

    async def forget(self, memory_id: str) -> bool:
        forgotten = await self._memory.forget(memory_id)
        self._record(FORGET, "completed" if forgotten else "error")
        return forgotten


def traced(
    memory: AgentMemory | None, record: Callable[[str, str], None] | None
) -> AgentMemory | TracedMemory | None:
    if memory is None or record is None:
        return memory
    return TracedMemory(memory, record)
