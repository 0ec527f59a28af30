"""Agent memory through a real server: the openai runtime's memory tools (the fake
model calls them) and a `portico.agent` handler's `turn.memory`, isolated per
principal and per memory facet (spec/identity.md, Memory facets), on SQLite and on
PostgreSQL.

The handler (tests/support/memory_agent.py) passes the same tests in both of its
placements: in Portico's process (`runtime: python`) and in its own behind
`portico serve` with `runtime: grpc` (`portico agent serve`), where its memory calls
travel the runtime contract as reserved tool calls the facade answers
(docs/runtime-grpc.md, "Agent memory"). What only a served agent has (a facade that
offers no memory, the memory call's deadline) is tested on the raw contract."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import grpc
import pytest
import yaml

from portico.contract import runtime_pb2 as pb
from portico.contract import runtime_pb2_grpc as pb_grpc
from portico.domain.memory_calls import OFFER_KEY, OFFERED, SAVE
from support.agent_process import TESTS, AgentProcess
from support.fake_openai import ENV, FAST, KEY_ENV, FakeOpenAI, text, tool_calls
from support.omnia import OmniaClient
from support.postgres import create_schema, drop_schemas, require_postgres, schema_url
from support.rpc import RpcProbe
from support.server import ServerProcess
from support.session import SessionProbe

ALICE, BOB = "alice-token", "bob-token"
MAX_ENTRIES = 3
HANDLER = "support.memory_agent:handler"
SHORT_MEMORY_TIMEOUT = 0.3
WITHIN = 10.0


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    model = FakeOpenAI().start()
    yield model
    model.stop()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """The handler in its own process: `portico agent serve`."""
    log = tmp_path_factory.mktemp("memory-agent") / "agent.log"
    process = AgentProcess(HANDLER, log).start()
    yield process
    process.stop()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest) -> Iterator[tuple[tuple[str, ...], dict[str, str]]]:
    """The archive the server keeps memory in: its args and environment."""
    if request.param == "sqlite":
        yield (), {}
        return
    require_postgres()
    schema = asyncio.run(create_schema())  # a fresh one: no other test's memories
    yield ("--store", "postgres"), {"PORTICO_DATABASE_URL": schema_url(schema)}
    asyncio.run(drop_schemas([schema]))


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    fake: FakeOpenAI,
    agent: AgentProcess,
    store: tuple[tuple[str, ...], dict[str, str]],
) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("portico-memory")
    store_args, store_env = store
    served = {"runtime": "grpc", "grpc_target": agent.target}
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
                    "plugin": {"runtime": "python", "plugin": HANDLER},
                    "pinned": {"runtime": "python", "plugin": HANDLER, "memory_facet": "acme"},
                    "served": served,
                    "served_pinned": {**served, "memory_facet": "acme"},
                },
            }
        )
    )
    env = {**ENV, **store_env, "PYTHONPATH": str(TESTS)}  # the plugin lives in tests/support
    args = ("--config", str(config), *store_args)
    process = ServerProcess(data_dir, args=args, env=env).start()
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


# -- a portico.agent handler, in process and served -----------------------------------------

# Placement -> (its agent, the same handler's agent with a fixed facet).
PLACEMENTS = {"python": ("plugin", "pinned"), "grpc": ("served", "served_pinned")}


@pytest.fixture(params=list(PLACEMENTS))
def placement(request: pytest.FixtureRequest) -> tuple[str, str]:
    agents: tuple[str, str] = PLACEMENTS[request.param]
    return agents


async def say(
    http: aiohttp.ClientSession,
    server: ServerProcess,
    agent: str,
    content: str,
    *,
    facet: str | None = None,
    token: str = ALICE,
) -> str:
    query = f"?agent={agent}" + ("" if facet is None else f"&memory_facet={facet}")
    done = await ask(http, server, query, content, token)
    assert done["type"] == "done", done
    reply: str = done["content"]
    return reply


async def test_handler_memory_is_scoped_by_facet_and_principal(
    http: aiohttp.ClientSession, server: ServerProcess, placement: tuple[str, str]
) -> None:
    agent, _ = placement
    saved = await say(http, server, agent, "save plugin fact", facet="acme")
    memory_id, key = saved.split(" ")
    assert memory_id.startswith("mem")
    assert key == f"alice/{agent}/acme"  # the turn's key, whatever the host

    async def search(facet: str, token: str = ALICE) -> list[str]:
        found: list[str] = json.loads(
            await say(http, server, agent, "search fact", facet=facet, token=token)
        )
        return found

    assert await search("acme") == ["plugin fact"]
    assert await search("globex") == []
    assert await search("acme", BOB) == []
    # Memory written by the model runtime's agent is another agent's: not seen here.
    assert "acme renewal" not in json.dumps(await search("acme"))


async def test_handler_searches_newest_first_and_forgets_in_its_own_key_only(
    http: aiohttp.ClientSession, server: ServerProcess, placement: tuple[str, str]
) -> None:
    agent, _ = placement
    first = (await say(http, server, agent, "save a Fact one", facet="sf")).split(" ")[0]
    await say(http, server, agent, "save a fact two", facet="sf")
    await say(http, server, agent, "save unrelated", facet="sf")
    found = json.loads(await say(http, server, agent, "search FACT", facet="sf"))
    assert found == ["a fact two", "a Fact one"]
    assert json.loads(await say(http, server, agent, "latest", facet="sf")) == ["unrelated"]
    # Another facet's or another user's forget finds nothing; the owner's forgets once.
    assert await say(http, server, agent, f"forget {first}", facet="other") == "unknown"
    assert await say(http, server, agent, f"forget {first}", facet="sf", token=BOB) == "unknown"
    assert await say(http, server, agent, f"forget {first}", facet="sf") == "forgotten"
    assert await say(http, server, agent, f"forget {first}", facet="sf") == "unknown"
    found = json.loads(await say(http, server, agent, "search fact", facet="sf"))
    assert found == ["a fact two"]


async def test_a_full_facet_refuses_the_handler_with_memory_full(
    http: aiohttp.ClientSession, server: ServerProcess, placement: tuple[str, str]
) -> None:
    agent, _ = placement
    for n in range(MAX_ENTRIES):
        assert (await say(http, server, agent, f"save n{n}", facet="full")).startswith("mem")
    ws = await http.ws_connect(
        server.ws_url + f"?agent={agent}&memory_facet=full",
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    client = OmniaClient(ws)
    await client.connected()
    refused = (await client.ask("save one more"))[-1]
    assert refused["content"] == f"full: memory is full ({MAX_ENTRIES} entries); forget one"
    empty = (await client.ask("save  "))[-1]
    assert empty["content"] == "invalid: a memory needs some content"
    await ws.close()
    # Both refusals are on the session's trace as the memory tool's outcome (no content).
    rpc = await RpcProbe.open(http, f"ws://127.0.0.1:{server.port}/v1/rpc", token=ALICE)
    async with asyncio.timeout(WITHIN):
        while True:
            trace = await rpc.call("v1.session.trace", {"session_id": refused["session_id"]})
            outcomes = [item["data"] for item in trace["items"] if item["type"] == "tool.outcome"]
            if len(outcomes) >= 2:
                break
            await asyncio.sleep(0.05)
    assert outcomes == [{"tool": SAVE, "status": "error"}] * 2


async def test_an_agents_fixed_facet_scopes_every_protocols_turns(
    http: aiohttp.ClientSession, server: ServerProcess, placement: tuple[str, str]
) -> None:
    plain, pinned = placement
    saved = await say(http, server, pinned, "save pinned fact")
    assert saved.endswith(f"/{pinned}/acme")
    probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
    assert (await probe.hello(credential=ALICE, agent=pinned))["type"] == "ready"
    await probe.message("search pinned")
    done = (await probe.turn())[-1]
    assert json.loads(done["content"]) == ["pinned fact"]
    # The facet-less memory of an agent without a fixed facet is another key.
    assert json.loads(await say(http, server, plain, "search pinned")) == []


# -- the served handler on the raw contract ---------------------------------------------------


@pytest.fixture(scope="module")
def impatient_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    log = tmp_path_factory.mktemp("impatient-memory-agent") / "agent.log"
    args = ("--memory-timeout", str(SHORT_MEMORY_TIMEOUT))
    process = AgentProcess(HANDLER, log, args=args).start()
    yield process
    process.stop()


async def contract_turn(
    call: grpc.aio.StreamStreamCall[pb.ClientMessage, pb.ServerMessage],
) -> list[pb.ServerMessage]:
    messages: list[pb.ServerMessage] = []
    async with asyncio.timeout(WITHIN):
        while not messages or messages[-1].WhichOneof("message") not in ("done", "error"):
            message = await call.read()
            assert isinstance(message, pb.ServerMessage), "the stream ended"
            messages.append(message)
    return messages


async def test_behind_a_facade_that_offers_no_memory_the_handler_has_none(
    agent: AgentProcess,
) -> None:
    # Omnia's facade sends no offer: a memory call would reach its client as a tool call.
    async with grpc.aio.insecure_channel(agent.target) as channel:
        health = await pb_grpc.RuntimeServiceStub(channel).Health(pb.HealthRequest())
        assert "portico.memory" in health.capabilities
        call = pb_grpc.RuntimeServiceStub(channel).Converse()
        await call.write(pb.ClientMessage(session_id="s-omnia", content="save x"))
        turn = await contract_turn(call)
        call.cancel()
    assert [message.WhichOneof("message") for message in turn] == ["chunk", "done"]
    assert turn[-1].done.final_content == "no memory"


async def test_an_unanswered_memory_call_fails_the_handlers_call_at_its_deadline(
    impatient_agent: AgentProcess,
) -> None:
    async with grpc.aio.insecure_channel(impatient_agent.target) as channel:
        call = pb_grpc.RuntimeServiceStub(channel).Converse()
        opening = pb.ClientMessage(
            session_id="s-late", content="save x", metadata={OFFER_KEY: OFFERED}
        )
        await call.write(opening)
        async with asyncio.timeout(WITHIN):
            first = await call.read()
        assert isinstance(first, pb.ServerMessage)
        tool_call = first.tool_call
        assert (tool_call.name, tool_call.execution) == (SAVE, pb.TOOL_EXECUTION_CLIENT)
        assert json.loads(tool_call.arguments_json) == {"content": "x"}
        # Never answered: the handler's save raises (an archive failure in process), so
        # this handler, which does not catch it, fails its turn with the generic error.
        (error,) = await contract_turn(call)
        call.cancel()
    assert (error.error.code, error.error.message) == ("INTERNAL_ERROR", "internal error")
