"""Against a real OpenAI-compatible endpoint, when one is named; skipped otherwise.

    PORTICO_TEST_OPENAI_BASE_URL=https://api.openai.com/v1 \\
    PORTICO_TEST_OPENAI_MODEL=gpt-4o-mini \\
    PORTICO_TEST_OPENAI_API_KEY=sk-... \\
    .venv/bin/pytest tests/integration/test_openai_live.py

Works with Ollama (`http://127.0.0.1:11434/v1`, no key) and other compatible servers;
the tool test needs a model that calls tools.
"""

from __future__ import annotations

import os

import msgspec
import pytest

from portico.config import AgentSettings
from portico.runtime.base import Done, Usage
from portico.runtime.openai import OpenAIRuntime
from support.fake_openai import drive, message, streamed_text, turn_input

BASE_URL = os.environ.get("PORTICO_TEST_OPENAI_BASE_URL")
KEY_ENV = "PORTICO_TEST_OPENAI_API_KEY"

pytestmark = pytest.mark.skipif(not BASE_URL, reason="PORTICO_TEST_OPENAI_BASE_URL is not set")


def live_runtime(**fields: object) -> OpenAIRuntime:
    settings = {
        "runtime": "openai",
        "base_url": BASE_URL,
        "model": os.environ.get("PORTICO_TEST_OPENAI_MODEL", "gpt-4o-mini"),
        "api_key_env": KEY_ENV if os.environ.get(KEY_ENV) else None,
        "first_token_timeout": 60.0,
        **fields,
    }
    return OpenAIRuntime(msgspec.convert(settings, AgentSettings), env=os.environ)


async def test_a_real_model_streams_an_answer() -> None:
    runtime = live_runtime(max_tokens=20)
    try:
        events, _ = await drive(runtime, turn_input(message("Reply with the single word: pong")))
    finally:
        await runtime.close()
    assert events[-1] == Done(), events[-1]
    assert "pong" in streamed_text(events).lower()
    assert any(isinstance(e, Usage) and e.input_tokens > 0 for e in events)


async def test_a_real_model_calls_the_current_time_tool() -> None:
    runtime = live_runtime(tools=[{"kind": "builtin", "name": "current_time"}])
    question = message("What year is it in UTC right now? Use the current_time tool.")
    try:
        events, _ = await drive(runtime, turn_input(question))
    finally:
        await runtime.close()
    assert events[-1] == Done(), events[-1]
    assert streamed_text(events).strip()
