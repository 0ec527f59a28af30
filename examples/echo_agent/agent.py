"""A plain Python agent: echoes the user's words and asks the browser for the time.

Run it in Portico's process:
    PORTICO_RUNTIME=python PORTICO_PLUGIN=examples.echo_agent.agent:handler portico serve
or in its own process, behind `runtime: grpc`:
    portico agent serve examples.echo_agent.agent:handler --port 50051
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from portico.agent import Reply, ToolRejected, ToolResult, Turn, Usage


async def handler(turn: Turn) -> AsyncIterator[Reply]:
    """Say what the user said, word by word; ask the client's clock when they say "time"."""
    earlier = [message for message in await turn.history() if message.role == "user"]
    words = turn.text.split()
    if "time" in (word.strip("?!.,").lower() for word in words):
        yield "Let me look at your clock. "
        answer = await turn.call_client_tool(
            "get_time",
            {},
            consent="The echo agent wants to read your device's clock.",
            categories=("time",),
        )
        if isinstance(answer, ToolResult):
            yield f"Your device says {answer.value}."
        elif isinstance(answer, ToolRejected):
            yield f"I could not read it ({answer.reason or 'no reason given'})."
    else:
        yield "You said:"
        for word in words:
            yield " " + word
    yield f" (message {len(earlier) + 1} of this conversation)"
    # A real agent reports its model's tokens; the echo counts words.
    yield Usage(input_tokens=len(words), output_tokens=len(words))
