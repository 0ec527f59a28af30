"""The Runtime port.

A runtime turns one user message (plus the session's history) into an async
stream of events. It asks for a client-side tool by yielding a `ToolCall`; the
engine sends the call's `ToolOutcome` back into the generator (``asend``), so a
runtime reads like straight-line code: ``outcome = yield ToolCall(...)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from portico.domain.memory import AgentMemory
from portico.domain.model import ContentPart, MediaContent, Message
from portico.errors import MediaNotEnabled

# The directive carrying RPC `message.send`'s `agent_prompt`: an instruction from the
# client application for this one message.
AGENT_PROMPT = "agent_prompt"
# Reserved metadata keys Portico adds to what an agent's handler or a contract runtime
# gets as a message's metadata (the `omnia.*` ones the client sent are kept as they are).
AGENT_PROMPT_KEY = "portico.agent_prompt"
CONTEXT_KEY = "portico.context"
# A client names the consent categories its user granted in this reserved key.
CONSENT_GRANTS_KEY = "omnia.consent_grants"


class Chunk(msgspec.Struct, frozen=True):
    text: str


class Done(msgspec.Struct, frozen=True):
    """The end of the reply. `content` None means: the concatenated chunks."""

    content: str | None = None
    parts: tuple[ContentPart, ...] | None = None


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: dict[str, Any]
    consent_message: str | None = None
    categories: tuple[str, ...] = ()


class MediaChunk(msgspec.Struct, frozen=True):
    media_id: str
    mime_type: str
    data: bytes
    sequence: int
    is_last: bool


class Failure(msgspec.Struct, frozen=True):
    """The turn failed. `code` reaches the client only when it is a spec code."""

    code: str
    message: str


class Usage(msgspec.Struct, frozen=True):
    """Model tokens one request of the turn used; the engine adds them up per turn."""

    input_tokens: int = 0
    output_tokens: int = 0


RuntimeEvent = Chunk | Done | ToolCall | MediaChunk | Failure | Usage


class ToolOutcome(msgspec.Struct, frozen=True):
    """How a client tool call ended: `denied` covers nacks, rejections and timeouts."""

    status: Literal["completed", "error", "denied"]
    result: Any = None
    error: str | None = None


class ClientTool(msgspec.Struct, frozen=True):
    """A tool the client declared (`/v1/session` `hello.tools`); the agent may call it."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class MediaAccess(Protocol):
    """Media of message parts: vetted when a message arrives, read when a runtime needs it."""

    async def check_part(self, *, principal: str, session_id: str, media: MediaContent) -> None:
        """Raise `InvalidMessage` for a part whose bytes could not be read."""

    async def read(self, *, session_id: str, media: MediaContent) -> bytes:
        """The bytes of a vetted part (stored upload, inline data or URL)."""

    async def keep(
        self, *, principal: str, session_id: str, mime_type: str, data: bytes, filename: str
    ) -> MediaContent | None:
        """Archive media the agent streamed; the part's media (None: not kept)."""


class HistoryReader(Protocol):
    async def __call__(self, before: Message) -> tuple[Message, ...]:
        """The session's most recent messages before `before`, oldest first."""


class TurnInput(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    turn_id: str
    agent: str
    owner: str  # the principal the session belongs to
    message: Message
    # Read on demand: a runtime that never looks at the history (echo, scripted) must
    # not pay an archive query per turn, which under load competes with the event loop.
    history_reader: HistoryReader | None = None
    # Reserved metadata keys (`mock_scenario`, `content_type`, `omnia.*`): for the runtime only.
    directives: dict[str, str] = msgspec.field(default_factory=dict)
    declare: dict[str, Any] | None = None
    media: MediaAccess | None = None
    # Tools the client offers, and the application context it sent: data for
    # server code and tool arguments, never instructions to the model.
    client_tools: tuple[ClientTool, ...] = ()
    context: dict[str, Any] = msgspec.field(default_factory=dict)
    # Set when the user's message is still being archived as the turn starts (its
    # `global_offset` is 0 until then): the engine waits for it before the turn ends.
    archived: asyncio.Future[Message] | None = None
    # The agent memory of the session's owner, agent and the connection's facet.
    memory: AgentMemory | None = None
    # Call with (tool name, status) when a server-side tool the runtime ran ends: the
    # session trace records it (client tools are recorded by the engine).
    tool_outcome: Callable[[str, str], None] | None = None

    async def history(self) -> tuple[Message, ...]:
        """The session's messages before this turn's (the most recent few), oldest first."""
        if self.history_reader is None:
            return ()
        return await self.history_reader(self.message)

    async def read_media(self, media: MediaContent) -> bytes:
        """The bytes of one of this turn's media parts."""
        if self.media is None:
            raise MediaNotEnabled()
        return await self.media.read(session_id=self.session_id, media=media)


TurnStream = AsyncGenerator[RuntimeEvent, ToolOutcome | None]


class Runtime(Protocol):
    def run(self, turn: TurnInput) -> TurnStream:
        """Start the turn; the engine iterates the stream to its terminal event."""


@runtime_checkable
class Closable(Protocol):
    """A runtime holding resources (an HTTP client) to release when the server stops."""

    async def close(self) -> None: ...


@runtime_checkable
class Summarizer(Protocol):
    """A runtime that summarises history with its model (compaction) instead of the
    built-in extractive summary."""

    async def summarize(self, history: Sequence[Message], instruction: str) -> str:
        """A summary that stands in for `history` (oldest first); raises when it cannot."""


# What a runtime that keeps the conversation says about resuming a session: `unknown`
# when it has no answer (an unimplemented check), which lets the resume through.
ResumeVerdict = Literal["resumable", "not_found", "unavailable", "unknown"]


@runtime_checkable
class ConversationKeeper(Protocol):
    """A runtime that may own a conversation's context (an agent in another process)."""

    async def has_conversation(self, session_id: str) -> ResumeVerdict: ...


@runtime_checkable
class ConversationReleaser(Protocol):
    """A runtime holding resources per conversation (a stream) to free when it ends."""

    def release(self, session_id: str) -> None:
        """The session ended: free what it holds now, or when its running turn ends."""


class RuntimeHealth(msgspec.Struct, frozen=True):
    healthy: bool
    reason: str = ""  # why not, for operators (`/readyz` body); never a credential


@runtime_checkable
class HealthReporter(Protocol):
    """A runtime whose health decides readiness (`/readyz`)."""

    @property
    def health_required(self) -> bool: ...

    async def health(self) -> RuntimeHealth: ...


def contract_metadata(turn: TurnInput) -> dict[str, str]:
    """The message's metadata as the runtime contract carries it (reserved keys too, the
    agent prompt and the application context under Portico's keys): one shape for a
    handler in process and behind `runtime: grpc`."""
    metadata = {**turn.message.metadata, **turn.directives}
    if AGENT_PROMPT in metadata:
        metadata[AGENT_PROMPT_KEY] = metadata.pop(AGENT_PROMPT)
    if turn.context:
        metadata[CONTEXT_KEY] = msgspec.json.encode(turn.context).decode()
    return metadata


def consent_grants(metadata: dict[str, str]) -> tuple[str, ...]:
    """The consent categories of the comma-separated reserved key, in order."""
    grants = metadata.get(CONSENT_GRANTS_KEY, "")
    return tuple(grant.strip() for grant in grants.split(",") if grant.strip())
