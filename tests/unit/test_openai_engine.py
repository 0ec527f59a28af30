"""The engine with the openai runtime and a MemoryStore: usage per turn, compaction by the
model (asked for, and automatic past the token budget), history after a compaction, and the
agent's configured client tools offered to every runtime."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from portico.config import AgentSettings
from portico.core.engine import Engine, UserMessage
from portico.core.events import TERMINAL_EVENTS, TurnCompleted, TurnEvent
from portico.domain.model import Message, Session, Turn
from portico.runtime.base import ClientTool, Done, Runtime, TurnInput, TurnStream
from portico.runtime.openai import SUMMARY_PROMPT, OpenAIRuntime
from portico.store.memory import MemoryStore
from support.fake_openai import (
    ENV,
    FakeOpenAI,
    Gate,
    Reply,
    agent_settings,
    chunk,
    failure,
    text,
    tool_calls,
)

WAIT = 5.0


def engine_for(runtime: Runtime, agent: AgentSettings) -> Engine:
    return Engine(
        store=MemoryStore(),
        runtimes={"default": runtime},
        agents={"default": agent},
        context_ttl=3600.0,
    )


def openai_engine(fake: FakeOpenAI, **settings: Any) -> Engine:
    agent = agent_settings(fake.base_url, **settings)
    return engine_for(OpenAIRuntime(agent, env=ENV), agent)


async def ask(engine: Engine, content: str) -> tuple[Turn, TurnEvent]:
    ended: asyncio.Future[TurnEvent] = asyncio.get_running_loop().create_future()

    def listener(event: TurnEvent) -> None:
        if isinstance(event, TERMINAL_EVENTS) and not ended.done():
            ended.set_result(event)

    message = UserMessage(principal="alice", agent="default", session_id="s1", content=content)
    turn = await engine.submit(message, listener)
    terminal = await asyncio.wait_for(ended, WAIT)
    assert await engine.wait_idle(WAIT)
    stored = await engine.store.get_turn(turn.id)
    assert stored is not None
    return stored, terminal


async def session_of(engine: Engine) -> Session:
    session = await engine.store.get_session("s1")
    assert session is not None
    return session


async def summaries(engine: Engine, count: int = 1) -> list[Message]:
    async with asyncio.timeout(WAIT):
        while True:
            found = [
                m for m in await engine.store.list_messages("s1") if m.content_type == "summary"
            ]
            if len(found) >= count:
                return found
            await asyncio.sleep(0.01)


async def test_the_turn_records_the_usage_of_every_round(fake: FakeOpenAI) -> None:
    fake.push(tool_calls(("current_time", {}), tokens=(100, 7)), text("noon", tokens=(130, 2)))
    engine = openai_engine(fake, tools=[{"kind": "builtin", "name": "current_time"}])
    turn, terminal = await ask(engine, "time?")
    assert isinstance(terminal, TurnCompleted)
    assert terminal.content == "noon"
    assert (turn.input_tokens, turn.output_tokens) == (230, 9)


async def test_compaction_asks_the_model_and_later_turns_start_at_its_summary(
    fake: FakeOpenAI,
) -> None:
    fake.push(text("Oslo is sunny."))
    engine = openai_engine(fake)
    await ask(engine, "weather in Oslo?")
    fake.push(text("The user asked about Oslo's weather: sunny."))
    assert engine.compact(await session_of(engine), "mention the city") is True
    (summary,) = await summaries(engine)
    assert (summary.role, summary.content_type) == ("system", "summary")
    assert msgspec.json.decode(summary.content) == [
        {"role": "instruction", "text": "mention the city"},
        {"role": "summary", "text": "The user asked about Oslo's weather: sunny."},
    ]
    summary_request = fake.bodies[1]["messages"]
    assert summary_request[0]["content"].startswith(SUMMARY_PROMPT)
    assert summary_request[1]["content"] == ("user: weather in Oslo?\n\nassistant: Oslo is sunny.")
    fake.push(text("Still sunny."))
    await ask(engine, "and now?")
    assert fake.bodies[2]["messages"] == [
        {
            "role": "system",
            "content": "Summary of the conversation so far:\n"
            "The user asked about Oslo's weather: sunny.",
        },
        {"role": "user", "content": "and now?"},
    ]


async def test_a_turn_during_a_slow_model_summary_stays_in_the_history(
    fake: FakeOpenAI,
) -> None:
    """The summary is archived after the raced turn's messages but does not cover them."""
    fake.push(text("one"))
    engine = openai_engine(fake)
    await ask(engine, "first")
    gate = Gate()
    fake.push(Reply(events=(gate, chunk({"content": "Summary of first."}, "stop"))))
    engine.compact(await session_of(engine), "")
    await fake.wait_for(2)  # the model is writing the summary
    fake.push(text("two"))
    await ask(engine, "raced")
    gate.open()
    (summary,) = await summaries(engine)
    assert (summary.global_offset, summary.metadata) == (5, {"summary_through": "2"})
    fake.push(text("three"))
    await ask(engine, "next")
    assert fake.bodies[3]["messages"] == [
        {"role": "system", "content": "Summary of the conversation so far:\nSummary of first."},
        {"role": "user", "content": "raced"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "next"},
    ]


async def test_a_model_that_cannot_summarise_leaves_the_extractive_summary(
    fake: FakeOpenAI,
) -> None:
    fake.push(text("an answer"))
    engine = openai_engine(fake)
    await ask(engine, "question")
    fake.push(failure(500))
    engine.compact(await session_of(engine), "")
    (summary,) = await summaries(engine)
    assert msgspec.json.decode(summary.content) == [
        {"role": "user", "text": "question"},
        {"role": "assistant", "text": "an answer"},
    ]


async def test_a_turn_past_the_token_budget_compacts_the_session(fake: FakeOpenAI) -> None:
    engine = openai_engine(fake, compact_after_tokens=50)
    fake.push(text("small", tokens=(50, 1)))
    await ask(engine, "within the budget")
    fake.push(text("big", tokens=(51, 1)), text("A summary."))
    await ask(engine, "past the budget")
    (summary,) = await summaries(engine)
    assert msgspec.json.decode(summary.content) == [{"role": "summary", "text": "A summary."}]
    assert len(fake.requests) == 3  # two turns, one summary: the first turn did not compact


class RecordingRuntime:
    def __init__(self) -> None:
        self.inputs: list[TurnInput] = []

    async def run(self, turn: TurnInput) -> TurnStream:
        self.inputs.append(turn)
        yield Done(content="ok")


async def test_the_agents_client_tools_are_offered_to_any_runtime() -> None:
    agent = msgspec.convert(
        {
            "tools": [
                {"kind": "client", "name": "get_location", "description": "configured"},
                {"kind": "builtin", "name": "current_time"},
            ]
        },
        AgentSettings,
    )
    runtime = RecordingRuntime()
    engine = engine_for(runtime, agent)
    declared = (
        ClientTool(name="get_location", description="the client's own"),
        ClientTool(name="get_time"),
    )
    await engine.submit(
        UserMessage(principal="a", agent="default", session_id="s1", client_tools=declared)
    )
    assert await engine.wait_idle(WAIT)
    offered = runtime.inputs[0].client_tools
    assert [(t.name, t.description) for t in offered] == [
        ("get_location", "configured"),
        ("get_time", ""),
    ]
