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
    media_pieces,
)
from portico.agent.api import Usage as AgentUsage
from portico.agent.loader import load_handler
from portico.agent.pump import Failed, Finished, PendingTool, run_handler
from portico.core.model import ContentPart, message_text, new_id
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

    return Turn(
        session_id=turn.session_id,
        text=message_text(turn.message),
        parts=turn.message.parts,
        # What the gRPC contract's `metadata` carries: the reserved keys included.
        metadata={**turn.message.metadata, **turn.directives},
        history=history,
        call_tool=call_tool,
        memory=turn.memory,
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
    if outcome is None:
        return ToolRejected("no answer")
    if outcome.status == "completed":
        return ToolResult(outcome.result)
    # The contract has no client "error" answer: a failed call is a rejection too.
    return ToolRejected(outcome.error or outcome.status)
