"""A real `portico serve` process fronting the fake OpenAI server: a streamed answer on
`/ws`, server-side and client-side tools on `/ws`, `/v1/session` and `/v1/rpc`, errors
as frames, the metadata template, an image, and history after a compaction.

The default agent is configured the way `portico serve --runtime openai` is, from
`PORTICO_*` variables; the `assistant` agent, with tools and short timeouts, comes from
the config file.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import yaml

from portico.client import SessionClient
from support.fake_openai import (
    ENV,
    FAST,
    KEY,
    KEY_ENV,
    FakeOpenAI,
    ToolApi,
    failure,
    text,
    tool_calls,
)
from support.omnia import OmniaClient
from support.rpc import RpcProbe
from support.server import ServerProcess

ASSISTANT = "assistant"
WITHIN = 10.0
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\nnot really a png").decode()
LOCATION = {
    "kind": "client",
    "name": "get_location",
    "description": "where the user is",
    "consent_message": "Share your location?",
    "categories": ["location"],
}


@pytest.fixture(scope="module")
def services() -> Iterator[tuple[FakeOpenAI, ToolApi]]:
    fake, api = FakeOpenAI().start(), ToolApi().start()
    yield fake, api
    fake.stop()
    api.stop()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, services: tuple[FakeOpenAI, ToolApi]
) -> Iterator[ServerProcess]:
    fake, api = services
    data_dir = tmp_path_factory.mktemp("portico-openai")
    assistant = {
        "runtime": "openai",
        "base_url": fake.base_url,
        "model": "fake-model",
        "provider": "fake",
        "api_key_env": KEY_ENV,
        "message_metadata_template": "[user {{user_id}}]",
        **FAST,
        "tools": [
            {"kind": "builtin", "name": "current_time"},
            {
                "kind": "http",
                "name": "weather",
                "url": api.base_url + "/weather/{city}",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
            LOCATION,
        ],
    }
    config = data_dir / "portico.yaml"
    config.write_text(yaml.safe_dump({"agents": {ASSISTANT: assistant}}))
    env = {
        **ENV,
        "PORTICO_RUNTIME": "openai",
        "PORTICO_OPENAI_BASE_URL": fake.base_url,
        "PORTICO_OPENAI_MODEL": "default-model",
        "PORTICO_OPENAI_API_KEY_ENV": KEY_ENV,
        "PORTICO_OPENAI_SYSTEM_PROMPT": "You are Portico's test agent.",
    }
    process = ServerProcess(data_dir, args=("--config", str(config)), env=env).start()
    yield process
    process.stop()


@pytest.fixture
def fake(services: tuple[FakeOpenAI, ToolApi]) -> FakeOpenAI:
    services[0].reset()
    return services[0]


@pytest.fixture
def api(services: tuple[FakeOpenAI, ToolApi]) -> ToolApi:
    services[1].requests.clear()
    return services[1]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def omnia(http: aiohttp.ClientSession, server: ServerProcess, agent: str = "") -> OmniaClient:
    query = f"?agent={agent}" if agent else ""
    client = OmniaClient(await http.ws_connect(server.ws_url + query))
    await client.connected()
    return client


def tool_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body["messages"] if m["role"] == "tool"]


# -- /ws --------------------------------------------------------------------------------------


async def test_a_streamed_answer_on_ws(
    http: aiohttp.ClientSession, server: ServerProcess, fake: FakeOpenAI
) -> None:
    fake.push(text("Hello ", "from ", "the model"))
    client = await omnia(http, server)
    frames = await client.ask("hi")
    assert [f["content"] for f in frames if f["type"] == "chunk"] == [
        "Hello ",
        "from ",
        "the model",
    ]
    assert frames[-1]["type"] == "done"
    (request,) = fake.requests
    assert request.headers["Authorization"] == f"Bearer {KEY}"
    assert request.body["model"] == "default-model"
    assert request.body["messages"] == [
        {"role": "system", "content": "You are Portico's test agent."},
        {"role": "user", "content": "hi"},
    ]
    fake.push(text("again"))
    await client.ask("and again")
    assert [m["role"] for m in fake.bodies[1]["messages"]] == [
        "system",
        "user",
        "assistant",
        "user",
    ]


async def test_a_client_tool_on_ws(
    http: aiohttp.ClientSession, server: ServerProcess, fake: FakeOpenAI
) -> None:
    fake.push(tool_calls(("get_location", {})), text("You are in Oslo."))
    client = await omnia(http, server, ASSISTANT)
    await client.send({"type": "message", "content": "where am I?"})
    call = await client.recv()
    assert call["type"] == "tool_call", call
    info = call["tool_call"]
    assert (info["name"], info["arguments"]) == ("get_location", {})
    assert (info["consent_message"], info["categories"]) == ("Share your location?", ["location"])
    call_id = info["id"]
    await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call_id}})
    result = {"call_id": call_id, "result": {"city": "Oslo"}}
    await client.send({"type": "tool_result", "tool_result": result})
    frames = await client.turn()
    assert frames[-1]["type"] == "done"
    assert "".join(f["content"] for f in frames if f["type"] == "chunk") == "You are in Oslo."
    (answer,) = tool_messages(fake.bodies[1])
    assert answer["content"] == '{"city": "Oslo"}'


async def test_a_server_side_http_tool_never_reaches_the_client(
    http: aiohttp.ClientSession, server: ServerProcess, fake: FakeOpenAI, api: ToolApi
) -> None:
    fake.push(tool_calls(("weather", {"city": "Bergen"})), text("21 degrees in Bergen."))
    client = await omnia(http, server, ASSISTANT)
    frames = await client.ask("weather?")
    assert [f["type"] for f in frames] == ["chunk", "done"]
    assert [r.path for r in api.requests] == ["/weather/Bergen"]
    (answer,) = tool_messages(fake.bodies[1])
    assert json.loads(answer["content"])["city"] == "Bergen"


async def test_rate_limited_provider_ends_the_turn_with_its_code(
    http: aiohttp.ClientSession, server: ServerProcess, fake: FakeOpenAI
) -> None:
    fake.push(failure(429), failure(429), failure(429))
    client = await omnia(http, server, ASSISTANT)
    frames = await client.ask("hi")
    assert [f["type"] for f in frames] == ["error"]
    assert frames[0]["error"] == {
        "code": "PROVIDER_RATE_LIMITED",
        "message": "model fake-model (fake): rate limited (HTTP 429) after 3 attempts",
    }
    assert len(fake.requests) == 3
    await client.expect_silence()


async def test_a_refused_request_reaches_the_client_as_internal_error(
    http: aiohttp.ClientSession, server: ServerProcess, fake: FakeOpenAI
) -> None:
    fake.push(failure(400))
    client = await omnia(http, server, ASSISTANT)
    (frame,) = await client.ask("hi")
    assert frame["error"] == {"code": "INTERNAL_ERROR", "message": "internal error"}


async def test_the_metadata_template_and_an_image_reach_the_model(
    http: aiohttp.ClientSession, server: ServerProcess, fake: FakeOpenAI
) -> None:
    fake.push(text("A picture."))
    client = await omnia(http, server, ASSISTANT)
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "media": {"mime_type": "image/png", "data": PNG}},
    ]
    metadata = {"user_id": "u-9", "mock_scenario": "reserved keys stay out"}
    frames = await client.ask("", parts=parts, metadata=metadata)
    assert frames[-1]["type"] == "done"
    assert fake.bodies[0]["messages"][-1] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this?\n\n[user u-9]"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        ],
    }


# -- /v1/session ------------------------------------------------------------------------------


async def test_a_tool_the_session_client_declared_is_called_through_it(
    server: ServerProcess, fake: FakeOpenAI
) -> None:
    fake.push(tool_calls(("get_time", {"zone": "local"})), text("It is 15:00."))
    calls: list[dict[str, Any]] = []

    def get_time(**arguments: Any) -> str:
        calls.append(arguments)
        return "15:00"

    client = SessionClient(f"ws://127.0.0.1:{server.port}/v1/session", agent=ASSISTANT)
    client.register_tool(
        "get_time",
        get_time,
        description="the local time",
        parameters={"type": "object", "properties": {"zone": {"type": "string"}}},
    )
    async with client, asyncio.timeout(WITHIN):
        reply = await client.ask("what time is it?")
    assert reply.text == "It is 15:00."
    assert calls == [{"zone": "local"}]
    offered = [t["function"]["name"] for t in fake.bodies[0]["tools"]]
    assert offered == ["current_time", "weather", "get_location", "get_time"]
    assert tool_messages(fake.bodies[1])[0]["content"] == "15:00"


async def test_session_context_never_reaches_the_model(
    server: ServerProcess, fake: FakeOpenAI
) -> None:
    """Context from `hello` and from a `context` message is data for server code: no
    request to the model carries it, in any field."""
    fake.push(text("First."), text("Second."))
    client = SessionClient(
        f"ws://127.0.0.1:{server.port}/v1/session",
        context={"open_document": "HELLO-CONTEXT-MARK"},
    )
    async with client, asyncio.timeout(WITHIN):
        assert "context" in client.capabilities
        assert (await client.ask("one")).text == "First."
        await client.send_context({"open_document": "MESSAGE-CONTEXT-MARK"})
        assert (await client.ask("two")).text == "Second."
    assert len(fake.bodies) == 2
    requests = json.dumps(fake.bodies)
    assert "one" in requests  # the user's messages do reach it
    assert "CONTEXT-MARK" not in requests
    assert "open_document" not in requests


# -- /v1/rpc ----------------------------------------------------------------------------------


def rpc_url(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/rpc"


def reply_texts(probe: RpcProbe, session_id: str) -> list[str]:
    """The shown replies: the empty one a tool call the model made first ended is not."""
    return [
        str(m["content_data"])
        for m in probe.entities("message")
        if m["session_id"] == session_id
        and m["status"] == "completed"
        and m["content_type"] == "markdown"
        and m["content_data"]
    ]


async def test_a_client_tool_on_rpc_is_an_rtc(
    http: aiohttp.ClientSession, server: ServerProcess, fake: FakeOpenAI
) -> None:
    fake.push(tool_calls(("get_location", {})), text("You are in Tromsø."))
    probe = await RpcProbe.open(http, rpc_url(server))
    sent = await probe.call(
        "v1.message.send", {"content_data": "where?", "client_id": "c-1", "agent": ASSISTANT}
    )
    session_id = sent["session_id"]

    def waiting(p: RpcProbe) -> bool:
        return any(r["session_id"] == session_id for r in p.entities("rtc"))

    await probe.until(waiting)
    rtc = next(r for r in probe.entities("rtc") if r["session_id"] == session_id)
    assert (rtc["name"], rtc["arguments"]) == ("get_location", {})
    await probe.call(
        "v1.rtc.submit_result", {"rtc_id": rtc["id"], "success": True, "result": "Tromsø"}
    )
    turn = await probe.wait_turn_end(session_id)
    assert turn["status"] == "completed"
    assert reply_texts(probe, session_id) == ["You are in Tromsø."]
    assert tool_messages(fake.bodies[1])[0]["content"] == "Tromsø"
    await probe.close()


async def test_history_after_a_compaction_on_rpc(
    http: aiohttp.ClientSession, server: ServerProcess, fake: FakeOpenAI
) -> None:
    fake.push(text("Bergen gets rain."))
    probe = await RpcProbe.open(http, rpc_url(server))
    params = {"content_data": "rain in Bergen?", "client_id": "c-2", "agent": ASSISTANT}
    session_id = (await probe.call("v1.message.send", params))["session_id"]
    await probe.wait_turn_end(session_id)
    fake.push(text("They discussed rain in Bergen."))
    compacted = await probe.call("v1.session.compact", {"session_id": session_id})
    assert compacted["queued"] is True

    def summarised(p: RpcProbe) -> bool:
        return any(
            m["session_id"] == session_id and m["content_type"] == "summary"
            for m in p.entities("message")
        )

    await probe.until(summarised)
    summary = next(m for m in probe.entities("message") if m["content_type"] == "summary")
    assert summary["content_data"] == [
        {"role": "summary", "text": "They discussed rain in Bergen."}
    ]
    fake.push(text("Still rain."))
    params = {"server_session_id": session_id, "content_data": "and tomorrow?", "client_id": "c-3"}
    await probe.call("v1.message.send", params)

    def answered(p: RpcProbe) -> bool:
        return reply_texts(p, session_id)[-1:] == ["Still rain."]

    await probe.until(answered)
    assert fake.bodies[2]["messages"] == [
        {
            "role": "system",
            "content": "Summary of the conversation so far:\nThey discussed rain in Bergen.",
        },
        {"role": "user", "content": "and tomorrow?"},
    ]
    await probe.close()
