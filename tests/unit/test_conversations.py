"""The RPC domain over a real engine and the memory archive."""

from __future__ import annotations

import time

from portico.config import AgentSettings
from portico.core.conversations import Conversations, SendRequest
from portico.core.engine import Engine
from portico.core.tools import ClientToolBroker
from portico.runtime.base import AGENT_PROMPT, Done, TurnInput, TurnStream
from portico.store.memory import MemoryStore


class Recording:
    def __init__(self) -> None:
        self.inputs: list[TurnInput] = []

    async def run(self, turn: TurnInput) -> TurnStream:
        self.inputs.append(turn)
        yield Done("ok")


def conversations(runtime: Recording) -> tuple[Engine, Conversations]:
    store = MemoryStore()
    engine = Engine(
        store=store,
        runtimes={"default": runtime},
        agents={"default": AgentSettings()},
        context_ttl=60.0,
    )
    tools = ClientToolBroker(store=store, ack_timeout=1.0, answer_timeout=1.0, clock=time.time)
    return engine, Conversations(engine, tools, default_agent="default")


async def test_agent_prompt_reaches_the_runtime_as_a_directive_not_as_metadata() -> None:
    runtime = Recording()
    engine, rpc = conversations(runtime)
    request = SendRequest(
        content="hi", client_id="c1", agent_prompt="answer in French", metadata={"k": "v"}
    )
    await rpc.send("alice", request)
    assert await engine.wait_idle(5.0)
    (turn,) = runtime.inputs
    assert turn.directives == {AGENT_PROMPT: "answer in French"}
    assert turn.message.metadata == {"k": "v"}
