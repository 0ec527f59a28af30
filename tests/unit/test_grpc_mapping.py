"""The sans-I/O half of the `grpc` runtime: `ServerMessage`s to runtime events, and the
turn's `ClientMessage`s, without a socket; fuzzed with malformed sequences."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portico.contract import runtime_pb2 as pb
from portico.domain.model import ContentPart, MediaContent, Message
from portico.runtime.base import (
    Chunk,
    Done,
    Failure,
    MediaChunk,
    RuntimeEvent,
    ToolCall,
    ToolOutcome,
    TurnInput,
    Usage,
)
from portico.runtime.grpc.mapping import TurnReader, client_message, tool_result

Out = pb.ServerMessage
TERMINAL = (Done, Failure)


def read_all(*messages: Out) -> tuple[list[RuntimeEvent], list[str]]:
    reader = TurnReader()
    events: list[RuntimeEvent] = []
    notes: list[str] = []
    for message in messages:
        reading = reader.receive(message)
        events.extend(reading.events)
        notes.append(reading.note)
    return events, notes


def chunk(text: str, role: str = "") -> Out:
    return Out(chunk=pb.Chunk(content=text, role=role))


def client_call(arguments: str = "{}", **fields: Any) -> Out:
    call = {"id": "c1", "name": "get_time", **fields}
    return Out(
        tool_call=pb.ToolCall(execution=pb.TOOL_EXECUTION_CLIENT, arguments_json=arguments, **call)
    )


def media(
    sequence: int, *, last: bool = False, media_id: str = "m", mime: str = "audio/pcm"
) -> Out:
    return Out(
        media_chunk=pb.MediaChunk(
            media_id=media_id, sequence=sequence, is_last=last, mime_type=mime, data=b"x"
        )
    )


def failed(events: list[RuntimeEvent]) -> Failure:
    assert isinstance(events[-1], Failure), events
    assert sum(isinstance(event, TERMINAL) for event in events) == 1
    return events[-1]


def test_chunks_then_done_with_usage_and_parts() -> None:
    image = pb.MediaContent(url="https://x/a.png", mime_type="image/png")
    done = pb.Done(
        final_content="final",
        usage=pb.Usage(input_tokens=2, output_tokens=3),
        parts=[pb.ContentPart(type="text", text="t"), pb.ContentPart(type="image", media=image)],
    )
    events, _ = read_all(chunk("a"), chunk(""), chunk("b"), Out(done=done))
    parts = (
        ContentPart(type="text", text="t"),
        ContentPart(type="image", media=MediaContent(mime_type="image/png", url="https://x/a.png")),
    )
    assert events == [
        Chunk("a"),
        Chunk("b"),
        Usage(input_tokens=2, output_tokens=3),
        Done(content="final", parts=parts),
    ]


def test_a_done_without_final_content_keeps_the_streamed_text() -> None:
    events, _ = read_all(chunk("a"), Out(done=pb.Done()))
    assert events == [Chunk("a"), Done(content=None, parts=None)]


def test_a_client_tool_call_is_forwarded_and_a_server_one_is_not() -> None:
    events, notes = read_all(
        Out(tool_call=pb.ToolCall(id="s", name="lookup", arguments_json='{"secret": 1}')),
        Out(tool_result=pb.ToolResult(id="s", result_json="1")),
        client_call('{"zone": "UTC"}', consent_message="ok?", categories=["time"]),
    )
    assert events == [
        ToolCall(
            id="c1",
            name="get_time",
            arguments={"zone": "UTC"},
            consent_message="ok?",
            categories=("time",),
        )
    ]
    assert "lookup" in notes[0]
    assert all("secret" not in note for note in notes)  # arguments are never logged


@pytest.mark.parametrize(
    "message",
    [
        Out(),
        client_call("{not json"),
        client_call("[1, 2]"),
        client_call("{}", id=""),
        Out(done=pb.Done(parts=[pb.ContentPart(type="image")])),
        Out(done=pb.Done(parts=[pb.ContentPart(type="hologram", text="x")])),
        media(1),
        Out(media_chunk=pb.MediaChunk(sequence=0, mime_type="a/b")),
        media(0, mime=""),
    ],
    ids=[
        "empty oneof",
        "arguments not JSON",
        "arguments not an object",
        "no call id",
        "media part without media",
        "unknown part type",
        "media out of sequence",
        "media without id",
        "media without mime type",
    ],
)
def test_a_malformed_message_fails_the_turn_once(message: Out) -> None:
    events, _ = read_all(chunk("before"), message, chunk("after"), Out(done=pb.Done()))
    assert events[0] == Chunk("before")
    assert failed(events).code == "INTERNAL_ERROR"


def test_media_streams_follow_their_sequence_and_end_with_is_last() -> None:
    events, _ = read_all(
        media(0), media(0, media_id="n"), media(1, last=True), media(1, media_id="n", mime="")
    )
    assert [(e.media_id, e.sequence, e.mime_type) for e in events if isinstance(e, MediaChunk)] == [
        ("m", 0, "audio/pcm"),
        ("n", 0, "audio/pcm"),
        ("m", 1, "audio/pcm"),
        ("n", 1, "audio/pcm"),  # a later chunk may leave the mime type out
    ]
    events, _ = read_all(media(0, last=True), media(1))
    assert failed(events).code == "INTERNAL_ERROR"  # a chunk after the last one


def test_an_error_ends_the_turn_and_a_later_done_is_ignored_with_a_note() -> None:
    reader = TurnReader()
    first = reader.receive(Out(error=pb.Error(code="PROVIDER_TIMEOUT", message="m")))
    late = reader.receive(Out(done=pb.Done(final_content="x")))
    assert first.events == (Failure(code="PROVIDER_TIMEOUT", message="m"),)
    assert (late.events, reader.clean, reader.broken) == ((), False, False)
    assert "after the turn's terminal" in late.note
    assert reader.fail("stream broken").events == ()


def test_transport_failures_end_the_turn_unclean() -> None:
    reader = TurnReader()
    reading = reader.fail("stream broken: connection reset", broken=True)
    assert reading.events == (Failure("INTERNAL_ERROR", "stream broken: connection reset"),)
    assert (reader.ended, reader.clean, reader.broken) == (True, False, True)


def test_duplex_only_messages_are_ignored_in_a_text_turn() -> None:
    events, notes = read_all(
        Out(interruption=pb.Interruption()),
        Out(runtime_hello=pb.RuntimeHello(capabilities=["x"])),
        chunk("you said", role="user"),
        Out(done=pb.Done()),
    )
    assert events == [Done()]
    assert all(notes[:3])


def turn_input(**fields: Any) -> TurnInput:
    message = Message(
        id="m",
        session_id="s",
        role="user",
        content="hello",
        parts=(ContentPart(type="image", media=MediaContent(mime_type="image/png", url="u")),),
        metadata={"ticket": "T"},
        created_at=1.0,
        updated_at=1.0,
    )
    base: dict[str, Any] = {
        "session_id": "s",
        "turn_id": "t",
        "agent": "default",
        "owner": "alice",
        "message": message,
    }
    return TurnInput(**{**base, **fields})


def test_the_client_message_carries_text_parts_metadata_and_consent_grants() -> None:
    sent = client_message(
        turn_input(
            directives={"mock_scenario": "x", "omnia.consent_grants": "a, b,", "agent_prompt": "p"},
            context={"k": 1},
        )
    )
    assert (sent.session_id, sent.content) == ("s", "hello")
    assert dict(sent.metadata) == {
        "ticket": "T",
        "mock_scenario": "x",
        "omnia.consent_grants": "a, b,",
        "portico.agent_prompt": "p",
        "portico.context": '{"k":1}',
    }
    assert list(sent.consent_grants) == ["a", "b"]
    (part,) = sent.parts
    assert (part.type, part.media.url, part.media.mime_type) == ("image", "u", "image/png")


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (ToolOutcome(status="completed", result={"a": 1}), ('{"a":1}', False, "")),
        (ToolOutcome(status="error", error="boom"), ('{"error":"boom"}', False, "")),
        (ToolOutcome(status="denied", error="no"), ("", True, "no")),
        (None, ("", True, "")),
    ],
)
def test_tool_outcomes_become_client_tool_results(
    outcome: ToolOutcome | None, expected: tuple[str, bool, str]
) -> None:
    result = tool_result("c1", outcome).client_tool_result
    assert result.call_id == "c1"
    assert (result.result_json, result.is_rejected, result.rejection_reason) == expected


# -- fuzz: any sequence, exactly one terminal event -------------------------------------

texts = st.text(max_size=8)
parts = st.builds(
    pb.ContentPart,
    type=st.sampled_from(["text", "image", "audio", "", "x"]),
    text=texts,
    media=st.one_of(
        st.none(),
        st.builds(pb.MediaContent, data=texts, url=texts, mime_type=texts, storage_ref=texts),
    ),
)
members = st.one_of(
    st.builds(lambda c, r: Out(chunk=pb.Chunk(content=c, role=r)), texts, texts),
    st.builds(
        lambda i, n, a, e: Out(tool_call=pb.ToolCall(id=i, name=n, arguments_json=a, execution=e)),
        texts,
        texts,
        st.one_of(texts, st.just('{"a": 1}'), st.just("[]")),
        st.sampled_from([0, 1, 7]),
    ),
    st.builds(lambda p: Out(done=pb.Done(parts=p)), st.lists(parts, max_size=2)),
    st.builds(lambda c, m: Out(error=pb.Error(code=c, message=m)), texts, texts),
    st.builds(
        lambda i, s, last, m: Out(
            media_chunk=pb.MediaChunk(media_id=i, sequence=s, is_last=last, mime_type=m)
        ),
        st.sampled_from(["", "a", "b"]),
        st.integers(-1, 3),
        st.booleans(),
        st.sampled_from(["", "audio/pcm"]),
    ),
    st.just(Out()),
    st.just(Out(interruption=pb.Interruption())),
    st.just(Out(tool_result=pb.ToolResult(id="x"))),
)
# A transport failure (a broken stream, a timeout) may interleave with the messages.
inputs = st.lists(st.one_of(members, st.just("broken")), max_size=12)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(inputs)
def test_any_sequence_gives_exactly_one_terminal_event_last(sequence: list[Out | str]) -> None:
    reader = TurnReader()
    events: list[RuntimeEvent] = []
    for item in sequence:
        reading = (
            reader.fail("stream broken", broken=True) if item == "broken" else reader.receive(item)
        )
        events.extend(reading.events)
    # The adapter ends every turn the runtime left open (its stream ended).
    events.extend(reader.fail("stream broken: the runtime ended the stream").events)
    terminals = [index for index, event in enumerate(events) if isinstance(event, TERMINAL)]
    assert len(terminals) == 1
    assert terminals[0] == len(events) - 1
    assert reader.ended
