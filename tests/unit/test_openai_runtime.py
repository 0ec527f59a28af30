"""The openai runtime driven directly against the fake OpenAI server: streaming, the tool
loop (server-side HTTP and built-in tools, client-side tools), argument checks, the
metadata template, history mapping, images and the model summary."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest

from portico.core.compaction import model_summary_items, summarize
from portico.domain.model import ContentPart, MediaContent, Message
from portico.runtime.base import (
    AGENT_PROMPT,
    Chunk,
    ClientTool,
    Done,
    Failure,
    ToolCall,
    ToolOutcome,
    Usage,
)
from portico.runtime.openai import OpenAIRuntime
from support.fake_openai import (
    ENV,
    KEY,
    FakeOpenAI,
    Gate,
    Reply,
    ToolApi,
    agent_settings,
    chunk,
    completed,
    drive,
    message,
    streamed_text,
    text,
    tool_calls,
    turn_input,
)

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\nfake image bytes").decode()
WEATHER_TOKEN_ENV = "WEATHER_TOKEN"
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "units": {"enum": ["metric", "imperial"]}},
    "required": ["city"],
    "additionalProperties": False,
}
LOCATION_TOOL = {
    "kind": "client",
    "name": "get_location",
    "description": "where the user is",
    "parameters": {"type": "object", "properties": {"precision": {"type": "string"}}},
    "consent_message": "Share your location?",
    "categories": ["location"],
}


@pytest.fixture(scope="module")
def tool_api() -> Iterator[ToolApi]:
    api = ToolApi().start()
    yield api
    api.stop()


@pytest.fixture
def api(tool_api: ToolApi) -> ToolApi:
    tool_api.requests.clear()
    return tool_api


_opened: list[OpenAIRuntime] = []


@pytest.fixture(autouse=True)
async def _close_runtimes() -> AsyncIterator[None]:
    yield
    while _opened:
        await _opened.pop().close()


def runtime(fake: FakeOpenAI, api: ToolApi | None = None, **overrides: Any) -> OpenAIRuntime:
    env = {**ENV, WEATHER_TOKEN_ENV: "weather-secret"}
    if api is not None:
        overrides.setdefault("tools", http_tools(api))
    made = OpenAIRuntime(agent_settings(fake.base_url, **overrides), env=env)
    _opened.append(made)
    return made


def http_tools(api: ToolApi, **weather: Any) -> list[dict[str, Any]]:
    return [
        {
            "kind": "http",
            "name": "weather",
            "description": "the weather in a city",
            "parameters": CITY_SCHEMA,
            "url": api.base_url + "/weather/{city}",
            "headers": {"X-Client": "portico"},
            "headers_env": {"Authorization": WEATHER_TOKEN_ENV},
            **weather,
        },
        {
            "kind": "http",
            "name": "save_note",
            "method": "POST",
            "url": api.base_url + "/notes",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        },
        {"kind": "http", "name": "big", "url": api.base_url + "/big", "max_response_bytes": 1024},
        {"kind": "http", "name": "slow", "url": api.base_url + "/slow", "timeout": 0.2},
        {"kind": "http", "name": "missing", "url": api.base_url + "/missing"},
    ]


def tool_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body["messages"] if m["role"] == "tool"]


# -- streaming -----------------------------------------------------------------------------------


async def test_a_streamed_answer_becomes_chunks_usage_and_done(fake: FakeOpenAI) -> None:
    fake.push(text("Hello ", "world", tokens=(12, 3)))
    model = runtime(fake, system_prompt="You are terse.", temperature=0.2, max_tokens=50)
    events, _ = await drive(model, turn_input(message("hi there")))
    assert streamed_text(events) == "Hello world"
    assert events[-2:] == [Usage(input_tokens=12, output_tokens=3), Done()]
    (request,) = fake.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["Authorization"] == f"Bearer {KEY}"
    assert request.body == {
        "model": "fake-model",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "hi there"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.2,
        "max_tokens": 50,
    }


async def test_chunks_are_yielded_while_the_provider_still_streams(fake: FakeOpenAI) -> None:
    gate = Gate()
    events = (chunk({"content": "first "}), gate, chunk({"content": "second"}, "stop"))
    fake.push(Reply(events=events))
    stream = runtime(fake).run(turn_input())
    try:
        assert await stream.asend(None) == Chunk("first ")
        gate.open()  # the provider sends the rest only now
        assert await stream.asend(None) == Chunk("second")
        assert await stream.asend(None) == Done()
    finally:
        gate.open()
        await stream.aclose()


async def test_an_api_key_header_other_than_authorization_carries_the_key_as_is(
    fake: FakeOpenAI,
) -> None:
    fake.push(text("ok"))
    await drive(runtime(fake, api_key_header="api-key"), turn_input())
    assert fake.requests[0].headers["api-key"] == KEY
    assert "Authorization" not in fake.requests[0].headers


async def test_the_texts_of_two_rounds_are_separated(fake: FakeOpenAI) -> None:
    fake.push(tool_calls(("current_time", {}), say="Let me look."), text("It is noon."))
    model = runtime(fake, tools=[{"kind": "builtin", "name": "current_time"}])
    events, _ = await drive(model, turn_input())
    assert streamed_text(events) == "Let me look.\n\nIt is noon."


# -- server-side tools -----------------------------------------------------------------------------


async def test_an_http_tool_runs_in_portico_and_its_result_goes_back_to_the_model(
    fake: FakeOpenAI, api: ToolApi
) -> None:
    fake.push(tool_calls(("weather", {"city": "Oslo Øst/1", "units": "metric"})), text("21 C"))
    events, calls = await drive(runtime(fake, api), turn_input(message("weather?")))
    assert calls == []  # never reaches the client
    assert streamed_text(events) == "21 C"
    assert [e for e in events if isinstance(e, Usage)] == [Usage(20, 8), Usage(10, 5)]
    (call,) = api.requests
    # The argument is URL-encoded into one path segment; the rest is the query.
    assert call.raw_path == "/weather/Oslo%20%C3%98st%2F1?units=metric"
    assert call.headers["Authorization"] == "weather-secret"
    assert call.headers["X-Client"] == "portico"
    first, second = fake.bodies
    assert [t["function"]["name"] for t in first["tools"]][:2] == ["weather", "save_note"]
    assert first["tools"][0]["function"]["parameters"] == CITY_SCHEMA
    assistant, tool = second["messages"][-2:]
    assert assistant["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": json.dumps({"city": "Oslo Øst/1", "units": "metric"}),
    }
    assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"] == "call_0"
    assert json.loads(tool["content"]) == {"city": "Oslo Øst/1", "celsius": 21, "units": "metric"}


async def test_the_url_placeholder_is_encoded_as_one_segment(
    fake: FakeOpenAI, api: ToolApi
) -> None:
    fake.push(tool_calls(("weather", {"city": "a/../b?x=1"})), text("ok"))
    await drive(runtime(fake, api), turn_input())
    (call,) = api.requests
    assert call.raw_path == "/weather/a%2F..%2Fb%3Fx=1"  # `=` needs no escape in a path
    assert call.query == {}


async def test_a_post_tool_sends_its_arguments_as_json(fake: FakeOpenAI, api: ToolApi) -> None:
    fake.push(tool_calls(("save_note", {"text": "buy milk"})), text("saved"))
    await drive(runtime(fake, api), turn_input())
    (call,) = api.requests
    assert (call.method, call.body) == ("POST", {"text": "buy milk"})
    assert json.loads(tool_messages(fake.bodies[1])[0]["content"]) == {
        "saved": {"text": "buy milk"}
    }


@pytest.mark.parametrize(
    ("tool", "error"),
    [
        ("big", "the response is larger than 1024 bytes"),
        ("slow", "no answer within 0.2 s"),
        ("missing", "HTTP 404"),
    ],
)
async def test_an_http_tool_failure_goes_back_to_the_model_as_a_tool_error(
    fake: FakeOpenAI, api: ToolApi, tool: str, error: str
) -> None:
    fake.push(tool_calls((tool, {})), text("sorry"))
    events, _ = await drive(runtime(fake, api), turn_input())
    assert events[-1] == Done()
    (result,) = tool_messages(fake.bodies[1])
    assert json.loads(result["content"])["error"].startswith(error)


async def test_the_current_time_builtin(fake: FakeOpenAI) -> None:
    fake.push(
        tool_calls(("current_time", {"timezone": "Asia/Tokyo"})),
        tool_calls(("current_time", {"timezone": "Mars/Olympus"})),
        text("done"),
    )
    model = runtime(fake, tools=[{"kind": "builtin", "name": "current_time"}])
    await drive(model, turn_input())
    tokyo = json.loads(tool_messages(fake.bodies[1])[0]["content"])
    assert tokyo["timezone"] == "Asia/Tokyo"
    assert tokyo["time"].endswith("+09:00")
    mars = json.loads(tool_messages(fake.bodies[2])[1]["content"])
    assert mars == {"error": "unknown time zone 'Mars/Olympus'"}


# -- client-side tools ---------------------------------------------------------------------------


async def test_a_configured_client_tool_is_yielded_with_its_consent_and_the_outcome_fed_back(
    fake: FakeOpenAI,
) -> None:
    fake.push(tool_calls(("get_location", {"precision": "city"})), text("You are in Oslo."))
    model = runtime(fake, tools=[LOCATION_TOOL])
    events, calls = await drive(model, turn_input(), completed({"city": "Oslo"}))
    (call,) = calls
    assert (call.name, call.arguments) == ("get_location", {"precision": "city"})
    assert (call.consent_message, call.categories) == ("Share your location?", ("location",))
    assert call.id.startswith("call-")  # Portico's own id, unique in the archive
    assert streamed_text(events) == "You are in Oslo."
    (result,) = tool_messages(fake.bodies[1])
    assert result == {"role": "tool", "tool_call_id": "call_0", "content": '{"city": "Oslo"}'}


@pytest.mark.parametrize(
    ("outcome", "content"),
    [
        (ToolOutcome(status="completed", result="plain text"), "plain text"),
        (ToolOutcome(status="error", error="no GPS"), {"error": "no GPS"}),
        (
            ToolOutcome(status="denied", error="user declined"),
            {"error": "the call was declined or timed out: user declined"},
        ),
    ],
)
async def test_every_client_outcome_reaches_the_model(
    fake: FakeOpenAI, outcome: ToolOutcome, content: Any
) -> None:
    fake.push(tool_calls(("get_location", {})), text("ok"))
    await drive(runtime(fake, tools=[LOCATION_TOOL]), turn_input(), lambda call: outcome)
    sent = tool_messages(fake.bodies[1])[0]["content"]
    assert (sent if isinstance(content, str) else json.loads(sent)) == content


async def test_a_tool_the_client_declared_is_offered_and_called(fake: FakeOpenAI) -> None:
    fake.push(tool_calls(("get_time", {"zone": "local"})), text("3 pm"))
    declared = ClientTool(
        name="get_time",
        description="the local time",
        parameters={"type": "object", "properties": {"zone": {"type": "string"}}},
    )
    turn = turn_input(client_tools=(declared,))
    _, calls = await drive(runtime(fake), turn, completed("15:00"))
    assert [c.name for c in calls] == ["get_time"]
    (offered,) = fake.bodies[0]["tools"]
    assert offered["function"] == {
        "name": "get_time",
        "description": "the local time",
        "parameters": declared.parameters,
    }


async def test_a_client_tool_never_replaces_a_configured_one(fake: FakeOpenAI) -> None:
    fake.push(tool_calls(("current_time", {})), text("ok"))
    model = runtime(fake, tools=[{"kind": "builtin", "name": "current_time"}])
    impostor = ClientTool(name="current_time", description="mine")
    _, calls = await drive(model, turn_input(client_tools=(impostor,)))
    assert calls == []  # the built-in ran
    assert [t["function"]["description"] for t in fake.bodies[0]["tools"]] == [
        "The current date and time (ISO 8601)."
    ]


# -- invalid arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"units": "metric"}, "invalid arguments: 'city' is a required property"),
        ({"city": "Oslo", "units": "kelvin"}, "invalid arguments at units: 'kelvin' is not one of"),
        ('{"city": "Oslo"', "invalid arguments: not valid JSON"),
        ('["Oslo"]', "invalid arguments: expected a JSON object"),
    ],
)
async def test_invalid_arguments_go_back_as_a_tool_error_and_nothing_runs(
    fake: FakeOpenAI, api: ToolApi, arguments: Any, error: str
) -> None:
    fake.push(tool_calls(("weather", arguments)), text("let me fix that"))
    events, _ = await drive(runtime(fake, api), turn_input())
    assert api.requests == []
    assert events[-1] == Done()
    (result,) = tool_messages(fake.bodies[1])
    assert json.loads(result["content"])["error"].startswith(error)


async def test_invalid_arguments_of_a_client_tool_never_reach_the_client(fake: FakeOpenAI) -> None:
    fake.push(tool_calls(("get_location", {"precision": 5})), text("ok"))
    _, calls = await drive(runtime(fake, tools=[LOCATION_TOOL]), turn_input())
    assert calls == []
    content = json.loads(tool_messages(fake.bodies[1])[0]["content"])
    assert content == {"error": "invalid arguments at precision: 5 is not of type 'string'"}


async def test_an_unknown_tool_is_a_tool_error(fake: FakeOpenAI) -> None:
    fake.push(tool_calls(("launch_rockets", {})), text("ok"))
    await drive(runtime(fake), turn_input())
    content = json.loads(tool_messages(fake.bodies[1])[0]["content"])
    assert content == {"error": "unknown tool 'launch_rockets'"}


# -- rounds --------------------------------------------------------------------------------------


async def test_the_round_limit_ends_the_turn_keeping_the_text_so_far(fake: FakeOpenAI) -> None:
    for n in range(3):
        fake.push(tool_calls(("current_time", {}), say=f"step {n}."))
    model = runtime(fake, max_rounds=2, tools=[{"kind": "builtin", "name": "current_time"}])
    events, _ = await drive(model, turn_input())
    assert len(fake.requests) == 3  # two rounds of tools ran; the third asked for more
    assert events[-1] == Failure(
        code="MAX_ROUNDS_EXCEEDED",
        message="the turn stopped at its limit of 2 rounds of tool calls",
    )
    assert streamed_text(events) == "step 0.\n\nstep 1.\n\nstep 2."
    assert len(tool_messages(fake.bodies[2])) == 2


async def test_several_calls_of_one_response_each_get_their_answer(fake: FakeOpenAI) -> None:
    fake.push(
        tool_calls(("current_time", {}), ("get_location", {}), ("current_time", "")),
        text("ok"),
    )
    model = runtime(fake, tools=[{"kind": "builtin", "name": "current_time"}, LOCATION_TOOL])
    _, calls = await drive(model, turn_input(), completed("home"))
    assert len(calls) == 1
    answers = tool_messages(fake.bodies[1])
    assert [a["tool_call_id"] for a in answers] == ["call_0", "call_1", "call_2"]
    assert answers[1]["content"] == "home"


# -- what the model is sent ------------------------------------------------------------------------


async def test_the_metadata_template_is_rendered_and_appended(fake: FakeOpenAI) -> None:
    fake.push(text("ok"))
    model = runtime(fake, message_metadata_template="[user {{user_id}}, tier {{ .tier }}{{x}}]")
    user = message("hello", metadata={"user_id": "u-1", "tier": "gold"})
    await drive(model, turn_input(user))
    assert fake.bodies[0]["messages"][-1] == {
        "role": "user",
        "content": "hello\n\n[user u-1, tier gold]",
    }


async def test_without_a_template_the_model_never_sees_metadata(fake: FakeOpenAI) -> None:
    fake.push(text("ok"))
    await drive(runtime(fake), turn_input(message("hello", metadata={"user_id": "u-1"})))
    assert fake.bodies[0]["messages"][-1] == {"role": "user", "content": "hello"}


async def test_an_image_part_reaches_the_request_as_a_data_url(fake: FakeOpenAI) -> None:
    fake.push(text("a cat"))
    image = ContentPart(type="image", media=MediaContent(mime_type="image/png", data=PNG))
    audio = ContentPart(type="audio", media=MediaContent(mime_type="audio/mpeg", data="AAAA"))
    parts = (ContentPart(type="text", text="what is this?"), image, audio)
    await drive(runtime(fake), turn_input(message("", parts=parts)))
    assert fake.bodies[0]["messages"][-1]["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "text", "text": "[a audio attachment (audio/mpeg) the model cannot see]"},
    ]


async def test_an_image_that_cannot_be_read_becomes_a_note(fake: FakeOpenAI) -> None:
    fake.push(text("ok"))
    gone = MediaContent(mime_type="image/png", storage_ref="omnia://sessions/s/media/m")
    await drive(
        runtime(fake), turn_input(message("see", parts=(ContentPart("image", media=gone),)))
    )
    assert fake.bodies[0]["messages"][-1]["content"][-1] == {
        "type": "text",
        "text": "[an image that could not be read]",
    }


def call_message(call_id: str, name: str, arguments: dict[str, Any]) -> Any:
    content = json.dumps({"id": call_id, "name": name, "arguments": arguments})
    return message(content, role="assistant", content_type="toolcall_input")


def output_message(call_id: str, status: str, result: Any = None, error: str = "") -> Any:
    content = json.dumps(
        {"id": call_id, "name": "x", "status": status, "result": result, "error": error}
    )
    return message(content, role="tool", content_type="toolcall_output")


async def test_history_after_a_compaction_is_mapped_to_chat_messages(fake: FakeOpenAI) -> None:
    earlier = [message("first question"), message("first answer", role="assistant")]
    summary = message(
        msgspec.json.encode(summarize(earlier)).decode(), role="system", content_type="summary"
    )
    image = ContentPart(type="image", media=MediaContent(mime_type="image/png", data=PNG))
    history = (
        summary,
        message("where am I?", metadata={"city_hint": "north"}, parts=(image,)),
        message("Let me check.", role="assistant", content_type="markdown"),
        call_message("call-a", "get_location", {"q": 1}),
        output_message("call-a", "completed", {"city": "Oslo"}),
        call_message("call-b", "get_location", {}),
        output_message("call-b", "rejected", error="user declined"),
        call_message("call-c", "get_location", {}),  # the turn ended before its answer
        message("thinking...", role="assistant", content_type="thinking"),
        output_message("call-orphan", "completed", 1),
        message("You are in Oslo.", role="assistant", content_type="markdown"),
    )
    fake.push(text("ok"))
    model = runtime(fake, system_prompt="Be kind.", message_metadata_template="hint={{city_hint}}")
    await drive(model, turn_input(message("thanks"), history=history))
    sent = fake.bodies[0]["messages"]
    assert sent[0] == {"role": "system", "content": "Be kind."}
    assert sent[1] == {
        "role": "system",
        "content": "Summary of the conversation so far:\n"
        "user: first question\nassistant: first answer",
    }
    assert sent[2] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "where am I?\n\nhint=north"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        ],
    }
    # The text before a call is the call's message's content, as the model sends them.
    assert (sent[3]["role"], sent[3]["content"]) == ("assistant", "Let me check.")
    assert sent[3]["tool_calls"] == [
        {
            "id": "call-a",
            "type": "function",
            "function": {"name": "get_location", "arguments": '{"q": 1}'},
        }
    ]
    answers = [(m["tool_call_id"], m["content"]) for m in sent if m["role"] == "tool"]
    assert answers == [
        ("call-a", '{"city": "Oslo"}'),
        ("call-b", json.dumps({"error": "the call was declined or timed out: user declined"})),
        ("call-c", json.dumps({"error": "the call ended without a recorded answer"})),
    ]
    assert sent[-2:] == [
        {"role": "assistant", "content": "You are in Oslo."},
        {"role": "user", "content": "thanks"},
    ]
    assert len(sent) == 11


async def test_a_model_summary_in_history_is_its_text(fake: FakeOpenAI) -> None:
    items = model_summary_items("They talked about Oslo.", "be brief")
    summary = message(msgspec.json.encode(items).decode(), role="system", content_type="summary")
    fake.push(text("ok"))
    await drive(runtime(fake), turn_input(history=(summary,)))
    assert fake.bodies[0]["messages"][0]["content"].endswith("\nThey talked about Oslo.")


# -- compaction -----------------------------------------------------------------------------------


async def test_summarize_asks_the_model_with_a_transcript(fake: FakeOpenAI) -> None:
    fake.push(text("The user asked ", "about Oslo."))
    history = [
        message("weather in Oslo?"),
        call_message("call-a", "weather", {"city": "Oslo"}),
        output_message("call-a", "completed", {"celsius": 21}),
        message("21 C", role="assistant"),
    ]
    summary = await runtime(fake).summarize(history, "keep numbers")
    assert summary == "The user asked about Oslo."
    system, user = fake.bodies[0]["messages"]
    assert system["content"].endswith("\n\nAlso: keep numbers")
    assert user["content"] == (
        "user: weather in Oslo?\n\n"
        'tool call weather({"city": "Oslo"}): {"celsius": 21}\n\n'
        "assistant: 21 C"
    )
    assert "tools" not in fake.bodies[0]


async def test_summarize_keeps_the_newest_part_of_a_long_transcript(fake: FakeOpenAI) -> None:
    fake.push(text("short"))
    history = [message("a" * 50), message("b" * 50)]
    await runtime(fake, summary_input_chars=20).summarize(history, "")
    assert fake.bodies[0]["messages"][1]["content"] == "b" * 20


async def test_a_tool_call_is_never_a_stray_event(fake: FakeOpenAI) -> None:
    """The runtime yields only the port's event types."""
    fake.push(tool_calls(("get_location", {})), text("ok"))
    events, _ = await drive(runtime(fake, tools=[LOCATION_TOOL]), turn_input(), completed(1))
    assert {type(e).__name__ for e in events} <= {"Chunk", "Usage", "ToolCall", "Done"}
    assert isinstance(events[1], ToolCall)


async def test_an_agent_prompt_is_a_system_instruction_for_this_message_only(
    fake: FakeOpenAI,
) -> None:
    fake.push(text("Bonjour"))
    model = runtime(fake, system_prompt="You are terse.")
    earlier = (message("before"), message("ok", role="assistant", content_type="markdown"))
    turn = msgspec.structs.replace(
        turn_input(message("hi"), history=earlier), directives={AGENT_PROMPT: "Answer in French."}
    )
    await drive(model, turn)
    (request,) = fake.requests
    assert request.body["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "before"},
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "hi"},
    ]


async def test_the_history_reads_text_call_result_text_as_archived(fake: FakeOpenAI) -> None:
    # A turn's reply is archived split at its tool calls (docs/storage.md): archive
    # order is what happened, and the text before a call travels with the call.
    def of_turn(turn_id: str, *messages: Message) -> list[Message]:
        return [msgspec.structs.replace(m, turn_id=turn_id) for m in messages]

    history = (
        *of_turn(
            "t1",
            message("where am I?"),
            message("Let me look.", role="assistant", content_type="markdown"),
            call_message("call-a", "get_location", {}),
            output_message("call-a", "completed", {"city": "Oslo"}),
            message("You are in Oslo.", role="assistant", content_type="markdown"),
        ),
        *of_turn(
            "t2",
            message("thanks"),
            message("", role="assistant", content_type="markdown"),  # a call came first
            call_message("call-b", "get_location", {}),
            output_message("call-b", "completed", {"city": "Oslo"}),
            message("You're welcome.", role="assistant", content_type="markdown"),
        ),
    )
    fake.push(text("ok"))
    await drive(runtime(fake), turn_input(message("bye"), history=history))
    sent = fake.bodies[0]["messages"]
    roles = [(m["role"], m.get("content"), "tool_calls" in m) for m in sent]
    assert roles == [
        ("user", "where am I?", False),
        ("assistant", "Let me look.", True),  # the text and the call, as the model sends them
        ("tool", '{"city": "Oslo"}', False),
        ("assistant", "You are in Oslo.", False),
        ("user", "thanks", False),
        ("assistant", None, True),
        ("tool", '{"city": "Oslo"}', False),
        ("assistant", "You're welcome.", False),
        ("user", "bye", False),
    ]
