"""The agent of the bring-your-own-agent conformance suite (tests/conformance/test_byo_agent.py).

One handler, written with the SDK, whose behaviour is chosen by the first word of the
user's message (the clients of all three protocols can send text; not all of them
metadata). The suite runs it in Portico's process (`runtime: python`) and in its own
(`portico agent serve tests/support/byo_agent.py` behind `runtime: grpc`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from portico.agent import (
    AgentError,
    Media,
    MediaContent,
    Part,
    Reply,
    ToolRejected,
    ToolResult,
    Turn,
    Usage,
)

WORDS = ("one ", "two ", "three")
MEDIA_BYTES = bytes(range(256)) * 300  # 76800 bytes: two 64 KiB pieces
IMAGE_URL = "https://example.com/cat.png"
HOLD_SECONDS = 30.0  # far past any test's deadline: the turn is cut by the test


async def handler(turn: Turn) -> AsyncIterator[Reply]:
    command, _, argument = turn.text.partition(" ")
    if command == "stream":
        for word in WORDS:
            yield word
        yield Usage(input_tokens=2, output_tokens=3, cost_usd=0.5)
        yield Usage(input_tokens=1, output_tokens=1)
    elif command == "tool":
        answer = await turn.call_client_tool(
            "get_location",
            {"precision": argument or "city"},
            consent="May I read your location?",
            categories=("location",),
        )
        yield describe(answer)
    elif command == "media":
        yield "listen"
        yield Media(mime_type="audio/pcm", data=MEDIA_BYTES, media_id="clip-1")
    elif command == "parts":
        yield "see the picture"
        yield Part(type="text", text="a caption")
        yield Part(type="image", media=MediaContent(mime_type="image/png", url=IMAGE_URL))
    elif command == "report":
        yield json.dumps(await report(turn), sort_keys=True)
    elif command == "fail":
        yield "partial "
        raise AgentError(argument, "the agent failed on purpose")
    elif command == "crash":
        yield "partial "
        raise RuntimeError("secret internals")
    elif command == "hold":
        yield "working"
        await asyncio.sleep(HOLD_SECONDS)
        yield " late"
    else:
        yield f"echo: {turn.text}"


def describe(answer: ToolResult | ToolRejected) -> str:
    if isinstance(answer, ToolResult):
        return "result:" + json.dumps(answer.value, sort_keys=True)
    return "rejected:" + answer.reason


async def report(turn: Turn) -> dict[str, object]:
    """What the handler was given, for the tests to compare across placements."""
    history = await turn.history()
    return {
        "session_id": turn.session_id,
        "text": turn.text,
        "parts": [
            [part.type, part.text, part.media.url if part.media else None] for part in turn.parts
        ],
        "metadata": dict(turn.metadata),
        "consent_grants": list(turn.consent_grants),
        "history": [[message.role, message.content] for message in history],
    }
