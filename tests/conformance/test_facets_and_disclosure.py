"""`/ws?memory_facet=`, `connected.ai_disclosure` / `ready.ai_disclosure`, and the
session trace (`disclosure_ack`, read with `v1.session.trace`), against a real server
(spec/identity.md, Memory facets; AI disclosure and the session trace)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import yaml

from support.omnia import OmniaClient, scenario
from support.rpc import RpcProbe
from support.server import SCRIPT, ServerProcess
from support.session import SessionProbe

ALICE = "alice-token"
BOB = "bob-token"
WAIT = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("portico-facets")
    config = data_dir / "portico.yaml"
    scripted = {"runtime": "scripted", "script": str(SCRIPT)}
    config.write_text(
        yaml.safe_dump(
            {
                "auth": "apikey",
                "api_keys": {ALICE: "alice", BOB: "bob"},
                **scripted,
                "agents": {
                    "pinned": {**scripted, "memory_facet": "acme", "requires_ai_disclosure": True},
                    "undisclosed": {**scripted, "requires_ai_disclosure": False},
                },
            }
        )
    )
    process = ServerProcess(data_dir, args=("--config", str(config))).start()
    yield process
    process.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def open_ws(
    http: aiohttp.ClientSession, server: ServerProcess, query: str = "", token: str = ALICE
) -> OmniaClient:
    ws = await http.ws_connect(server.ws_url + query, headers={"Authorization": f"Bearer {token}"})
    return OmniaClient(ws)


async def refusal(http: aiohttp.ClientSession, server: ServerProcess, query: str) -> int:
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await open_ws(http, server, query)
    return refused.value.status


# -- memory_facet at the upgrade --------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        "?memory_facet=",
        "?memory_facet=-starts-with-dash",
        "?memory_facet=.dot",
        "?memory_facet=" + "a" * 129,
        "?memory_facet=has%20space",
        "?memory_facet=caf%C3%A9",
        "?memory_facet=semi%3Bcolon",
        "?memory_facet=a&memory_facet=a",
        "?memory_facet=a&memory_facet=b",
    ],
)
async def test_malformed_empty_or_repeated_facet_is_400(
    http: aiohttp.ClientSession, server: ServerProcess, query: str
) -> None:
    assert await refusal(http, server, query) == 400


@pytest.mark.parametrize("facet", ["a", "Project-7.x_y:z/w", "9" + "b" * 127])
async def test_valid_facet_is_echoed_in_connected(
    http: aiohttp.ClientSession, server: ServerProcess, facet: str
) -> None:
    client = await open_ws(http, server, f"?memory_facet={facet}")
    connected = await client.connected()
    assert connected["connected"]["memory_facet"] == facet


async def test_without_a_facet_connected_has_none(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    client = await open_ws(http, server)
    assert "memory_facet" not in (await client.connected())["connected"]


async def test_fixed_facet_is_used_when_absent_and_accepted_when_named(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    for query in ("?agent=pinned", "?agent=pinned&memory_facet=acme"):
        client = await open_ws(http, server, query)
        assert (await client.connected())["connected"]["memory_facet"] == "acme"


async def test_another_facet_than_the_agents_fixed_one_is_403(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    assert await refusal(http, server, "?agent=pinned&memory_facet=globex") == 403
    # Malformed stays 400 on that agent too.
    assert await refusal(http, server, "?agent=pinned&memory_facet=") == 400


# -- AI disclosure ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agent", "expected"), [("pinned", True), ("undisclosed", False), ("default", None)]
)
async def test_connected_and_ready_carry_the_agents_disclosure(
    http: aiohttp.ClientSession, server: ServerProcess, agent: str, expected: bool | None
) -> None:
    client = await open_ws(http, server, f"?agent={agent}")
    connected = (await client.connected())["connected"]
    probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
    ready = await probe.hello(credential=ALICE, agent=agent)
    assert ready["type"] == "ready", ready
    if expected is None:
        assert "ai_disclosure" not in connected
        assert "ai_disclosure" not in ready
    else:
        assert connected["ai_disclosure"] is expected
        assert ready["ai_disclosure"] is expected


# -- the session trace ------------------------------------------------------------------


async def trace_of(rpc: RpcProbe, session_id: str) -> list[dict[str, Any]]:
    result = await rpc.call("v1.session.trace", {"session_id": session_id})
    assert result["session_id"] == session_id
    items: list[dict[str, Any]] = result["items"]
    return items


async def wait_for_trace(rpc: RpcProbe, session_id: str, kinds: set[str]) -> list[dict[str, Any]]:
    """The trace once it holds every kind in `kinds` (its writes are not awaited)."""
    async with asyncio.timeout(WAIT):
        while True:
            items = await trace_of(rpc, session_id)
            if kinds <= {item["type"] for item in items}:
                return items
            await asyncio.sleep(0.05)


async def test_disclosure_ack_and_metadata_are_on_the_owners_trace_only(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    client = await open_ws(http, server, "?agent=pinned")
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "disclosure_ack"})
    await client.expect_silence(0.2)  # no reply by spec
    turn = await client.ask("hi", metadata={"ticket": "T-1"})
    assert turn[-1]["type"] == "done"

    rpc_url = f"ws://127.0.0.1:{server.port}/v1/rpc"
    alice = await RpcProbe.open(http, rpc_url, token=ALICE)
    items = await wait_for_trace(alice, session_id, {"ai.disclosure.displayed", "message.metadata"})
    first = items[0]
    assert first["type"] == "ai.disclosure.displayed"
    assert first["data"] == {"assertedBy": "client"}
    assert first["at"].endswith("Z")
    metadata = next(item for item in items if item["type"] == "message.metadata")
    assert metadata["data"]["metadata"] == {"ticket": "T-1"}

    bob = await RpcProbe.open(http, rpc_url, token=BOB)
    error = await bob.error("v1.session.trace", {"session_id": session_id})
    missing = await bob.error("v1.session.trace", {"session_id": "sess-nobody"})
    assert error["code"] == missing["code"] == "session.not_found"


async def test_a_failed_turn_is_on_the_trace_as_an_error(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    client = await open_ws(http, server)
    session_id = (await client.connected())["session_id"]
    turn = await client.ask("hi", metadata={"mock_scenario": "fail"})
    assert turn[-1]["type"] == "error"
    alice = await RpcProbe.open(http, f"ws://127.0.0.1:{server.port}/v1/rpc", token=ALICE)
    items = await wait_for_trace(alice, session_id, {"error"})
    error = next(item for item in items if item["type"] == "error")
    assert error["data"]["code"] == turn[-1]["error"]["code"]


async def test_client_tool_outcomes_are_on_the_trace_without_arguments(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    client = await open_ws(http, server)
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "message", "content": "where am I", **scenario("tool")})
    call = await client.recv()
    assert call["type"] == "tool_call", call
    call_id = call["tool_call"]["id"]
    await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call_id}})
    result = {"call_id": call_id, "result": {"city": "Oslo"}}
    await client.send({"type": "tool_result", "tool_result": result})
    assert (await client.turn())[-1]["type"] == "done"

    alice = await RpcProbe.open(http, f"ws://127.0.0.1:{server.port}/v1/rpc", token=ALICE)
    items = await wait_for_trace(alice, session_id, {"tool.outcome"})
    outcome = next(item for item in items if item["type"] == "tool.outcome")
    assert outcome["data"] == {"tool": "get_location", "status": "completed"}
