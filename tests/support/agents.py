"""Agent handlers for the SDK tests; the metadata key `scenario` picks what they do."""

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

MEDIA_BYTES = bytes(range(256)) * 300  # 76800 bytes: two media pieces


async def handler(turn: Turn) -> AsyncIterator[Reply]:
    scenario = turn.metadata.get("scenario", "stream")
    if scenario == "stream":
        for word in ("one ", "two ", "three"):
            yield word
    elif scenario == "tool":
        answer = await turn.call_client_tool(
            "get_time", {"zone": "UTC"}, consent="May I read your clock?", categories=("time",)
        )
        yield describe(answer)
    elif scenario == "two_tools":
        first = await turn.call_client_tool("first", {})
        second = await turn.call_client_tool("second", {})
        yield describe(first) + " " + describe(second)
    elif scenario == "parts":
        yield "see the picture"
        yield Part(
            type="image", media=MediaContent(mime_type="image/png", url="https://x.test/a.png")
        )
        yield Part(type="text", text="a caption")
    elif scenario == "media":
        yield Media(mime_type="audio/wav", data=MEDIA_BYTES, media_id="clip-1")
        yield "played"
    elif scenario == "usage":
        yield "counted"
        yield Usage(input_tokens=3, output_tokens=4, cost_usd=0.25)
        yield Usage(input_tokens=1, output_tokens=1)
    elif scenario == "agent_error":
        yield "partial "
        raise AgentError("PROVIDER_UNAVAILABLE", "the model is down")
    elif scenario == "crash":
        yield "partial "
        raise RuntimeError("secret internals")
    elif scenario == "bad_yield":
        yield 42  # type: ignore[misc]
    elif scenario == "slow":
        await asyncio.sleep(float(turn.metadata.get("seconds", "0.5")))
        yield "slept"
    elif scenario == "hold":
        yield "started "
        await asyncio.sleep(float(turn.metadata.get("seconds", "0.5")))
        yield "finished"
    elif scenario == "turn":
        history = await turn.history()
        yield json.dumps(
            {
                "session_id": turn.session_id,
                "text": turn.text,
                "parts": [part.type for part in turn.parts],
                "metadata": dict(turn.metadata),
                "consent_grants": list(turn.consent_grants),
                "history": [[message.role, message.content] for message in history],
            },
            sort_keys=True,
        )
    else:
        raise AgentError("SCENARIO_NOT_FOUND", scenario)


def describe(answer: ToolResult | ToolRejected) -> str:
    if isinstance(answer, ToolResult):
        return "result:" + json.dumps(answer.value, sort_keys=True)
    return "rejected:" + answer.reason


async def not_a_generator(turn: Turn) -> str:
    return "no"


def sync_generator(turn: Turn) -> object:
    yield "no"


async def two_arguments(turn: Turn, extra: int) -> AsyncIterator[Reply]:
    yield "no"


NOT_CALLABLE = 7
