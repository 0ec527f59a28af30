"""The `/ws` side of a voice call, sans-I/O: every wire rule of spec/realtime-audio.md."""

from __future__ import annotations

import base64
import json
from typing import Any

from portico.errors import SessionExpired
from portico.protocols.omnia import frames as f
from portico.protocols.omnia.binary import (
    BinaryFrame,
    BinaryMetadata,
    decode_frame,
    encode_frame,
)
from portico.protocols.omnia.connection import ConnectionLimits, LimitHit, OmniaConnection
from portico.protocols.omnia.voice import (
    AUDIO_AFTER_LAST,
    AUDIO_RATE,
    BAD_FORMAT,
    CHUNK_ORDER,
    CHUNK_START,
    CHUNK_TOO_LARGE,
    NEEDS_FORMAT,
    CallAudio,
    CallHungUp,
    CallRequested,
    CallState,
    VoiceLimits,
    VoiceWire,
)
from portico.protocols.outbox import BinaryData
from portico.runtime.duplex.base import (
    AgentText,
    AudioFormat,
    AudioIn,
    AudioOut,
    DuplexFailure,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)

SID = "sess-1"
STAMP = "2025-01-09T12:00:00.000Z"
FMT = BinaryMetadata(codec="pcm16", sample_rate=16000, channels=1)
HELLO = Hello(format=AudioFormat(sample_rate=24000))


def wire(binary: bool = True, **limits: int) -> VoiceWire:
    return VoiceWire(session_id=SID, binary=binary, limits=VoiceLimits(**limits))


def frame(
    payload: bytes = b"\x01\x02",
    *,
    sequence: int = 0,
    metadata: BinaryMetadata | None = None,
    is_last: bool = False,
    chunked: bool = False,
    media_id: str = "c1",
) -> BinaryFrame:
    return BinaryFrame(
        sequence=sequence,
        metadata=metadata or BinaryMetadata(),
        is_last=is_last,
        chunked=chunked,
        media_id=media_id,
        payload=payload,
    )


def codes(errors: list[Any]) -> list[tuple[str, str]]:
    return [(error.code, error.message) for error in errors]


def live(voice: VoiceWire | None = None) -> VoiceWire:
    voice = voice or wire()
    events, _ = voice.receive(frame(metadata=FMT), now=0.0)
    assert isinstance(events[0], CallRequested)
    return voice


def as_json(frames: list[Any]) -> list[dict[str, Any]]:
    out = []
    for item in frames:
        assert not isinstance(item, BinaryData)
        data = json.loads(msgspec_encode(item))
        data.pop("timestamp")
        out.append(data)
    return out


def msgspec_encode(item: f.ServerFrame) -> bytes:
    import msgspec

    return msgspec.json.encode(item)


# -- starting a call ---------------------------------------------------------------------


def test_the_first_frame_starts_a_call_in_the_format_its_metadata_names() -> None:
    voice = wire()
    events, errors = voice.receive(frame(b"ab", sequence=7, metadata=FMT), now=0.0)
    assert errors == []
    assert events == [
        CallRequested(AudioFormat(codec="pcm16", sample_rate=16000, channels=1), AudioIn(b"ab", 7))
    ]
    assert voice.state is CallState.LIVE


def test_later_frames_go_to_the_call_in_order_without_metadata() -> None:
    voice = live()
    for n in range(1, 4):
        events, errors = voice.receive(frame(bytes([n]), sequence=n), now=0.0)
        assert (events, errors) == ([CallAudio(AudioIn(bytes([n]), n))], [])


def test_the_format_may_come_from_the_mime_type_and_pcm_means_pcm16() -> None:
    meta = BinaryMetadata(mime_type="audio/pcm;rate=48000;channels=2", codec="pcm")
    (event,), _ = wire().receive(frame(metadata=meta), now=0.0)
    assert isinstance(event, CallRequested)
    assert event.format == AudioFormat(codec="pcm16", sample_rate=48000, channels=2)


def test_a_first_frame_without_a_sample_rate_is_refused_and_starts_nothing() -> None:
    voice = wire()
    events, errors = voice.receive(frame(metadata=BinaryMetadata(codec="pcm16")), now=0.0)
    assert (events, codes(errors)) == ([], [("INVALID_MESSAGE", NEEDS_FORMAT)])
    assert voice.state is CallState.IDLE
    assert isinstance(voice.receive(frame(metadata=FMT), now=0.0)[0][0], CallRequested)


def test_a_format_out_of_range_is_refused() -> None:
    for meta in (
        BinaryMetadata(sample_rate=100),
        BinaryMetadata(sample_rate=16000, channels=0),
        BinaryMetadata(sample_rate=16000, channels=99),
        BinaryMetadata(sample_rate=16000, codec="x" * 33),
    ):
        assert codes(wire().receive(frame(metadata=meta), now=0.0)[1]) == [
            ("INVALID_MESSAGE", BAD_FORMAT)
        ]


# -- IsLast, hangup, end -------------------------------------------------------------------


def test_is_last_ends_the_call_and_later_frames_get_one_error() -> None:
    voice = live()
    events, _ = voice.receive(frame(sequence=1, is_last=True), now=0.0)
    assert events == [CallAudio(AudioIn(b"\x01\x02", 1, is_last=True))]
    assert voice.state is CallState.ENDING
    assert codes(voice.receive(frame(sequence=2), now=0.0)[1]) == [
        ("INVALID_MESSAGE", AUDIO_AFTER_LAST)
    ]
    assert voice.receive(frame(sequence=3), now=0.0) == ([], [])
    voice.ended()
    assert isinstance(voice.receive(frame(metadata=FMT), now=0.0)[0][0], CallRequested)


def test_hangup_ends_a_live_call_and_is_ignored_without_one() -> None:
    assert wire().hangup() == []
    voice = live()
    assert voice.hangup() == [CallHungUp()]
    assert voice.state is CallState.IDLE


def test_a_refused_call_drops_its_frames_silently_until_is_last_or_hangup() -> None:
    voice = wire()
    voice.receive(frame(metadata=FMT), now=0.0)
    (error,) = voice.refuse(SessionExpired(), STAMP)
    assert isinstance(error, f.ErrorFrame)
    assert error.error.code == "SESSION_EXPIRED"
    assert voice.receive(frame(sequence=1), now=0.0) == ([], [])
    assert voice.receive(frame(sequence=2, is_last=True), now=0.0) == ([], [])
    assert voice.state is CallState.IDLE
    voice.refuse(SessionExpired(), STAMP)
    assert voice.hangup() == []  # nothing live to end; the refusal is forgotten
    assert voice.state is CallState.IDLE


# -- the runtime's events out ------------------------------------------------------------


def test_session_config_goes_once_before_any_audio() -> None:
    voice = live()
    assert voice.on_event(AudioOut(data=b"x"), STAMP) == []  # before the counter-offer
    (config,) = as_json(voice.on_event(HELLO, STAMP))
    assert config == {
        "type": "session_config",
        "session_config": {"codec": "pcm16", "sample_rate": 24000, "channels": 1},
        "session_id": SID,
    }
    assert voice.on_event(HELLO, STAMP) == []


def test_binary_clients_get_omni_frames_numbered_per_spoken_item() -> None:
    voice = live()
    voice.on_event(HELLO, STAMP)
    out = [voice.on_event(AudioOut(data=bytes([n]) * 4), STAMP) for n in range(3)]
    frames = [decode_frame(item) for (item,) in out]
    assert all(isinstance(item, BinaryData) for (item,) in out)
    assert [(fr.media_id, fr.sequence, fr.payload) for fr in frames] == [
        ("a1", 0, b"\0" * 4),
        ("a1", 1, b"\1" * 4),
        ("a1", 2, b"\2" * 4),
    ]
    assert frames[0].metadata.sample_rate == 24000
    assert frames[0].metadata.codec == "pcm16"
    assert frames[1].metadata.sample_rate is None  # the format goes on the first frame only
    assert frames[0].metadata.mime_type == "audio/pcm;rate=24000;channels=1"
    voice.on_event(SpokenTurnDone(), STAMP)
    (after,) = voice.on_event(AudioOut(data=b"z"), STAMP)
    assert (decode_frame(after).media_id, decode_frame(after).sequence) == ("a2", 0)


def test_binary_audio_over_one_mib_is_chunked_in_64_kib_frames() -> None:
    voice = live()
    voice.on_event(HELLO, STAMP)
    payload = bytes(range(256)) * (5 * 1024)  # 1.25 MiB
    frames = [decode_frame(item) for item in voice.on_event(AudioOut(data=payload), STAMP)]
    assert len(frames) == 20
    assert all(fr.chunked and fr.metadata.total_chunks == 20 for fr in frames)
    assert [fr.sequence for fr in frames] == list(range(20))
    assert b"".join(fr.payload for fr in frames) == payload
    assert {len(fr.payload) for fr in frames} == {64 * 1024}


def test_other_clients_get_base64_media_chunks() -> None:
    voice = live(wire(binary=False))
    voice.on_event(HELLO, STAMP)
    (chunk,) = as_json(voice.on_event(AudioOut(data=b"\x00\x01\x02", is_last=True), STAMP))
    assert chunk == {
        "type": "media_chunk",
        "media_chunk": {
            "media_id": "a1",
            "sequence": 0,
            "is_last": True,
            "data": base64.b64encode(b"\x00\x01\x02").decode(),
            "mime_type": "audio/pcm;rate=24000;channels=1",
        },
        "session_id": SID,
    }


def test_text_transcripts_barge_in_and_spoken_turns() -> None:
    voice = live()
    voice.on_event(HELLO, STAMP)
    out = []
    for event in (
        Transcript("hello"),
        AgentText("Hi "),
        AgentText("there"),
        SpokenTurnDone(),
        AgentText("Let me"),
        Interruption(),
        Transcript(""),  # nothing recognised: nothing to show
        SpokenTurnDone(content="said"),
    ):
        out += as_json(voice.on_event(event, STAMP))
    assert out == [
        {"type": "chunk", "content": "hello", "role": "user", "session_id": SID},
        {"type": "chunk", "content": "Hi ", "session_id": SID},
        {"type": "chunk", "content": "there", "session_id": SID},
        {"type": "done", "content": "Hi there", "session_id": SID},
        {"type": "chunk", "content": "Let me", "session_id": SID},
        {"type": "interrupt", "session_id": SID},
        {"type": "done", "content": "said", "session_id": SID},
    ]


def test_barge_in_starts_a_new_audio_item() -> None:
    voice = live()
    voice.on_event(HELLO, STAMP)
    voice.on_event(AudioOut(data=b"x"), STAMP)
    voice.on_event(Interruption(), STAMP)
    (item,) = voice.on_event(AudioOut(data=b"y"), STAMP)
    assert decode_frame(item).media_id == "a2"


def test_a_failure_is_one_duplex_error_and_nothing_follows() -> None:
    voice = live()
    voice.on_event(HELLO, STAMP)
    (error,) = as_json(voice.on_event(DuplexFailure("PROVIDER_UNAVAILABLE", "down"), STAMP))
    assert error["error"] == {
        "code": "DUPLEX_ERROR",
        "message": "down",
        "details": {"reason": "PROVIDER_UNAVAILABLE"},
    }
    assert voice.on_event(DuplexFailure("PROVIDER_UNAVAILABLE", "again"), STAMP) == []
    assert voice.on_event(AudioOut(data=b"x"), STAMP) == []
    voice.ended()  # the call's end does not clear the refusal
    assert voice.receive(frame(sequence=5), now=0.0) == ([], [])


def test_an_unsatisfiable_format_has_its_own_code_and_unknown_codes_are_hidden() -> None:
    voice = live()
    (error,) = as_json(voice.on_event(DuplexFailure("UNSATISFIABLE_FORMAT", "video"), STAMP))
    assert error["error"] == {"code": "UNSATISFIABLE_FORMAT", "message": "video"}
    voice = live()
    (error,) = as_json(voice.on_event(DuplexFailure("DB_DOWN", "password=x"), STAMP))
    assert error["error"] == {"code": "DUPLEX_ERROR", "message": "internal error"}


# -- rate limit --------------------------------------------------------------------------


def test_inbound_audio_is_rate_limited_per_call_with_one_error_per_run() -> None:
    voice = wire(bytes_per_second=100, burst_bytes=300)
    voice.receive(frame(b"x" * 100, metadata=FMT), now=0.0)
    assert voice.receive(frame(b"x" * 200), now=0.0)[1] == []  # the burst
    assert codes(voice.receive(frame(b"x" * 50), now=0.0)[1]) == [("RATE_LIMITED", AUDIO_RATE)]
    assert voice.receive(frame(b"x" * 50), now=0.0) == ([], [])  # the same run: silent
    events, errors = voice.receive(frame(b"x" * 50, sequence=9), now=1.0)  # refilled
    assert (events, errors) == ([CallAudio(AudioIn(b"x" * 50, 9))], [])
    assert codes(voice.receive(frame(b"x" * 200), now=1.0)[1]) == [("RATE_LIMITED", AUDIO_RATE)]


def test_the_connection_reports_an_audio_limit_hit() -> None:
    conn = connection(voice=VoiceLimits(bytes_per_second=10, burst_bytes=10))
    first = encode_frame(frame(b"x" * 10, metadata=FMT))
    assert isinstance(conn.receive_binary(first, now=0.0)[0], CallRequested)
    assert conn.receive_binary(encode_frame(frame(b"x" * 10)), now=0.0) == [LimitHit("audio_bytes")]


# -- chunked transfers -------------------------------------------------------------------


def chunk(n: int, total: int = 3, payload: bytes = b"ab", **kw: Any) -> BinaryFrame:
    meta = BinaryMetadata(total_chunks=total, sample_rate=16000 if n == 0 else None)
    return frame(payload, sequence=n, chunked=True, metadata=meta, **kw)


def test_a_chunked_transfer_is_reassembled_into_one_payload() -> None:
    voice = wire()
    assert voice.receive(chunk(0, payload=b"a"), now=0.0) == ([], [])
    assert voice.receive(chunk(1, payload=b"b"), now=0.0) == ([], [])
    (event,), errors = voice.receive(chunk(2, payload=b"c", is_last=True), now=0.0)
    assert errors == []
    assert isinstance(event, CallRequested)
    assert (event.audio.data, event.audio.is_last) == (b"abc", True)


def test_a_broken_chunked_transfer_is_refused_whole() -> None:
    cases = [
        [chunk(1)],  # not starting at 0
        [chunk(0), chunk(2)],  # a gap
        [chunk(0), chunk(1, media_id="other")],  # another transfer
        [chunk(0), frame(b"x")],  # an unchunked frame inside it
        [chunk(0), chunk(1, is_last=True)],  # IsLast before the last chunk
        [chunk(0, total=4), chunk(1, total=5)],  # a changed total
    ]
    expected = [CHUNK_START] + [CHUNK_ORDER] * 5
    for frames, message in zip(cases, expected, strict=True):
        voice = live()
        results = [voice.receive(fr, now=0.0) for fr in frames]
        assert codes(results[-1][1]) == [("INVALID_MESSAGE", message)], frames
        assert all(events == [] for events, _ in results[:-1])
        assert voice.receive(frame(b"ok", sequence=9), now=0.0)[0] == [CallAudio(AudioIn(b"ok", 9))]


def test_a_chunked_transfer_is_bounded_by_the_audio_burst() -> None:
    # Chunks slow enough for the rate limit still cannot assemble more than a burst.
    voice = wire(burst_bytes=5, bytes_per_second=1000)
    voice.receive(chunk(0, payload=b"abc"), now=0.0)
    assert codes(voice.receive(chunk(1, payload=b"abc"), now=1.0)[1]) == [
        ("INVALID_MESSAGE", CHUNK_TOO_LARGE)
    ]


# -- the connection ----------------------------------------------------------------------


def connection(**kw: Any) -> OmniaConnection:
    limits = ConnectionLimits(max_payload_size=2**24, ping_interval=30, pong_timeout=60)
    conn = OmniaConnection(session_id=SID, binary=True, limits=limits, now=0.0, wall=0.0, **kw)
    return conn


def sent(conn: OmniaConnection) -> list[bytes]:
    return conn.data_to_send()


def test_a_connection_to_an_agent_with_calls_takes_audio_and_hangup() -> None:
    conn = connection(voice=VoiceLimits())
    sent(conn)
    (event,) = conn.receive_binary(encode_frame(frame(metadata=FMT)), now=0.0)
    assert isinstance(event, CallRequested)
    assert conn.receive_text('{"type": "hangup"}', now=0.0) == [CallHungUp()]
    assert sent(conn) == []


def test_connected_says_resumed_only_when_asked_to_resume() -> None:
    for resumed, expected in ((None, None), (True, True), (False, False)):
        (first,) = sent(connection(voice=VoiceLimits(), resumed=resumed))
        assert json.loads(first)["connected"].get("resumed") == expected


def test_call_frames_are_queued_binary_and_audio_is_dropped_when_the_queue_is_full() -> None:
    limits = ConnectionLimits(
        max_payload_size=2**24, ping_interval=30, pong_timeout=60, max_send_queue_bytes=1000
    )
    conn = OmniaConnection(
        session_id=SID, binary=True, limits=limits, now=0.0, wall=0.0, voice=VoiceLimits()
    )
    conn.receive_binary(encode_frame(frame(metadata=FMT)), now=0.0)
    conn.send_duplex_event(HELLO, 0.0)
    for _ in range(10):
        conn.send_duplex_event(AudioOut(data=b"\0" * 300), 0.0)
    conn.send_duplex_event(SpokenTurnDone(), 0.0)  # text is never dropped
    out = sent(conn)
    assert not conn.overflowed
    kinds = ["binary" if isinstance(item, BinaryData) else json.loads(item)["type"] for item in out]
    assert kinds[:2] == ["connected", "session_config"]
    assert kinds[-1] == "done"
    assert 0 < kinds.count("binary") < 10
    assert conn.voice is not None
    assert conn.voice.audio_dropped == 10 - kinds.count("binary")


def test_a_resumed_connection_gets_the_format_again_and_its_audio() -> None:
    conn = connection(voice=VoiceLimits(), resumed=True)
    sent(conn)
    conn.call_resumed(HELLO.format, 0.0)
    conn.send_duplex_event(AudioOut(data=b"x"), 0.0)
    first, audio = sent(conn)
    assert json.loads(first)["type"] == "session_config"
    assert decode_frame(audio).payload == b"x"
    assert isinstance(conn.receive_binary(encode_frame(frame()), now=0.0)[0], CallAudio)


def test_a_call_reclaimed_before_its_counter_offer_gets_it_when_it_comes() -> None:
    conn = connection(voice=VoiceLimits(), resumed=True)
    sent(conn)
    conn.call_resumed(None, 0.0)
    assert sent(conn) == []
    assert isinstance(conn.receive_binary(encode_frame(frame()), now=0.0)[0], CallAudio)
    conn.send_duplex_event(HELLO, 0.0)
    assert [json.loads(item)["type"] for item in sent(conn)] == ["session_config"]
