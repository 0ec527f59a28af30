"""Agent memory through a real server: the openai runtime's memory tools (the fake
model calls them) and a `runtime: python` handler's `turn.memory`, isolated per
principal and per memory facet (spec/identity.md, Memory facets)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import yaml

from support.agent_process import TESTS
from support.fake_openai import ENV, FAST, KEY_ENV, FakeOpenAI, text, tool_calls
from support.omnia import OmniaClient
from support.rpc import RpcProbe
from support.server import ServerProcess
from support.session import SessionProbe

ALICE, BOB = "alice-token", "bob-token"
MAX_ENTRIES = 3


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    model = FakeOpenAI().start()
    yield model
    model.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, fake: FakeOpenAI) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("portico-memory")
    model = {
        "runtime": "openai",
        "base_url": fake.base_url,
        "model": "fake-model",
        "api_key_env": KEY_ENV,
        "memory_tools": True,
        **FAST,
    }
    config = data_dir / "portico.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "auth": "apikey",
                "api_keys": {ALICE: "alice", BOB: "bob"},
                "memory_max_entries": MAX_ENTRIES,
                "agents": {
                    "model": model,
                    "plain": {**model, "memory_tools": False},
                    "plugin": {"runtime": "python", "plugin": "support.memory_agent:handler"},
                    "pinned": {
                        "runtime": "python",
                        "plugin": "support.memory_agent:handler",
                        "memory_facet": "acme",
                    },
                },
            }
        )
    )
    env = {**ENV, "PYTHONPATH": str(TESTS)}  # the plugin lives in tests/support
    process = ServerProcess(data_dir, args=("--config", str(config)), env=env).start()
    yield process
    process.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def ask(
    http: aiohttp.ClientSession, server: ServerProcess, query: str, content: str, token: str = ALICE
) -> dict[str, Any]:
    """One turn on a fresh connection; its terminal frame."""
    ws = await http.ws_connect(server.ws_url + query, headers={"Authorization": f"Bearer {token}"})
    client = OmniaClient(ws)
    await client.connected()
    frames = await client.ask(content)
    await ws.close()
    return frames[-1]


def tool_result(fake: FakeOpenAI) -> Any:
    """What the last request told the model its tool call returned."""
    messages = fake.bodies[-1]["messages"]
    tool = [message for message in messages if message["role"] == "tool"][-1]
    return json.loads(tool["content"])


async def model_calls(
    http: aiohttp.ClientSession,
    server: ServerProcess,
    fake: FakeOpenAI,
    call: tuple[str, dict[str, Any]],
    *,
    facet: str,
    token: str = ALICE,
) -> Any:
    fake.reset()
    fake.push(tool_calls(call), text("ok"))
    done = await ask(http, server, f"?agent=model&memory_facet={facet}", "go", token)
    assert done["type"] == "done", done
    return tool_result(fake)


async def test_model_memory_tools_are_offered_and_scoped_by_facet_and_principal(
    http: aiohttp.ClientSession, server: ServerProcess, fake: FakeOpenAI
) -> None:
    saved = await model_calls(
        http, server, fake, ("memory_save", {"content": "acme renewal is in May"}), facet="acme"
    )
    offered = {tool["function"]["name"] for tool in fake.bodies[0]["tools"]}
    assert {"memory_save", "memory_search", "memory_forget"} <= offered

    search = ("memory_search", {"query": "renewal"})
    same = await model_calls(http, server, fake, search, facet="acme")
    other_facet = await model_calls(http, server, fake, search, facet="globex")
    other_user = await model_calls(http, server, fake, search, facet="acme", token=BOB)

    assert "acme renewal is in May" in json.dumps(same)
    assert "renewal" not in json.dumps(other_facet)
    assert "renewal" not in json.dumps(other_user)
    # Forgetting from another facet does nothing; from its own, it is gone.
    memory_id = json.dumps(saved).split('"id": "')[1].split('"')[0]
    await model_calls(http, server, fake, ("memory_forget", {"id": memory_id}), facet="globex")
    assert "renewal" in json.dumps(await model_calls(http, server, fake, search, facet="acme"))
    await model_calls(http, server, fake, ("memory_forget", {"id": memory_id}), facet="acme")
    assert "renewal" not in json.dumps(await model_calls(http, server, fake, search, facet="acme"))


async def test_a_full_facet_refuses_to_the_model(
    http: aiohttp.ClientSession, server: ServerProcess, fake: FakeOpenAI
) -> None:
    for n in range(MAX_ENTRIES):
        await model_calls(http, server, fake, ("memory_save", {"content": f"n{n}"}), facet="full")
    fake.reset()
    fake.push(tool_calls(("memory_save", {"content": "more"})), text("ok"))
    done = await ask(http, server, "?agent=model&memory_facet=full", "go")
    assert "full" in json.dumps(tool_result(fake))
    # The refusal is on the session's trace as the tool's outcome (no arguments).
    rpc = await RpcProbe.open(http, f"ws://127.0.0.1:{server.port}/v1/rpc", token=ALICE)
    async with asyncio.timeout(10.0):
        while True:
            trace = await rpc.call("v1.session.trace", {"session_id": done["session_id"]})
            outcomes = [item["data"] for item in trace["items"] if item["type"] == "tool.outcome"]
            if outcomes:
                break
            await asyncio.sleep(0.05)
    assert outcomes == [{"tool": "memory_save", "status": "error"}]


async def test_an_agent_without_memory_tools_offers_none(
    http: aiohttp.ClientSession, server: ServerProcess, fake: FakeOpenAI
) -> None:
    fake.reset()
    fake.push(text("hello"))
    assert (await ask(http, server, "?agent=plain", "hi"))["type"] == "done"
    offered = {tool["function"]["name"] for tool in fake.bodies[0].get("tools", [])}
    assert not offered & {"memory_save", "memory_search", "memory_forget"}


async def test_python_handler_memory_is_scoped_by_facet_and_principal(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    saved = await ask(http, server, "?agent=plugin&memory_facet=acme", "save plugin fact")
    assert saved["type"] == "done"
    assert saved["content"].startswith("mem")

    async def search(facet: str, token: str = ALICE) -> list[str]:
        done = await ask(http, server, f"?agent=plugin&memory_facet={facet}", "search fact", token)
        found: list[str] = json.loads(done["content"])
        return found

    assert await search("acme") == ["plugin fact"]
    assert await search("globex") == []
    assert await search("acme", BOB) == []
    # Memory written by the model runtime's agent is another agent's: not seen here.
    assert "acme renewal" not in json.dumps(await search("acme"))


async def test_an_agents_fixed_facet_scopes_every_protocols_turns(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    saved = await ask(http, server, "?agent=pinned", "save pinned fact")
    assert saved["type"] == "done"
    probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
    assert (await probe.hello(credential=ALICE, agent="pinned"))["type"] == "ready"
    await probe.message("search pinned")
    done = (await probe.turn())[-1]
    assert json.loads(done["content"]) == ["pinned fact"]
    # The facet-less memory of an agent without a fixed facet is another key.
    found = await ask(http, server, "?agent=plugin", "search pinned")
    assert json.loads(found["content"]) == []
