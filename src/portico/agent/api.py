"""The handler API: what an agent receives (`Turn`) and what it may yield (`Reply`).

An agent is one async generator function::

    async def handler(turn: Turn) -> AsyncIterator[Reply]:
        yield "Hello, "
        answer = await turn.call_client_tool("get_time", {}, consent="May I read your clock?")
        if isinstance(answer, ToolResult):
            yield f"it is {answer.value}"
        yield Usage(input_tokens=12, output_tokens=5)

The same function runs in the server's process (`runtime: python`) and in its own
process behind Portico or Omnia (`portico agent serve module:handler`); this module
knows neither place. Nothing here needs the `grpc` extra.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Protocol

import msgspec

from portico.domain.memory import MemoryEntry
from portico.domain.memory_calls import NAMESPACE, is_memory_call
from portico.domain.model import ContentPart, Role

# A part of the user's message or of the reply: `Part(type="text", text="...")`, or
# `Part(type="image", media=MediaContent(mime_type="image/png", url="https://..."))`.
Part = ContentPart

MEDIA_CHUNK_BYTES = 64 * 1024  # a yielded `Media` goes out in pieces of this size


class Media(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes streamed to the client while the turn runs (audio, an image), in pieces."""

    mime_type: str
    data: bytes
    media_id: str = ""  # empty: a fresh id per yielded item


class Usage(msgspec.Struct, frozen=True):
    """Model tokens (and cost) one request of the turn used; yielded values add up."""

    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0


# What a handler yields: text (streamed as chunks), parts (the reply's, after its
# text), media, usage.
Reply = str | ContentPart | Media | Usage


class ToolResult(msgspec.Struct, frozen=True):
    """The client ran the tool; `value` is its result (any JSON value)."""

    value: Any = None


class ToolRejected(msgspec.Struct, frozen=True):
    """The call produced no result: the user denied it, the client refused it, failed
    running it, or did not answer in time. `reason` says which, in the client's words."""

    reason: str = ""


ToolAnswer = ToolResult | ToolRejected


class HistoryMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One earlier message of the conversation."""

    role: Role
    content: str
    parts: tuple[ContentPart, ...] = ()


class ToolRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A client tool call as the handler asked for it; the adapter gives it its id."""

    name: str
    arguments: dict[str, Any]
    consent_message: str = ""
    categories: tuple[str, ...] = ()


class Memory(Protocol):
    """The agent memory of this turn's user, agent and memory facet (docs/memory.md).

    `save` raises `portico.errors.InvalidMessage` for empty or oversized content and
    `portico.errors.MemoryFull` when the facet holds `memory_max_entries`."""

    async def save(self, content: str) -> MemoryEntry: ...

    async def search(self, query: str = "", *, limit: int | None = None) -> list[MemoryEntry]: ...

    async def forget(self, memory_id: str) -> bool: ...


# How a turn reaches its adapter: the adapter sends the request out and returns the answer.
ToolCaller = Callable[[ToolRequest], Awaitable[ToolAnswer]]
HistoryLoader = Callable[[], Awaitable[tuple[HistoryMessage, ...]]]


async def _no_history() -> tuple[HistoryMessage, ...]:
    return ()


async def _no_tools(request: ToolRequest) -> ToolAnswer:
    return ToolRejected("this turn cannot call client tools")


class Turn:
    """One user message for the agent to answer, and the means to ask the client."""

    def __init__(
        self,
        *,
        session_id: str,
        text: str,
        parts: tuple[ContentPart, ...] = (),
        metadata: Mapping[str, str] | None = None,
        consent_grants: tuple[str, ...] = (),
        history: HistoryLoader = _no_history,
        call_tool: ToolCaller = _no_tools,
        memory: Memory | None = None,
    ) -> None:
        self.session_id = session_id
        self.text = text  # the user's message
        self.parts = parts  # its multimodal parts (text parts included)
        # The message's metadata, reserved keys (`mock_scenario`, `omnia.*`) included.
        self.metadata: Mapping[str, str] = dict(metadata or {})
        self.consent_grants = consent_grants  # consent categories the user granted
        self._history = history
        self._call_tool = call_tool
        # The archive's agent memory: in the server's process (`runtime: python`), and
        # behind `portico agent serve` when Portico's facade offers it for the turn. None
        # behind a facade that does not (Omnia's): the contract itself carries no memory.
        self.memory = memory

    async def history(self) -> tuple[HistoryMessage, ...]:
        """The conversation's earlier messages, oldest first (a bounded recent window).

        In the server's process they come from the archive; behind `portico agent serve`
        from the agent's own memory of the turns it answered (see docs/agents.md)."""
        return await self._history()

    async def call_client_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        consent: str = "",
        categories: tuple[str, ...] = (),
    ) -> ToolAnswer:
        """Ask the client to run tool `name`; returns its result or why there is none.

        `consent` is the prompt the client shows before running it, `categories` the
        consent categories it touches (`location`, `filesystem`). A denial, a refusal, a
        client error and a timeout all return `ToolRejected`: nothing is raised. Names
        under `portico.memory.` are reserved for `turn.memory` and refused here.
        """
        if is_memory_call(name):
            return ToolRejected(f"tool names under {NAMESPACE!r} are reserved")
        request = ToolRequest(
            name=name,
            arguments=dict(arguments or {}),
            consent_message=consent,
            categories=tuple(categories),
        )
        return await self._call_tool(request)


Handler = Callable[[Turn], AsyncIterator[Reply]]


def media_pieces(media: Media) -> list[tuple[int, bool, bytes]]:
    """`(sequence, is_last, data)` pieces of at most `MEDIA_CHUNK_BYTES`; one for no bytes."""
    starts = range(0, max(len(media.data), 1), MEDIA_CHUNK_BYTES)
    last = len(starts) - 1
    return [
        (index, index == last, media.data[start : start + MEDIA_CHUNK_BYTES])
        for index, start in enumerate(starts)
    ]


def client_error_of(value: Any) -> str | None:
    """The error text of a client tool that failed, as the contract's facade encodes it
    (`result_json` `{"error": "<message>"}`, `is_rejected` false, docs/runtime-grpc.md).
    Both hosts give the handler such a result as a rejection, so a handler cannot tell
    where it runs from a tool's answer."""
    error = value.get("error") if isinstance(value, dict) and len(value) == 1 else None
    return error if isinstance(error, str) else None
