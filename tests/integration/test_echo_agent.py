"""The example agent (examples/echo_agent) behind a real `portico serve`, over /ws and
/v1/session, its client tool answered by the test client.

The same test bodies run against every way of hosting the handler: in Portico's process
(`runtime: python`) and in its own (`portico agent serve` behind `runtime: grpc`)."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from support.agent_process import REPO, AgentProcess
from support.frames import frame_kinds, streamed_text
from support.omnia import OmniaClient
from support.server import ServerProcess
from support.session import SessionProbe

HANDLER = "examples.echo_agent.agent:handler"
GRPC_MERGED = importlib.util.find_spec("portico.runtime.grpc") is not None
HOSTS = [
    "python",
    pytest.param(
        "grpc",
        marks=pytest.mark.skipif(not GRPC_MERGED, reason="runtime: grpc not merged yet"),
    ),
]


@pytest.fixture(scope="module", params=HOSTS)
def portico(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """`portico serve` whose default agent is the example handler, hosted as `param`."""
    data_dir = tmp_path_factory.mktemp(f"echo-{request.param}")
    env = {"PYTHONPATH": str(REPO)}
    agent: AgentProcess | None = None
    if request.param == "python":
        env |= {"PORTICO_RUNTIME": "python", "PORTICO_PLUGIN": HANDLER}
    else:
        agent = AgentProcess(HANDLER, data_dir / "agent.log").start()
        env |= {"PORTICO_RUNTIME": "grpc", "PORTICO_GRPC_TARGET": agent.target}
    server = ServerProcess(data_dir, env=env).start()
    yield server
    server.stop()
    if agent is not None:
        agent.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def omnia(http: aiohttp.ClientSession, server: ServerProcess) -> OmniaClient:
    client = OmniaClient(await http.ws_connect(server.ws_url))
    await client.connected()
    return client


async def session(http: aiohttp.ClientSession, server: ServerProcess) -> SessionProbe:
    probe = await SessionProbe.connect(http, server.ws_url.replace("/ws", "/v1/session"))
    ready = await probe.hello(capabilities=["tools"])
    assert ready["type"] == "ready", ready
    return probe


async def test_ws_streams_the_words_and_counts_the_conversation(
    http: aiohttp.ClientSession, portico: ServerProcess
) -> None:
    client = await omnia(http, portico)
    first = await client.ask("hello there")
    assert streamed_text(first) == "You said: hello there (message 1 of this conversation)"
    assert frame_kinds(first) == ["chunk", "done"]
    assert first[-1]["content"] == "You said: hello there (message 1 of this conversation)"
    second = await client.ask("again")  # the history reaches the handler
    assert second[-1]["content"] == "You said: again (message 2 of this conversation)"


async def test_ws_client_tool_result_reaches_the_handler(
    http: aiohttp.ClientSession, portico: ServerProcess
) -> None:
    client = await omnia(http, portico)
    await client.send({"type": "message", "content": "what time is it?"})
    assert (await client.recv())["content"] == "Let me look at your clock. "
    call = await client.recv()
    assert call["type"] == "tool_call", call
    assert call["tool_call"]["name"] == "get_time"
    assert call["tool_call"]["consent_message"] == (
        "The echo agent wants to read your device's clock."
    )
    assert call["tool_call"]["categories"] == ["time"]
    result = {"call_id": call["tool_call"]["id"], "result": "12:00"}
    await client.send({"type": "tool_result", "tool_result": result})
    frames = await client.turn()
    assert frames[-1]["type"] == "done"
    assert frames[-1]["content"] == (
        "Let me look at your clock. Your device says 12:00. (message 1 of this conversation)"
    )


async def test_ws_client_tool_error_reaches_the_handler_as_a_rejection(
    http: aiohttp.ClientSession, portico: ServerProcess
) -> None:
    client = await omnia(http, portico)
    await client.send({"type": "message", "content": "time please"})
    await client.recv()
    call = await client.recv()
    result = {"call_id": call["tool_call"]["id"], "error": "no clock here"}
    await client.send({"type": "tool_result", "tool_result": result})
    done = (await client.turn())[-1]
    assert done["type"] == "done"
    assert "I could not read it (no clock here)." in done["content"]


async def test_session_streams_and_answers_its_client_tool(
    http: aiohttp.ClientSession, portico: ServerProcess
) -> None:
    probe = await session(http, portico)
    await probe.message("hello there")
    first = await probe.turn()
    assert first[-1]["type"] == "done"
    assert first[-1]["content"] == "You said: hello there (message 1 of this conversation)"
    await probe.message("what time is it?")
    frames = [await probe.recv_numbered(), await probe.recv_numbered()]
    assert frames[0]["content"] == "Let me look at your clock. "
    assert frames[1]["type"] == "tool_call", frames[1]
    await probe.numbered("tool_result", call_id=frames[1]["tool_call"]["id"], result="noon")
    done = (await probe.turn())[-1]
    assert done["type"] == "done"
    assert done["content"] == (
        "Let me look at your clock. Your device says noon. (message 2 of this conversation)"
    )


def test_the_example_readme_names_both_commands() -> None:
    readme = (REPO / "examples" / "echo_agent" / "README.md").read_text()
    assert f"portico agent serve {HANDLER} --port 50051" in readme
    assert f"PORTICO_RUNTIME=python PORTICO_PLUGIN={HANDLER} portico serve" in readme
    assert Path(REPO / "examples" / "echo_agent" / "agent.py").is_file()
