"""The `python` runtime: an agent handler (`portico.agent`) in the server's process.

The handler's outputs map onto the Runtime port: text to chunks, media to media
chunks, usage to usage, a client tool request to a `ToolCall` whose `ToolOutcome`
goes back to the handler as a `ToolResult` or `ToolRejected`, parts to the reply's
parts, an `AgentError` to a `Failure` with its code.
"""

from __future__ import annotations

import contextlib

from portico.agent.api import (
    Handler,
    HistoryMessage,
    Media,
    ToolAnswer,
    ToolCaller,
    ToolRejected,
    ToolResult,
    Turn,
    client_error_of,
    media_pieces,
)
from portico.agent.api import Usage as AgentUsage
from portico.agent.loader import load_handler
from portico.agent.pump import Failed, Finished, PendingTool, run_handler
from portico.domain.memory_calls import OFFER_KEY, traced
from portico.domain.model import ContentPart, message_text, new_id
from portico.runtime.base import (
    Chunk,
    Done,
    Failure,
    MediaChunk,
    RuntimeEvent,
    ToolCall,
    ToolOutcome,
    TurnInput,
    TurnStream,
    Usage,
    consent_grants,
    contract_metadata,
)


class PythonRuntime:
    def __init__(self, handler: Handler) -> None:
        self._handler = handler

    @classmethod
    def from_plugin(cls, spec: str) -> PythonRuntime:
        """Load the handler now, so a bad plugin stops the server at start."""
        return cls(load_handler(spec))

    async def run(self, turn: TurnInput) -> TurnStream:
        parts: list[ContentPart] = []
        outputs = run_handler(self._handler, lambda call: _agent_turn(turn, call))
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                if isinstance(output, PendingTool):
                    outcome = yield _tool_call(output)
                    output.answer(_answer(outcome))
                elif isinstance(output, ContentPart):
                    parts.append(output)
                elif isinstance(output, Finished):
                    yield Done(parts=tuple(parts) or None)
                    return
                else:
                    for event in _events(output):
                        yield event


def _agent_turn(turn: TurnInput, call_tool: ToolCaller) -> Turn:
    async def history() -> tuple[HistoryMessage, ...]:
        return tuple(
            HistoryMessage(role=message.role, content=message.content, parts=message.parts)
            for message in await turn.history()
        )

    # What the gRPC contract's `metadata` and `consent_grants` carry, so a handler sees
    # the same turn in process and behind `runtime: grpc`.
    metadata = contract_metadata(turn)
    metadata.pop(OFFER_KEY, None)  # as the SDK removes it behind `runtime: grpc`
    return Turn(
        session_id=turn.session_id,
        text=message_text(turn.message),
        parts=turn.message.parts,
        metadata=metadata,
        consent_grants=consent_grants(metadata),
        history=history,
        call_tool=call_tool,
        memory=traced(turn.memory, turn.tool_outcome),
    )


def _events(output: str | Media | AgentUsage | Failed) -> list[RuntimeEvent]:
    if isinstance(output, str):
        return [Chunk(output)]
    if isinstance(output, AgentUsage):
        return [Usage(input_tokens=output.input_tokens, output_tokens=output.output_tokens)]
    if isinstance(output, Failed):
        return [Failure(code=output.code, message=output.message)]
    media_id = output.media_id or new_id("media")
    return [
        MediaChunk(media_id, output.mime_type, data, sequence, is_last)
        for sequence, is_last, data in media_pieces(output)
    ]


def _tool_call(pending: PendingTool) -> ToolCall:
    request = pending.request
    return ToolCall(
        id=new_id("call"),
        name=request.name,
        arguments=request.arguments,
        consent_message=request.consent_message or None,
        categories=request.categories,
    )


def _answer(outcome: ToolOutcome | None) -> ToolAnswer:
    if outcome is not None and outcome.status == "completed":
        error = client_error_of(outcome.result)  # as the SDK reads it over gRPC
        return ToolResult(outcome.result) if error is None else ToolRejected(error)
    # The contract has no client "error" answer: a failed call is a rejection too. The
    # reason is the client's (or the broker's) as the facade sends it over gRPC
    # (`rejection_reason`, or the `{"error": ...}` text): empty when it gave none.
    return ToolRejected("" if outcome is None else outcome.error or "")
