"""The handler API in process: a handler driven through the `python` runtime's adapter
onto the Runtime port, the loader's checks, and the gRPC agent's bounded memory."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from portico.agent import Reply, ToolRejected, ToolResult, Turn
from portico.agent.api import MEDIA_CHUNK_BYTES, HistoryMessage
from portico.agent.loader import load_handler
from portico.agent.server import Memory
from portico.domain.model import ContentPart, MediaContent, Message
from portico.errors import PluginError
from portico.runtime.base import (
    Chunk,
    Done,
    Failure,
    MediaChunk,
    ToolCall,
    ToolOutcome,
    Usage,
)
from portico.runtime.python import PythonRuntime
from support import agents
from support.turns import drive, turn_input


def runtime() -> PythonRuntime:
    return PythonRuntime(agents.handler)


def of(name: str, **extra: str) -> dict[str, str]:
    return {"scenario": name, **extra}


async def test_text_streams_as_chunks_then_done() -> None:
    events = await drive(runtime(), turn_input(metadata=of("stream")))
    assert events == [Chunk("one "), Chunk("two "), Chunk("three"), Done()]


async def test_parts_end_the_reply_after_its_text() -> None:
    events = await drive(runtime(), turn_input(metadata=of("parts")))
    image = ContentPart(
        type="image", media=MediaContent(mime_type="image/png", url="https://x.test/a.png")
    )
    caption = ContentPart(type="text", text="a caption")
    assert events == [Chunk("see the picture"), Done(parts=(image, caption))]


async def test_usage_goes_out_per_yield_without_cost() -> None:
    events = await drive(runtime(), turn_input(metadata=of("usage")))
    assert events[1:] == [Usage(3, 4), Usage(1, 1), Done()]


async def test_media_is_cut_into_numbered_pieces() -> None:
    events = await drive(runtime(), turn_input(metadata=of("media")))
    pieces = [event for event in events if isinstance(event, MediaChunk)]
    assert [(p.media_id, p.sequence, p.is_last) for p in pieces] == [
        ("clip-1", 0, False),
        ("clip-1", 1, True),
    ]
    assert len(pieces[0].data) == MEDIA_CHUNK_BYTES
    assert b"".join(p.data for p in pieces) == agents.MEDIA_BYTES
    assert events[-2:] == [Chunk("played"), Done()]


@pytest.mark.parametrize(
    ("outcome", "said"),
    [
        (ToolOutcome(status="completed", result={"hour": 9}), 'result:{"hour": 9}'),
        (ToolOutcome(status="denied", error="the user said no"), "rejected:the user said no"),
        (ToolOutcome(status="denied", error="timed out"), "rejected:timed out"),
        (ToolOutcome(status="error", error="no clock"), "rejected:no clock"),
    ],
)
async def test_a_client_tool_answer_comes_back_as_a_value(outcome: ToolOutcome, said: str) -> None:
    events = await drive(runtime(), turn_input(metadata=of("tool")), (outcome,))
    call = events[0]
    assert isinstance(call, ToolCall)
    assert (call.name, call.arguments) == ("get_time", {"zone": "UTC"})
    assert (call.consent_message, call.categories) == ("May I read your clock?", ("time",))
    assert events[1:] == [Chunk(said), Done()]


async def test_two_tool_calls_get_their_own_ids_and_answers() -> None:
    answers = (ToolOutcome(status="completed", result=1), ToolOutcome(status="completed", result=2))
    events = await drive(runtime(), turn_input(metadata=of("two_tools")), answers)
    calls = [event for event in events if isinstance(event, ToolCall)]
    assert len({call.id for call in calls}) == 2
    assert events[-2:] == [Chunk("result:1 result:2"), Done()]


async def test_an_agent_error_is_a_failure_with_its_code() -> None:
    events = await drive(runtime(), turn_input(metadata=of("agent_error")))
    assert events == [Chunk("partial "), Failure("PROVIDER_UNAVAILABLE", "the model is down")]


@pytest.mark.parametrize("name", ["crash", "bad_yield"])
async def test_a_crash_is_a_generic_internal_failure(name: str) -> None:
    events = await drive(runtime(), turn_input(metadata=of(name)))
    assert events[-1] == Failure("INTERNAL_ERROR", "internal error")
    assert not any(isinstance(event, Done) for event in events)


async def test_the_turn_sees_text_parts_metadata_directives_and_history() -> None:
    earlier = Message(
        id="m0", session_id="s1", role="assistant", content="before", created_at=0, updated_at=0
    )
    image = ContentPart(type="image", media=MediaContent(mime_type="image/png", url="u"))
    turn = turn_input(
        "hello", scenario="x", parts=(image,), history=(earlier,), metadata=of("turn")
    )
    (chunk, done) = await drive(runtime(), turn)
    assert isinstance(chunk, Chunk)
    assert done == Done()
    assert chunk.text == (
        '{"consent_grants": [], "history": [["assistant", "before"]], '
        '"metadata": {"mock_scenario": "x", "scenario": "turn"}, "parts": ["image"], '
        '"session_id": "s1", "text": "hello"}'
    )


async def test_the_turn_sees_consent_grants_and_portico_keys_as_over_grpc() -> None:
    metadata = {**of("turn"), "omnia.consent_grants": "location, camera"}
    turn = msgspec.structs.replace(
        turn_input("hi", metadata=metadata),
        directives={"agent_prompt": "be brief"},
        context={"page": "cart"},
    )
    (chunk, _) = await drive(runtime(), turn)
    assert isinstance(chunk, Chunk)
    seen = json.loads(chunk.text)
    assert seen["consent_grants"] == ["location", "camera"]
    assert seen["metadata"] == {
        **metadata,
        "portico.agent_prompt": "be brief",
        "portico.context": '{"page":"cart"}',
    }


async def test_closing_the_stream_cancels_the_handler() -> None:
    cancelled = asyncio.Event()

    async def waiting(turn: Turn) -> AsyncIterator[Reply]:
        yield "started"
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    stream = PythonRuntime(waiting).run(turn_input())
    assert await stream.asend(None) == Chunk("started")
    await stream.aclose()
    assert cancelled.is_set()


async def test_a_turn_without_a_tool_channel_gets_a_rejection() -> None:
    answer = await Turn(session_id="s", text="").call_client_tool("x")
    assert isinstance(answer, ToolRejected)
    assert not isinstance(answer, ToolResult)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("support.broken_plugin:handler", "cannot import support.broken_plugin: ImportError"),
        ("no_such_module_here:handler", "cannot import no_such_module_here"),
        ("support.agents:missing", "support.agents has no attribute missing"),
        ("support.agents:not_a_generator", "a coroutine function"),
        ("support.agents:sync_generator", "a plain generator function"),
        ("support.agents:NOT_CALLABLE", "expected an async generator function"),
        ("support.agents:two_arguments", "exactly one argument"),
        ("support.agents:", "expected module:attr"),
        ("no-such-entry-point", "no entry point of that name in group portico.agents"),
    ],
)
def test_the_loader_refuses_with_a_message_naming_the_plugin(spec: str, words: str) -> None:
    with pytest.raises(PluginError) as refused:
        load_handler(spec)
    assert spec in refused.value.message
    assert words in refused.value.message
    assert "\n" not in refused.value.message


def test_the_loader_finds_an_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "my_agents-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-agents\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[portico.agents]\ntest-agent = support.agents:handler\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_handler("test-agent") is agents.handler
    assert "support.agents" in sys.modules


def test_the_agents_memory_is_bounded_by_conversations_and_messages() -> None:
    memory = Memory(max_conversations=2, max_messages=3)
    for n in range(5):
        memory.append("a", HistoryMessage(role="user", content=str(n)))
    assert [m.content for m in memory.messages("a")] == ["2", "3", "4"]
    memory.append("b", HistoryMessage(role="user", content="b"))
    memory.append("a", HistoryMessage(role="user", content="5"))  # a is the most recent
    memory.append("c", HistoryMessage(role="user", content="c"))  # b goes
    assert ("a" in memory, "b" in memory, "c" in memory) == (True, False, True)
    assert memory.messages("b") == ()


def first_python_block(path: Path, after: str) -> str:
    text = path.read_text(encoding="utf-8")
    return text[text.index(after) :].split("```python\n", 1)[1].split("```", 1)[0]


def handler_of(code: str) -> PythonRuntime:
    namespace: dict[str, object] = {}
    exec(compile(code, "<docs>", "exec"), namespace)  # the documented code, as printed
    handler = namespace["handler"]
    return PythonRuntime(handler)  # type: ignore[arg-type]


ROOT = Path(__file__).resolve().parents[2]
CLOCK = (ToolOutcome(status="completed", result="09:00"),)


async def test_the_readme_handler_runs_as_printed() -> None:
    code = first_python_block(ROOT / "README.md", "## Bring your own agent")
    events = await drive(handler_of(code), turn_input("hi"), CLOCK)
    assert isinstance(events[1], ToolCall)
    assert events[1].consent_message == "May I read your clock?"
    assert [events[0], *events[2:]] == [
        Chunk("You said 'hi'. "),
        Chunk("Your clock says 09:00."),
        Done(),
    ]


async def test_the_docs_handler_runs_as_printed() -> None:
    code = first_python_block(ROOT / "docs" / "agents.md", "## The handler")
    events = await drive(handler_of(code), turn_input("hi"), CLOCK)
    assert isinstance(events[1], ToolCall)
    assert [events[0], *events[2:]] == [
        Chunk("Let me check. "),
        Chunk("It is 09:00."),
        Usage(120, 9),
        Done(),
    ]
