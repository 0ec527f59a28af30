"""The scripted, echo and demo runtimes, driven the way the engine drives them."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import wave
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from portico.domain.model import ContentPart, MediaContent, Message
from portico.errors import MediaNotFound, ScriptError
from portico.runtime.base import (
    Chunk,
    ClientTool,
    Done,
    Failure,
    MediaChunk,
    RuntimeEvent,
    ToolCall,
    ToolOutcome,
    TurnInput,
)
from portico.runtime.demo import (
    GREETING,
    PICTURE_TEXT,
    SOUND_TEXT,
    DemoRuntime,
    image_size,
    picture_part,
)
from portico.runtime.echo import EchoRuntime
from portico.runtime.scripted import (
    ChunkStep,
    DoneStep,
    EchoStep,
    ErrorStep,
    MediaChunkStep,
    ScriptedRuntime,
    SleepStep,
    Step,
    ToolCallStep,
    load_script,
    parse_script,
    render_placeholders,
)
from support.turns import drive, turn_input

EXAMPLE = """
scenarios:
  default:
    - chunk: "Hello "
    - chunk: "world"
    - done: {}
  tool:
    - tool_call: {name: get_location, arguments: {query: current}, consent_message: "Allow location access?", categories: [location]}
    - chunk: "status={tool.status} result={tool.result} error={tool.error}"
    - done: {}
  slow:  [{chunk: "a"}, {sleep_ms: 2000}, {done: {}}]
  fail:  [{chunk: "partial"}, {error: {code: PROVIDER_UNAVAILABLE, message: "model endpoint unavailable"}}]
  media: [{media_chunk: {mime_type: audio/pcm, bytes: 200000, chunk_bytes: 65536}}, {done: {}}]
  image: [{done: {parts: [{type: text, text: "here"}, {type: image, media: {data: "<base64>", mime_type: image/png}}]}}]
  echo:  [{echo: {}}]
"""  # noqa: E501


# -- helpers ------------------------------------------------------------------------


def scripted(document: str | dict[str, Any]) -> ScriptedRuntime:
    data = yaml.safe_load(document) if isinstance(document, str) else document
    return ScriptedRuntime(parse_script(data))


def one_scenario(*steps: dict[str, Any]) -> ScriptedRuntime:
    return scripted({"scenarios": {"default": list(steps)}})


def example() -> ScriptedRuntime:
    return scripted(EXAMPLE)


# -- parsing ------------------------------------------------------------------------


def test_example_script_parses_into_typed_steps() -> None:
    scenarios = parse_script(yaml.safe_load(EXAMPLE))
    expected: dict[str, tuple[Step, ...]] = {
        "default": (ChunkStep("Hello "), ChunkStep("world"), DoneStep()),
        "tool": (
            ToolCallStep(
                name="get_location",
                arguments={"query": "current"},
                consent_message="Allow location access?",
                categories=("location",),
            ),
            ChunkStep("status={tool.status} result={tool.result} error={tool.error}"),
            DoneStep(),
        ),
        "slow": (ChunkStep("a"), SleepStep(2000), DoneStep()),
        "fail": (
            ChunkStep("partial"),
            ErrorStep(code="PROVIDER_UNAVAILABLE", message="model endpoint unavailable"),
        ),
        "media": (
            MediaChunkStep(mime_type="audio/pcm", bytes=200000, chunk_bytes=65536),
            DoneStep(),
        ),
        "image": (
            DoneStep(
                parts=(
                    ContentPart(type="text", text="here"),
                    ContentPart(
                        type="image", media=MediaContent(mime_type="image/png", data="<base64>")
                    ),
                )
            ),
        ),
        "echo": (EchoStep(),),
    }
    assert scenarios == expected


def test_null_step_values_mean_defaults() -> None:
    data = yaml.safe_load("scenarios: {default: [{echo: }, {done: }]}")
    assert parse_script(data) == {"default": (EchoStep(), DoneStep())}


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_load_script_reads_yaml_and_json(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"script.{suffix}"
    data = yaml.safe_load(EXAMPLE)
    path.write_text(json.dumps(data) if suffix == "json" else EXAMPLE, encoding="utf-8")
    assert load_script(path) == parse_script(data)


async def test_from_file_runs_the_file(tmp_path: Path) -> None:
    path = tmp_path / "script.yaml"
    path.write_text(EXAMPLE, encoding="utf-8")
    events = await drive(ScriptedRuntime.from_file(path), turn_input())
    assert events == [Chunk("Hello "), Chunk("world"), Done()]


def test_load_script_missing_file_is_a_script_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ScriptError, match=r"missing\.yaml"):
        load_script(missing)


def test_load_script_invalid_yaml_is_a_script_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("scenarios: [unclosed", encoding="utf-8")
    with pytest.raises(ScriptError, match=r"broken\.yaml"):
        load_script(path)


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ("[1, 2]", "`scenarios` mapping"),
        ("scenarios: [a, b]", "`scenarios` mapping"),
        ("other: {}", "`scenarios` mapping"),
        ("scenarios: {bad: {chunk: x}}", "scenarios.bad: expected a list"),
        ("scenarios: {s: [{chunk: a}, hello]}", "scenarios.s[1]: a step is a mapping"),
        ("scenarios: {s: [{chunk: a, done: {}}]}", "scenarios.s[0]: a step is a mapping"),
        ("scenarios: {s: [{}]}", "scenarios.s[0]: a step is a mapping"),
        ("scenarios: {s: [{done: {}}, {done: {}}, {dance: 1}]}", "scenarios.s[2]: unknown step"),
        ("scenarios: {s: [{chunk: [1]}]}", "scenarios.s[0].chunk"),
        ("scenarios: {s: [{sleep_ms: -1}]}", "scenarios.s[0].sleep_ms"),
        ("scenarios: {s: [{sleep_ms: soon}]}", "scenarios.s[0].sleep_ms"),
        ("scenarios: {s: [{tool_call: {arguments: {}}}]}", "scenarios.s[0].tool_call"),
        ("scenarios: {s: [{tool_call: {name: x, colour: red}}]}", "scenarios.s[0].tool_call"),
        ("scenarios: {s: [{error: {message: m}}]}", "scenarios.s[0].error"),
        ("scenarios: {s: [{media_chunk: {mime_type: a, bytes: -1}}]}", "s[0].media_chunk"),
        (
            "scenarios: {s: [{media_chunk: {mime_type: a, bytes: 1, chunk_bytes: 0}}]}",
            "scenarios.s[0].media_chunk",
        ),
        ("scenarios: {s: [{done: {content: [x]}}]}", "scenarios.s[0].done"),
        ("scenarios: {s: [{done: {extra: 1}}]}", "scenarios.s[0].done"),
        ("scenarios: {s: [{done: {parts: [{type: hologram}]}}]}", "scenarios.s[0].done"),
        ("scenarios: {s: [{echo: {loud: true}}]}", "scenarios.s[0].echo"),
    ],
)
def test_malformed_script_names_scenario_and_step(document: str, expected: str) -> None:
    with pytest.raises(ScriptError) as caught:
        parse_script(yaml.safe_load(document))
    assert expected in str(caught.value)


def test_unknown_step_lists_the_known_kinds() -> None:
    with pytest.raises(ScriptError) as caught:
        parse_script({"scenarios": {"s": [{"dance": {}}]}})
    message = str(caught.value)
    assert "'dance'" in message
    for kind in ("chunk", "done", "echo", "error", "media_chunk", "sleep_ms", "tool_call"):
        assert kind in message


# -- running ------------------------------------------------------------------------


async def test_default_scenario_streams_then_completes() -> None:
    events = await drive(example(), turn_input())
    assert events == [Chunk("Hello "), Chunk("world"), Done()]


async def test_mock_scenario_directive_picks_the_scenario() -> None:
    events = await drive(example(), turn_input(scenario="fail"))
    assert events == [
        Chunk("partial"),
        Failure(code="PROVIDER_UNAVAILABLE", message="model endpoint unavailable"),
    ]


async def test_scenario_key_in_message_metadata_is_not_a_directive() -> None:
    turn = turn_input(metadata={"mock_scenario": "fail"})
    assert await drive(example(), turn) == [Chunk("Hello "), Chunk("world"), Done()]


async def test_unknown_scenario_yields_one_failure_naming_it() -> None:
    events = await drive(example(), turn_input(scenario="nonexistent"))
    assert len(events) == 1
    failure = events[0]
    assert isinstance(failure, Failure)
    assert "nonexistent" in failure.message


async def test_missing_default_scenario_yields_a_failure() -> None:
    runtime = scripted({"scenarios": {"other": [{"done": {}}]}})
    events = await drive(runtime, turn_input())
    assert len(events) == 1
    assert isinstance(events[0], Failure)
    assert "default" in events[0].message


async def test_steps_without_a_terminal_end_with_done() -> None:
    assert await drive(one_scenario({"chunk": "x"}), turn_input()) == [Chunk("x"), Done()]
    assert await drive(scripted({"scenarios": {"default": []}}), turn_input()) == [Done()]


async def test_nothing_runs_after_done_or_error() -> None:
    after_done = one_scenario({"done": {"content": "end"}}, {"chunk": "never"})
    assert await drive(after_done, turn_input()) == [Done(content="end")]
    after_error = one_scenario({"error": {"code": "X"}}, {"chunk": "never"}, {"done": {}})
    assert await drive(after_error, turn_input()) == [Failure(code="X", message="")]


async def test_image_scenario_done_carries_parts() -> None:
    events = await drive(example(), turn_input(scenario="image"))
    image = MediaContent(mime_type="image/png", data="<base64>")
    expected_parts = (ContentPart(type="text", text="here"), ContentPart(type="image", media=image))
    assert events == [Done(content=None, parts=expected_parts)]


async def test_sleep_step_waits_between_events() -> None:
    runtime = one_scenario({"chunk": "a"}, {"sleep_ms": 40}, {"chunk": "b"})
    loop = asyncio.get_running_loop()
    stream = runtime.run(turn_input())
    assert await stream.asend(None) == Chunk("a")
    started = loop.time()
    assert await stream.asend(None) == Chunk("b")
    assert loop.time() - started >= 0.035
    await stream.aclose()


async def test_slow_scenario_streams_its_first_chunk_before_sleeping() -> None:
    stream = example().run(turn_input(scenario="slow"))
    first = await asyncio.wait_for(stream.asend(None), timeout=0.5)
    assert first == Chunk("a")
    await stream.aclose()


# -- tool calls and placeholders --------------------------------------------------------


async def test_tool_call_step_yields_the_call() -> None:
    stream = example().run(turn_input(scenario="tool"))
    call = await stream.asend(None)
    assert isinstance(call, ToolCall)
    assert (call.name, call.arguments, call.consent_message, call.categories) == (
        "get_location",
        {"query": "current"},
        "Allow location access?",
        ("location",),
    )
    assert call.id
    await stream.aclose()


async def test_tool_call_ids_are_unique_per_call() -> None:
    runtime = one_scenario({"tool_call": {"name": "a"}}, {"tool_call": {"name": "b"}})
    denied = ToolOutcome(status="denied")
    events = await drive(runtime, turn_input(), (denied, denied))
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [c.name for c in calls] == ["a", "b"]
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (
            ToolOutcome(status="completed", result={"lat": 1.5, "tags": ["a", "b"]}),
            'status=completed result={"lat":1.5,"tags":["a","b"]} error=',
        ),
        (ToolOutcome(status="completed", result="x"), 'status=completed result="x" error='),
        (ToolOutcome(status="completed", result=0), "status=completed result=0 error="),
        (ToolOutcome(status="completed", result=False), "status=completed result=false error="),
        (ToolOutcome(status="error", error="GPS off"), "status=error result= error=GPS off"),
        (ToolOutcome(status="denied"), "status=denied result= error="),
        (None, "status= result= error="),
    ],
)
async def test_tool_outcome_fills_placeholders(outcome: ToolOutcome | None, expected: str) -> None:
    events = await drive(example(), turn_input(scenario="tool"), (outcome,))
    assert isinstance(events[0], ToolCall)
    assert events[1:] == [Chunk(expected), Done()]


async def test_placeholders_render_in_done_content_from_the_latest_call() -> None:
    runtime = one_scenario(
        {"tool_call": {"name": "first"}},
        {"tool_call": {"name": "second"}},
        {"done": {"content": "{tool.status}:{tool.result}"}},
    )
    outcomes = (ToolOutcome(status="error", error="no"), ToolOutcome(status="completed", result=7))
    events = await drive(runtime, turn_input(), outcomes)
    assert events[-1] == Done(content="completed:7")


async def test_placeholders_before_any_tool_call_are_empty() -> None:
    runtime = one_scenario({"chunk": "[{tool.status}|{tool.result}|{tool.error}]"})
    assert (await drive(runtime, turn_input()))[0] == Chunk("[||]")


@pytest.mark.parametrize(
    ("context", "expected"),
    [({}, "{}"), ({"doc": "a.md", "cursor": [3, 7]}, '{"cursor":[3,7],"doc":"a.md"}')],
)
async def test_context_step_streams_the_turns_context_as_compact_json(
    context: dict[str, Any], expected: str
) -> None:
    turn = msgspec.structs.replace(turn_input(), context=context)
    events = await drive(one_scenario({"context": {}}), turn)
    assert events == [Chunk(expected), Done()]


def test_render_placeholders_uses_compact_json() -> None:
    value = {"a": [1, {"b": None}], "é": "ü"}
    outcome = ToolOutcome(status="completed", result=value)
    rendered = render_placeholders("{tool.result}", outcome)
    assert rendered == json.dumps(value, separators=(",", ":"))


def test_render_placeholders_does_not_expand_placeholders_inside_values() -> None:
    outcome = ToolOutcome(status="completed", result={"note": "{tool.error}"}, error="E")
    rendered = render_placeholders("{tool.result} {tool.error}", outcome)
    assert rendered == '{"note":"{tool.error}"} E'


def test_render_placeholders_leaves_other_braces_alone() -> None:
    outcome = ToolOutcome(status="completed")
    assert render_placeholders("{tool.other} {x} {tool.status}", outcome) == (
        "{tool.other} {x} completed"
    )


# -- echo and media steps ---------------------------------------------------------------


async def test_echo_step_streams_one_chunk_per_word() -> None:
    events = await drive(example(), turn_input("hello  big\nworld", scenario="echo"))
    assert events == [Chunk("hello "), Chunk("big "), Chunk("world"), Done()]


async def test_echo_step_reads_text_parts_before_content() -> None:
    parts = (ContentPart(type="text", text="from parts"),)
    events = await drive(example(), turn_input("ignored", scenario="echo", parts=parts))
    assert events == [Chunk("from "), Chunk("parts"), Done()]


async def test_media_scenario_chunks_the_pattern() -> None:
    events = await drive(example(), turn_input(scenario="media"))
    assert events[-1] == Done()
    chunks = events[:-1]
    assert all(isinstance(c, MediaChunk) for c in chunks)
    media = [c for c in chunks if isinstance(c, MediaChunk)]
    assert [len(c.data) for c in media] == [65536, 65536, 65536, 200000 - 3 * 65536]
    assert b"".join(c.data for c in media) == bytes(i % 256 for i in range(200000))
    assert [c.sequence for c in media] == [0, 1, 2, 3]
    assert [c.is_last for c in media] == [False, False, False, True]
    assert {c.media_id for c in media} == {media[0].media_id}
    assert {c.mime_type for c in media} == {"audio/pcm"}


@pytest.mark.parametrize(
    ("size", "chunk_bytes", "lengths"),
    [
        (131072, 65536, [65536, 65536]),
        (10, 3, [3, 3, 3, 1]),
        (5, 100, [5]),
        (0, 100, [0]),
    ],
)
async def test_media_chunk_sizes(size: int, chunk_bytes: int, lengths: list[int]) -> None:
    step = {"media_chunk": {"mime_type": "video/mp4", "bytes": size, "chunk_bytes": chunk_bytes}}
    events = await drive(one_scenario(step), turn_input())
    media = [e for e in events if isinstance(e, MediaChunk)]
    assert [len(c.data) for c in media] == lengths
    assert [c.is_last for c in media] == [i == len(lengths) - 1 for i in range(len(lengths))]
    assert b"".join(c.data for c in media) == bytes(i % 256 for i in range(size))


async def test_each_media_step_gets_its_own_media_id() -> None:
    step = {"media_chunk": {"mime_type": "audio/pcm", "bytes": 4}}
    events = await drive(one_scenario(step, step), turn_input())
    media = [e for e in events if isinstance(e, MediaChunk)]
    assert len(media) == 2
    assert media[0].media_id != media[1].media_id


# -- echo and demo runtimes -------------------------------------------------------------


async def test_echo_runtime_replies_with_one_done() -> None:
    assert await drive(EchoRuntime(), turn_input("ping")) == [Done(content="Echo: ping")]


async def test_echo_runtime_reads_text_parts() -> None:
    parts = (ContentPart(type="text", text="a"), ContentPart(type="text", text="b"))
    assert await drive(EchoRuntime(), turn_input("", parts=parts)) == [Done(content="Echo: a\n\nb")]


async def demo_reply(text: str, history: tuple[Message, ...] = ()) -> str:
    events = await drive(DemoRuntime(word_delay=0), turn_input(text, history=history))
    assert events[-1] == Done()
    chunks = events[:-1]
    assert chunks
    assert all(isinstance(c, Chunk) for c in chunks)
    texts = [c.text for c in chunks if isinstance(c, Chunk)]
    assert all(t.endswith(" ") for t in texts[:-1])
    assert not texts[-1].endswith(" ")
    return "".join(texts)


async def test_demo_runtime_greets() -> None:
    assert await demo_reply("Hello!") == GREETING


async def test_demo_runtime_echoes() -> None:
    assert await demo_reply("echo Portico streams") == "Portico streams"


async def test_demo_runtime_counts_history() -> None:
    earlier = turn_input().message
    reply = await demo_reply("history", history=(earlier, earlier, earlier))
    assert "holds 3 earlier messages" in reply


async def test_demo_runtime_default_reply_counts_words() -> None:
    assert (await demo_reply("what is this thing")).startswith("You said 4 words.")
    assert (await demo_reply("why")).startswith("You said 1 word.")


# -- the demo agent's tools, media and attachments ------------------------------------------


def demo_turn(
    text: str,
    *,
    tools: tuple[str, ...] = (),
    parts: tuple[ContentPart, ...] = (),
    media: dict[str, bytes] | None = None,
) -> TurnInput:
    """A turn whose client declared `tools` and whose media parts read as `media`."""

    class Media:
        async def check_part(self, *, principal: str, session_id: str, media: Any) -> None:
            return None

        async def read(self, *, session_id: str, media: MediaContent) -> bytes:
            if media.storage_ref not in (stored := media_bytes):
                raise MediaNotFound()
            return stored[media.storage_ref]

    media_bytes = media or {}
    return msgspec.structs.replace(
        turn_input(text, parts=parts),
        client_tools=tuple(ClientTool(name) for name in tools),
        media=Media(),
    )


def reply_text(events: list[RuntimeEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, Chunk))


@pytest.mark.parametrize(
    ("text", "name", "categories"),
    [
        ("What time is it?", "get_time", ("time",)),
        ("where am I", "get_timezone", ("location",)),
        ("please ask me something", "ask_user", ("prompt",)),
    ],
)
async def test_demo_asks_a_declared_client_tool_with_consent(
    text: str, name: str, categories: tuple[str, ...]
) -> None:
    outcome = ToolOutcome(status="completed", result={})
    events = await drive(DemoRuntime(word_delay=0), demo_turn(text, tools=(name,)), (outcome,))
    call = next(event for event in events if isinstance(event, ToolCall))
    assert call.name == name
    assert call.categories == categories
    assert call.consent_message
    assert call.id.startswith("call-")
    assert events[-1] == Done()


ASKING = "Let me ask your device for the time."  # the demo says so before asking


async def test_demo_says_what_it_does_before_the_clock_call() -> None:
    events = await drive(
        DemoRuntime(word_delay=0), demo_turn("what time is it"), (ToolOutcome("completed", "noon"),)
    )
    call = next(i for i, event in enumerate(events) if isinstance(event, ToolCall))
    assert reply_text(events[:call]) == ASKING + " "


async def test_demo_reports_what_the_tools_answered() -> None:
    runtime = DemoRuntime(word_delay=0)
    result = {"time": "Monday 12:00", "time_zone": "Europe/Paris"}
    answered = await drive(
        runtime, demo_turn("what time is it"), (ToolOutcome("completed", result),)
    )
    assert reply_text(answered) == (
        f"{ASKING} Your device says it is Monday 12:00 in the Europe/Paris time zone."
    )
    plain = await drive(runtime, demo_turn("the time?"), (ToolOutcome("completed", "noon"),))
    assert reply_text(plain) == f"{ASKING} Your device says it is noon."
    zone = await drive(
        runtime, demo_turn("where am i"), (ToolOutcome("completed", {"time_zone": "Asia/Tokyo"}),)
    )
    assert reply_text(zone) == (
        "Your time zone is Asia/Tokyo, so my guess is that you are somewhere near Tokyo."
    )
    answer = await drive(
        runtime, demo_turn("ask me"), (ToolOutcome("completed", {"answer": "Ada"}),)
    )
    assert reply_text(answer) == "Nice to meet you, Ada!"


async def test_demo_reports_a_declined_or_failed_tool() -> None:
    runtime = DemoRuntime(word_delay=0)
    denied = ToolOutcome(status="denied", error="declined by the user")
    declined = await drive(runtime, demo_turn("what time is it"), (denied,))
    assert reply_text(declined) == (
        f"{ASKING} I won't look, then: `get_time` was not allowed (declined by the user)."
    )
    failed = await drive(runtime, demo_turn("where am I"), (ToolOutcome("error", error="boom"),))
    assert reply_text(failed) == "Your client tried `get_timezone` but it failed: boom."


async def test_demo_calls_only_tools_the_client_declared() -> None:
    events = await drive(DemoRuntime(word_delay=0), demo_turn("what time is it", tools=("other",)))
    assert not any(isinstance(event, ToolCall) for event in events)
    assert reply_text(events) == "I'd ask your client for `get_time`, but it only offers: other."


async def test_demo_draws_a_png_picture() -> None:
    events = await drive(DemoRuntime(word_delay=0), demo_turn("Draw me something"))
    assert reply_text(events) == PICTURE_TEXT
    done = events[-1]
    assert isinstance(done, Done)
    assert done.parts is not None
    (part,) = done.parts
    assert part.type == "image"
    assert part.media is not None
    assert part.media.mime_type == "image/png"
    data = base64.b64decode(part.media.data or "")
    assert image_size(data) == (96, 96)
    assert part.media.size_bytes == len(data)
    assert zlib.decompress(data[41 : 41 + struct.unpack(">I", data[33:37])[0]])  # the IDAT


async def test_demo_streams_its_beep_as_wav_media_chunks() -> None:
    events = await drive(DemoRuntime(word_delay=0), demo_turn("beep"))
    assert reply_text(events) == SOUND_TEXT
    done = events[-1]
    assert isinstance(done, Done)
    assert done.parts is None  # the sound is streamed, not a part of `done`
    media = [event for event in events if isinstance(event, MediaChunk)]
    assert len(media) > 1
    assert len({chunk.media_id for chunk in media}) == 1  # one item
    assert all(len(chunk.media_id.encode()) <= 12 for chunk in media)  # fits an OMNI MediaID
    assert {chunk.mime_type for chunk in media} == {"audio/wav"}
    assert [chunk.sequence for chunk in media] == list(range(len(media)))
    assert [chunk.is_last for chunk in media] == [False] * (len(media) - 1) + [True]
    data = b"".join(chunk.data for chunk in media)
    with wave.open(io.BytesIO(data)) as sound:
        assert sound.getframerate() == 8000
        assert sound.getnchannels() == 1
        assert sound.getnframes() / sound.getframerate() == pytest.approx(0.5)


async def test_demo_describes_attachments_it_read() -> None:
    picture = base64.b64decode(picture_part().media.data or "")  # type: ignore[union-attr]
    parts = (
        ContentPart(type="text", text="what is this?"),
        ContentPart(
            type="image",
            media=MediaContent(mime_type="image/png", storage_ref="ref-1", filename="a.png"),
        ),
        ContentPart(type="file", media=MediaContent(mime_type="text/plain", storage_ref="gone")),
    )
    turn = demo_turn("", parts=parts, media={"ref-1": picture})
    events = await drive(DemoRuntime(word_delay=0), turn)
    assert reply_text(events) == (
        f"I received `a.png` (image/png, {len(picture)} bytes, 96×96 pixels). "
        "I could not read a file: no such media. "
        "Attachments reach me through Portico's media store."
    )


def test_image_size_reads_png_and_gif_headers() -> None:
    assert image_size(b"GIF89a" + struct.pack("<HH", 7, 9)) == (7, 9)
    assert image_size(b"\xff\xd8\xff\xe0 a jpeg") is None
