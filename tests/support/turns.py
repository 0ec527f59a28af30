"""Drive a Runtime directly: a `TurnInput` for one user message, and the stream run to
its end with tool calls answered from a list (the runtime unit tests share these)."""

from __future__ import annotations

from portico.domain.model import ContentPart, Message
from portico.runtime.base import Runtime, RuntimeEvent, ToolCall, ToolOutcome, TurnInput


def turn_input(
    text: str = "hi",
    *,
    scenario: str | None = None,
    parts: tuple[ContentPart, ...] = (),
    history: tuple[Message, ...] = (),
    metadata: dict[str, str] | None = None,
) -> TurnInput:
    message = Message(
        id="m1",
        session_id="s1",
        role="user",
        content=text,
        parts=parts,
        metadata=metadata or {},
        created_at=1.0,
        updated_at=1.0,
    )
    directives = {} if scenario is None else {"mock_scenario": scenario}

    async def read_history(before: Message) -> tuple[Message, ...]:
        return history

    return TurnInput(
        session_id="s1",
        turn_id="t1",
        agent="default",
        owner="local",
        message=message,
        history_reader=read_history,
        directives=directives,
    )


async def drive(
    runtime: Runtime, turn: TurnInput, outcomes: tuple[ToolOutcome | None, ...] = ()
) -> list[RuntimeEvent]:
    """Run the stream to its end, answering each ToolCall with the next outcome."""
    stream = runtime.run(turn)
    pending = list(outcomes)
    events: list[RuntimeEvent] = []
    reply: ToolOutcome | None = None
    while True:
        try:
            event = await stream.asend(reply)
        except StopAsyncIteration:
            return events
        events.append(event)
        reply = pending.pop(0) if isinstance(event, ToolCall) else None
