"""MCP tools of the openai runtime against real MCP servers, with the fake OpenAI server
as the model: the reference server `@modelcontextprotocol/server-everything` (npm) over
stdio and over streamable HTTP, and `mcp_faulty.py`, whose tools hang, crash and fail.

Each test drives `OpenAIRuntime` turns as the engine does; the model's tool calls run
in real MCP server processes, and what the model was sent back is read from the fake's
recorded requests.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from portico.runtime.base import Done, RuntimeEvent
from portico.runtime.openai import OpenAIRuntime
from support.fake_openai import (
    ENV,
    FakeOpenAI,
    agent_settings,
    drive,
    message,
    streamed_text,
    text,
    tool_calls,
    turn_input,
)
from support.mcp_servers import (
    HttpMcpServer,
    everything_http,
    everything_stdio,
    faulty_http,
    faulty_stdio,
)

SECRET_ENV = "MCP_TEST_SECRET"
SECRET = "s3cr3t-token-for-the-mcp-server"
PID = re.compile(r"pid=(\d+)")
FAULTY_TOOLS = ("ok", "hang", "crash", "fail", "whoami")


@pytest.fixture
def fake(fake_model: FakeOpenAI) -> FakeOpenAI:
    fake_model.reset()
    return fake_model


@pytest.fixture(scope="module")
def everything_web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpMcpServer]:
    server = everything_http(tmp_path_factory.mktemp("mcp-http") / "server.log").start()
    yield server
    server.stop()


@pytest.fixture
def faulty_web(tmp_path: Path) -> Iterator[HttpMcpServer]:
    server = faulty_http(tmp_path / "server.log").start()
    yield server
    server.stop()


_opened: list[OpenAIRuntime] = []


@pytest.fixture(autouse=True)
async def _close_runtimes() -> AsyncIterator[None]:
    yield
    while _opened:
        await _opened.pop().close()


def runtime(fake: FakeOpenAI, servers: dict[str, Any], **overrides: Any) -> OpenAIRuntime:
    settings = agent_settings(fake.base_url, mcp_servers=servers, **overrides)
    made = OpenAIRuntime(settings, env={**ENV, SECRET_ENV: SECRET})
    _opened.append(made)
    return made


def offered(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {tool["function"]["name"]: tool["function"] for tool in body.get("tools", ())}


def tool_answers(body: dict[str, Any]) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


def tool_error(content: str) -> str:
    error: str = json.loads(content)["error"]
    return error


async def call_turn(
    model: OpenAIRuntime, fake: FakeOpenAI, tool: str, arguments: dict[str, Any]
) -> tuple[list[RuntimeEvent], str]:
    """One turn in which the model calls `tool` once and then answers; the events and
    what the tool message told the model."""
    before = len(fake.requests)
    fake.push(tool_calls((tool, arguments)), text("answered"))
    events, _ = await drive(model, turn_input(message("go")))
    requests = await fake.wait_for(before + 2)
    (answer,) = tool_answers(requests[before + 1].body)
    return events, answer


# -- the reference server over stdio -----------------------------------------------------------


async def test_the_reference_servers_tools_are_offered_and_a_call_reaches_the_model(
    fake: FakeOpenAI,
) -> None:
    servers = {"everything": {**everything_stdio(), "tools": ["get-sum", "echo"]}}
    model = runtime(fake, servers)
    events, answer = await call_turn(model, fake, "everything__get-sum", {"a": 2, "b": 40})
    assert answer == "The sum of 2 and 40 is 42."
    assert streamed_text(events) == "answered"
    assert events[-1] == Done()
    tools = offered(fake.requests[0].body)
    assert set(tools) == {"everything__get-sum", "everything__echo"}  # the allow-list
    schema = tools["everything__get-sum"]["parameters"]
    assert schema["required"] == ["a", "b"]
    assert tools["everything__get-sum"]["description"] == "Returns the sum of two numbers"


async def test_arguments_are_checked_against_the_servers_schema_before_any_call(
    fake: FakeOpenAI,
) -> None:
    model = runtime(fake, {"everything": {**everything_stdio(), "tools": ["get-sum"]}})
    _, answer = await call_turn(model, fake, "everything__get-sum", {"a": "two"})
    assert tool_error(answer).startswith("invalid arguments")


async def test_env_from_passes_a_secret_to_the_server_and_never_to_the_log(
    fake: FakeOpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server = {**everything_stdio(), "env_from": {"UPSTREAM_TOKEN": SECRET_ENV}, "env": {"A": "b"}}
    model = runtime(fake, {"everything": server})
    _, answer = await call_turn(model, fake, "everything__get-env", {})
    seen = json.loads(answer)
    assert seen["UPSTREAM_TOKEN"] == SECRET
    assert seen["A"] == "b"
    assert SECRET_ENV not in seen  # only what the server was given, not Portico's environment
    assert SECRET not in caplog.text
    assert "everything" in caplog.text  # the connection was logged, without the secret


async def test_media_in_a_result_becomes_a_note_beside_the_text(fake: FakeOpenAI) -> None:
    model = runtime(fake, {"everything": everything_stdio()})
    _, answer = await call_turn(model, fake, "everything__get-tiny-image", {})
    assert "[image image/png, not shown]" in answer
    assert "iVBOR" not in answer  # the base64 image is not sent as text


# -- the reference server over streamable HTTP --------------------------------------------------


async def test_the_reference_server_over_streamable_http(
    fake: FakeOpenAI, everything_web: HttpMcpServer
) -> None:
    model = runtime(fake, {"web": {"url": everything_web.url}})
    _, answer = await call_turn(model, fake, "web__echo", {"message": "over http"})
    assert answer == "Echo: over http"
    _, again = await call_turn(model, fake, "web__get-sum", {"a": 1, "b": 1})
    assert again == "The sum of 1 and 1 is 2."


async def test_headers_env_sends_a_secret_header_to_an_http_server(
    fake: FakeOpenAI, faulty_web: HttpMcpServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    server = {"url": faulty_web.url, "headers_env": {"Authorization": SECRET_ENV}}
    model = runtime(fake, {"web": server})
    _, answer = await call_turn(model, fake, "web__whoami", {})
    assert answer == SECRET
    assert SECRET not in caplog.text


async def test_an_http_server_that_goes_away_is_a_tool_error_and_is_reconnected(
    fake: FakeOpenAI, faulty_web: HttpMcpServer
) -> None:
    model = runtime(fake, {"web": {"url": faulty_web.url, "call_timeout": 5}})
    _, before = await call_turn(model, fake, "web__ok", {"word": "before"})
    faulty_web.stop()
    events, answer = await call_turn(model, fake, "web__ok", {"word": "gone"})
    assert tool_error(answer) == "MCP server 'web' closed the connection"
    assert events[-1] == Done()
    faulty_web.start(same_port=True)
    _, after = await call_turn(model, fake, "web__ok", {"word": "after"})
    assert after.startswith("ok after")
    assert PID.findall(after) != PID.findall(before)


# -- one connection per server, reused; failures cost a tool error ---------------------------


async def test_one_server_process_serves_every_turn(fake: FakeOpenAI) -> None:
    model = runtime(fake, {"faulty": faulty_stdio()})
    _, first = await call_turn(model, fake, "faulty__ok", {"word": "one"})
    _, second = await call_turn(model, fake, "faulty__ok", {"word": "two"})
    assert first.startswith("ok one")
    assert PID.findall(first) == PID.findall(second)


async def test_a_hanging_call_is_a_tool_error_and_the_next_turn_works(fake: FakeOpenAI) -> None:
    model = runtime(fake, {"faulty": {**faulty_stdio(), "call_timeout": 0.5}})
    _, before = await call_turn(model, fake, "faulty__ok", {"word": "before"})
    events, answer = await call_turn(model, fake, "faulty__hang", {})
    assert tool_error(answer) == "MCP server 'faulty' did not answer within 0.5 s"
    assert events[-1] == Done()
    _, after = await call_turn(model, fake, "faulty__ok", {"word": "after"})
    assert after.startswith("ok after")
    assert PID.findall(after) == PID.findall(before)  # a slow tool does not cost the server


async def test_a_server_that_exits_mid_call_is_a_tool_error_and_is_restarted(
    fake: FakeOpenAI,
) -> None:
    model = runtime(fake, {"faulty": faulty_stdio()})
    _, before = await call_turn(model, fake, "faulty__ok", {"word": "before"})
    events, answer = await call_turn(model, fake, "faulty__crash", {})
    assert tool_error(answer) == "MCP server 'faulty' closed the connection"
    assert events[-1] == Done()
    _, after = await call_turn(model, fake, "faulty__ok", {"word": "after"})
    assert after.startswith("ok after")
    assert PID.findall(after) != PID.findall(before)  # a new process


async def test_a_tool_that_raises_is_a_tool_error_with_its_message(fake: FakeOpenAI) -> None:
    model = runtime(fake, {"faulty": faulty_stdio()})
    _, answer = await call_turn(model, fake, "faulty__fail", {})
    assert "the disk is full" in tool_error(answer)


async def test_a_server_that_does_not_start_leaves_its_tools_out_of_the_turn(
    fake: FakeOpenAI, tmp_path: Path
) -> None:
    sleeper = {"command": "sleep", "args": ["60"], "start_timeout": 0.5}
    missing = {"command": str(tmp_path / "no-such-server")}
    model = runtime(fake, {"sleeper": sleeper, "missing": missing, "faulty": faulty_stdio()})
    events, answer = await call_turn(model, fake, "faulty__ok", {"word": "still"})
    assert answer.startswith("ok still")
    assert set(offered(fake.requests[0].body)) == {f"faulty__{name}" for name in FAULTY_TOOLS}
    assert events[-1] == Done()


# -- names ---------------------------------------------------------------------------------------


async def test_a_configured_tool_keeps_its_name_over_an_mcp_tool(fake: FakeOpenAI) -> None:
    client_echo = {"kind": "client", "name": "echo", "description": "the client's echo"}
    unprefixed = {**everything_stdio(), "tool_prefix": "", "tools": ["echo", "get-sum"]}
    servers = {"everything": unprefixed}
    model = runtime(fake, servers, tools=[client_echo])
    fake.push(text("hi"))
    await drive(model, turn_input(message("go")))
    tools = offered(fake.requests[0].body)
    assert set(tools) == {"echo", "get-sum"}
    assert tools["echo"]["description"] == "the client's echo"
