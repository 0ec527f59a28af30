"""The sans-I/O half of the `grpc` duplex runtime (runtime/duplex/grpc_mapping.py): the
contract's duplex messages to the port's events and back, without a socket; fuzzed with
arbitrary message sequences."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portico.config import AgentSettings
from portico.contract import runtime_pb2 as pb
from portico.runtime.duplex import duplex_runtime_of
from portico.runtime.duplex.base import (
    AgentText,
    AudioFormat,
    AudioIn,
    AudioOut,
    DuplexEvent,
    DuplexFailure,
    DuplexStart,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)
from portico.runtime.duplex.grpc_mapping import (
    BROKEN,
    DUPLEX_ERROR,
    MALFORMED,
    NO_CLIENT_TOOLS,
    SILENT,
    CallReader,
    Reading,
    audio_input,
    duplex_start,
)

Out = pb.ServerMessage
CALLER = AudioFormat(sample_rate=16000, channels=1)


def hello(**media: int | str) -> Out:
    negotiation = pb.MediaNegotiation(**media)  # type: ignore[arg-type]
    return Out(runtime_hello=pb.RuntimeHello(capabilities=["audio"], media=negotiation))


def audio(data: bytes = b"\x01\x02", sequence: int = 0, *, last: bool = False) -> Out:
    return Out(media_chunk=pb.MediaChunk(media_id="a", sequence=sequence, is_last=last, data=data))


def chunk(text: str, role: str = "") -> Out:
    return Out(chunk=pb.Chunk(content=text, role=role))


def error(code: str, message: str = "the runtime says so") -> Out:
    return Out(error=pb.Error(code=code, message=message))


DONE = Out(done=pb.Done())
INTERRUPTION = Out(interruption=pb.Interruption())


def read_all(*messages: Out, reader: CallReader | None = None) -> list[DuplexEvent]:
    reader = reader or CallReader(CALLER)
    events: list[DuplexEvent] = []
    for message in messages:
        events.extend(reader.receive(message).events)
    return events


def test_a_call_maps_hello_audio_text_transcripts_interruption_and_done() -> None:
    events = read_all(
        hello(codec="pcm16", sample_rate=24000, channels=1),
        chunk("hello there", role="user"),
        chunk("Hi"),
        audio(b"\x01\x02", 0),
        audio(b"\x03\x04", 1, last=True),
        DONE,
        audio(b"\x05", 2),
        INTERRUPTION,
        Out(done=pb.Done(final_content="said instead")),
    )
    assert events == [
        Hello(format=AudioFormat(sample_rate=24000, channels=1), capabilities=("audio",)),
        Transcript("hello there"),
        AgentText("Hi"),
        AudioOut(data=b"\x01\x02", media_id="a", sequence=0),
        AudioOut(data=b"\x03\x04", media_id="a", sequence=1, is_last=True),
        SpokenTurnDone(),
        AudioOut(data=b"\x05", media_id="a", sequence=2),
        Interruption(),
        SpokenTurnDone("said instead"),
    ]


def test_a_counter_offer_leaves_unset_fields_to_the_callers_format_and_keeps_video() -> None:
    (offer,) = read_all(hello())
    assert isinstance(offer, Hello)
    assert offer.format == CALLER
    (video,) = read_all(hello(frame_rate=30))
    assert isinstance(video, Hello)
    assert video.format.is_video  # the server answers it UNSATISFIABLE_FORMAT


def test_empty_chunks_are_skipped() -> None:
    assert read_all(hello(), chunk(""), chunk("", role="user"))[1:] == []


def one_failure(events: list[DuplexEvent]) -> DuplexFailure:
    failures = [event for event in events if isinstance(event, DuplexFailure)]
    assert len(failures) == 1, events
    assert events[-1] is failures[0]
    return failures[0]


def test_anything_but_runtime_hello_first_is_malformed() -> None:
    for first in (audio(), chunk("hi"), DONE, INTERRUPTION, Out()):
        reader = CallReader(CALLER)
        assert one_failure(read_all(first, reader=reader)) == DuplexFailure(DUPLEX_ERROR, MALFORMED)
        assert reader.ended


def test_an_empty_message_and_a_second_hello_are_malformed() -> None:
    assert one_failure(read_all(hello(), Out())).message == MALFORMED
    assert one_failure(read_all(hello(), hello())).message == MALFORMED


def test_a_runtime_error_passes_client_protocol_codes_and_masks_the_rest() -> None:
    passed = one_failure(read_all(hello(), error("PROVIDER_UNAVAILABLE", "model down")))
    assert passed == DuplexFailure("PROVIDER_UNAVAILABLE", "model down")
    masked = one_failure(read_all(hello(), error("BACKEND_EXPLODED", "secret detail")))
    assert masked.code == DUPLEX_ERROR
    assert "secret" not in masked.message
    # An error needs no hello before it: a runtime may refuse the call outright.
    assert one_failure(read_all(error("UNSATISFIABLE_FORMAT"))).code == "UNSATISFIABLE_FORMAT"


def test_nothing_follows_an_error_and_a_late_done_is_only_noted() -> None:
    reader = CallReader(CALLER)
    read_all(hello(), error("PROVIDER_UNAVAILABLE"), reader=reader)
    late = reader.receive(DONE)
    assert late.events == ()
    assert "after the call ended" in late.note
    assert reader.fail(BROKEN, "stream broken").events == ()


def test_a_client_tool_call_is_rejected_back_to_the_runtime_and_a_server_one_ignored() -> None:
    reader = CallReader(CALLER)
    read_all(hello(), reader=reader)
    call = pb.ToolCall(id="c1", name="get_time", execution=pb.TOOL_EXECUTION_CLIENT)
    reading = reader.receive(Out(tool_call=call))
    assert reading.events == ()
    (reply,) = reading.replies
    assert reply.client_tool_result == pb.ClientToolResult(
        call_id="c1", is_rejected=True, rejection_reason=NO_CLIENT_TOOLS
    )
    server = reader.receive(Out(tool_call=pb.ToolCall(id="s", name="lookup")))
    assert (server.events, server.replies) == ((), ())
    assert reader.receive(Out(tool_result=pb.ToolResult(id="s"))) == Reading(
        note="server tool result (the runtime's own) not forwarded"
    )
    nameless = pb.ToolCall(execution=pb.TOOL_EXECUTION_CLIENT)
    assert one_failure(list(reader.receive(Out(tool_call=nameless)).events)).message == MALFORMED


def test_the_stream_ending_is_a_hangup_unless_the_runtime_owed_something() -> None:
    before_hello = CallReader(CALLER)
    assert one_failure(list(before_hello.stream_ended().events)).message == BROKEN

    mid_turn = CallReader(CALLER)
    read_all(hello(), audio(), reader=mid_turn)
    assert one_failure(list(mid_turn.stream_ended().events)).message == BROKEN

    between_turns = CallReader(CALLER)
    read_all(hello(), audio(), DONE, reader=between_turns)
    assert between_turns.stream_ended().events == ()
    assert between_turns.ended
    assert not between_turns.failed


def test_which_silence_fails_the_call() -> None:
    reader = CallReader(CALLER)
    assert reader.wait() == "hello"
    read_all(hello(), reader=reader)
    assert reader.wait() == "none"  # between turns: the caller may be silent
    read_all(chunk("caller words", role="user"), reader=reader)
    assert reader.wait() == "none"  # a transcript starts no spoken turn
    read_all(chunk("agent words"), reader=reader)
    assert reader.wait() == "turn"
    read_all(INTERRUPTION, reader=reader)
    assert reader.wait() == "none"
    reader.caller_finished()
    assert reader.wait() == "ending"
    failure = one_failure(list(reader.silence(2.0).events))
    assert failure == DuplexFailure(DUPLEX_ERROR, SILENT)
    assert reader.wait() == "none"


def test_close_ends_the_call_without_a_failure() -> None:
    reader = CallReader(CALLER)
    read_all(hello(), audio(), reader=reader)
    reader.closed()
    assert reader.stream_ended().events == ()
    assert not reader.failed


def test_the_facades_messages_carry_the_start_and_the_audio() -> None:
    start = DuplexStart(
        session_id="s1",
        agent="default",
        owner="alice",
        format=AudioFormat(codec="opus", sample_rate=48000, channels=2),
        system_instruction="be brief",
    )
    assert duplex_start(start) == pb.ClientMessage(
        session_id="s1",
        duplex_start=pb.DuplexStart(
            codec="opus", sample_rate=48000, channels=2, system_instruction="be brief"
        ),
    )
    message = audio_input("s1", AudioIn(b"pcm", 2**32 + 5, is_last=True))
    assert message.audio_input == pb.AudioInputChunk(data=b"pcm", sequence=5, is_last=True)


def test_a_grpc_agent_takes_calls_on_the_grpc_duplex_runtime_by_default() -> None:
    assert duplex_runtime_of(AgentSettings(runtime="grpc", grpc_target="h:1")) == "grpc"
    scripted = AgentSettings(runtime="grpc", grpc_target="h:1", duplex_runtime="scripted")
    assert duplex_runtime_of(scripted) == "scripted"


# -- fuzz: any sequence, Hello first or never, at most one failure, nothing after it -----

texts = st.text(max_size=6)
members = st.one_of(
    st.builds(
        lambda codec, rate, frame_rate: hello(codec=codec, sample_rate=rate, frame_rate=frame_rate),
        st.sampled_from(["", "pcm16", "opus"]),
        st.integers(-1, 48000),
        st.sampled_from([0, 0, 30]),
    ),
    st.builds(lambda c, r: chunk(c, r), texts, st.sampled_from(["", "user", "assistant"])),
    st.builds(
        lambda d, s, last, i: Out(
            media_chunk=pb.MediaChunk(media_id=i, sequence=s, is_last=last, data=d)
        ),
        st.binary(max_size=4),
        st.integers(-(2**31), 2**31 - 1),
        st.booleans(),
        st.sampled_from(["", "a"]),
    ),
    st.builds(lambda c: Out(done=pb.Done(final_content=c)), texts),
    st.builds(error, st.sampled_from(["", "PROVIDER_UNAVAILABLE", "X"]), texts),
    st.builds(
        lambda i, e: Out(tool_call=pb.ToolCall(id=i, name="t", execution=e)),
        st.sampled_from(["", "c"]),
        st.sampled_from([0, 1, 9]),
    ),
    st.just(Out(tool_result=pb.ToolResult(id="x"))),
    st.just(INTERRUPTION),
    st.just(Out()),
)
# The transport's news may interleave: a break, a silence past the deadline, the end of
# the stream, the caller's last audio, the facade's close.
news = st.sampled_from(["broken", "silence", "ended", "last", "closed"])
inputs = st.lists(st.one_of(members, news), max_size=14)


def feed(reader: CallReader, item: Out | str) -> Reading:
    if isinstance(item, Out):
        return reader.receive(item)
    if item == "broken":
        return reader.fail(BROKEN, "stream broken: reset")
    if item == "silence":
        return reader.silence(1.0)
    if item == "ended":
        return reader.stream_ended()
    if item == "last":
        reader.caller_finished()
    else:
        reader.closed()
    return Reading()


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(inputs)
def test_any_sequence_keeps_the_ports_rules(sequence: list[Out | str]) -> None:
    reader = CallReader(CALLER)
    events: list[DuplexEvent] = []
    for item in sequence:
        events.extend(feed(reader, item).events)
    hellos = [index for index, event in enumerate(events) if isinstance(event, Hello)]
    failures = [event for event in events if isinstance(event, DuplexFailure)]
    assert hellos in ([], [0])
    if not hellos:  # without a hello, a failure is all a call can say
        assert events == failures
    assert len(failures) <= 1
    if failures:
        assert events[-1] is failures[0]
        assert failures[0].code in (DUPLEX_ERROR, "PROVIDER_UNAVAILABLE")
    assert reader.failed == bool(failures)
