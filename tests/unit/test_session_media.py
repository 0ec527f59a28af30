"""The server→client half of the `audio` capability, sans-I/O: format choice, media items,
and the lossy, bounded writing of binary frames."""

from __future__ import annotations

import json

import msgspec

from portico.core.events import TurnCompleted, TurnMediaChunk
from portico.protocols.omnia.binary import decode_frame
from portico.protocols.outbox import BinaryData
from portico.protocols.session import frames as f
from portico.protocols.session.channel import Channel
from portico.protocols.session.connection import Role, SessionConnection, State, Timing
from portico.protocols.session.media import MediaItems, choose_audio, item_format
from portico.protocols.session.voice import SpokenTurns
from portico.runtime.base import MediaChunk
from portico.runtime.duplex.base import AudioOut, DuplexFailure, Transcript
from portico.server.session_ledger import SessionLedger
from portico.server.session_ws import LiveSession
from portico.sessionstate.base import BufferLimits
from portico.sessionstate.memory import InProcessSessionStates

PCM = f.AudioFormat(codec="pcm16", sample_rate=24000, channels=1)


def chunk(
    index: int, *, last: bool = False, media_id: str = "r1", data: bytes = b"ab"
) -> MediaChunk:
    return MediaChunk(
        media_id=media_id, mime_type="audio/pcm", data=data, sequence=index, is_last=last
    )


# -- negotiation --------------------------------------------------------------------------------


def test_hello_and_ready_carry_typed_audio_formats() -> None:
    hello = f.client_frame_decoder.decode(
        json.dumps(
            {
                "type": "hello",
                "capabilities": ["audio"],
                "audio": {"input": [], "output": [{"codec": "pcm16", "sample_rate": 24000}]},
            }
        )
    )
    assert isinstance(hello, f.Hello)
    assert hello.audio == f.AudioOffer(output=(f.AudioFormat(codec="pcm16", sample_rate=24000),))
    encoded = json.loads(
        f.encode(
            f.Ready(
                session_id="s",
                resumed=False,
                last_seq=0,
                capabilities=("audio", "resume"),
                heartbeat_ms=1,
                resume_window_ms=1,
                audio=f.AudioChoice(output=PCM),
            )
        )
    )
    assert encoded["audio"] == {"input": None, "output": msgspec.to_builtins(PCM)}


def test_the_server_chooses_the_first_output_format_it_can_send() -> None:
    offer = f.AudioOffer(
        output=(f.AudioFormat(codec="speex"), PCM, f.AudioFormat(mime_type="audio/wav"))
    )
    assert choose_audio(offer) == f.AudioChoice(input=None, output=PCM)
    by_mime = f.AudioOffer(output=(f.AudioFormat(mime_type="audio/wav"),))
    assert choose_audio(by_mime) == f.AudioChoice(output=f.AudioFormat(mime_type="audio/wav"))


def test_no_sendable_format_or_no_offer_is_null() -> None:
    assert choose_audio(None) is None
    assert choose_audio(f.AudioOffer()) is None
    assert choose_audio(f.AudioOffer(output=(f.AudioFormat(codec="speex"),))) is None


def test_item_format_names_known_codecs() -> None:
    assert item_format("audio/wav") == f.AudioFormat(codec="wav", mime_type="audio/wav")
    assert item_format("image/png") == f.AudioFormat(mime_type="image/png")


# -- items ----------------------------------------------------------------------------------------


def test_an_item_is_start_binary_frames_and_end() -> None:
    items = MediaItems("s-1")
    start, item_id = items.start("t1", chunk(0))
    assert start == f.AudioStart(
        seq=0, turn_id="t1", item_id=item_id, format=item_format("audio/pcm")
    )
    first = decode_frame(items.frame("t1", chunk(0)))
    assert (first.media_id, first.sequence, first.is_last) == (item_id, 0, False)
    assert first.metadata.session_id == "s-1"
    assert first.metadata.mime_type == "audio/pcm"
    assert first.metadata.codec == "pcm16"
    assert items.finish("t1", chunk(0)) is None
    assert items.start("t1", chunk(1, last=True)) == (None, item_id)  # same item
    second = decode_frame(items.frame("t1", chunk(1, last=True)))
    assert (second.sequence, second.is_last, second.payload) == (1, True, b"ab")
    assert second.metadata == type(second.metadata)()  # metadata on the first frame only
    assert items.finish("t1", chunk(1, last=True)) == f.AudioEnd(
        seq=0, turn_id="t1", item_id=item_id
    )
    assert items.end_all() == []


def test_a_dropped_frame_marks_the_item_lost() -> None:
    items = MediaItems("s-1")
    items.start("t1", chunk(0))
    items.frame("t1", chunk(0))
    items.dropped("t1", chunk(0))
    items.start("t1", chunk(1, last=True))
    items.frame("t1", chunk(1, last=True))
    end = items.finish("t1", chunk(1, last=True))
    assert end is not None
    assert end.lost


def test_a_connection_change_ends_open_items_and_the_rest_starts_a_new_item() -> None:
    items = MediaItems("s-1")
    _, old = items.start("t1", chunk(0))
    items.frame("t1", chunk(0))
    assert items.end_all() == [f.AudioEnd(seq=0, turn_id="t1", item_id=old, lost=True)]
    start, new = items.start("t1", chunk(1))
    assert start is not None
    assert new != old
    assert decode_frame(items.frame("t1", chunk(1))).sequence == 0  # a fresh item


def test_a_copy_built_after_a_move_never_repeats_an_earlier_copys_item_id() -> None:
    # The first copy numbers an audio_start (seq 1) and a chunk (seq 2) per item; the
    # session then moves to another replica, whose copy starts at next_seq 5.
    first = MediaItems("s-1")
    earlier = [first.start("t1", chunk(0, media_id=f"a{n}"))[1] for n in range(2)]
    moved = MediaItems("s-1", numbered=4)
    later = [moved.start("t1", chunk(0, media_id=f"a{n}"))[1] for n in range(2)]
    assert set(earlier).isdisjoint(later)
    assert all(len(item_id.encode()) <= 12 for item_id in later)  # the OMNI MediaID


def test_a_finished_turn_ends_only_its_own_items() -> None:
    items = MediaItems("s-1")
    _, a = items.start("t1", chunk(0))
    items.start("t2", chunk(0))
    assert [e.item_id for e in items.end_all("t1")] == [a]
    assert len(items.end_all()) == 1


# -- binary frames on the connection --------------------------------------------------------------


def open_server(max_queue: int) -> SessionConnection:
    conn = SessionConnection(
        role=Role.SERVER, timing=Timing(max_send_queue_bytes=max_queue), now=0.0
    )
    conn.receive_text(f.encode(f.Hello()), 0.0)
    ready = f.Ready(
        session_id="s",
        resumed=False,
        last_seq=0,
        capabilities=("resume",),
        heartbeat_ms=1,
        resume_window_ms=1,
    )
    conn.accept(Channel(max_messages=100, max_bytes=10_000), ready, 0)
    conn.data_to_send()
    return conn


def test_binary_frames_are_marked_binary_and_never_numbered() -> None:
    conn = open_server(1000)
    assert conn.write_binary(b"x" * 10)
    (data,) = conn.data_to_send()
    assert isinstance(data, BinaryData)
    assert conn.channel is not None
    assert conn.channel.buffered == (0, 0)


def test_binary_frames_are_dropped_past_half_the_queue_without_closing() -> None:
    conn = open_server(1000)
    assert conn.write_binary(b"x" * 400)
    assert not conn.write_binary(b"x" * 200)  # 600 > 500: dropped, lossy
    assert conn.close_request is None
    assert not conn.overflowed
    conn.send(f.Chunk(seq=0, turn_id="t", content="still room for control messages"))
    assert conn.close_request is None
    assert len(conn.data_to_send()) == 2


def test_no_binary_frames_before_the_handshake_or_after_a_close() -> None:
    conn = SessionConnection(role=Role.SERVER, timing=Timing(), now=0.0)
    assert not conn.write_binary(b"x")
    conn = open_server(1000)
    conn.close(1000, "bye")
    assert conn.state is State.CLOSED
    assert not conn.write_binary(b"x")


# -- the session: items across connection changes -------------------------------------------------


class _Socket:
    """Stands in for `SessionSocket`: records what the session writes."""

    def __init__(self, *, room: bool = True) -> None:
        self.text: list[dict[str, object]] = []
        self.binary: list[bytes] = []
        self.room = room

    def write(self, data: bytes) -> None:
        self.text.append(json.loads(data))

    def write_binary(self, data: bytes) -> bool:
        if self.room:
            self.binary.append(data)
        return self.room

    def replaced(self) -> None:
        return None

    def turn_ended(self) -> None:
        return None


async def live_session(capabilities: tuple[str, ...] = ("audio", "resume")) -> LiveSession:
    """A session on the in-process session-state port (which records in the same step)."""
    states = InProcessSessionStates(BufferLimits(max_messages=100, max_bytes=1_000_000))
    epoch = await states.create("s-1", capabilities=b"")
    return LiveSession(
        session_id="s-1",
        owner="alice",
        agent="default",
        capabilities=capabilities,
        tools=(),
        context={},
        channel=Channel(max_messages=100, max_bytes=1_000_000),
        ledger=SessionLedger(states, "s-1", epoch),
        sessions={},
    )


def media(index: int, *, last: bool = False) -> TurnMediaChunk:
    return TurnMediaChunk("s-1", "t1", chunk(index, last=last))


async def test_a_drop_mid_item_ends_it_lost_and_the_rest_is_a_new_item() -> None:
    live = await live_session()
    first = _Socket()
    live.attach(first)  # type: ignore[arg-type]
    live.on_turn_event(media(0))
    assert [frame["type"] for frame in first.text] == ["audio_start"]
    assert len(first.binary) == 1
    live.detach(first, window=30)  # type: ignore[arg-type]
    live.on_turn_event(media(1))  # while away: a new item, its frames lost
    second = _Socket()
    live.attach(second)  # type: ignore[arg-type]
    live.on_turn_event(media(2, last=True))  # after the resume: another new item
    live.on_turn_event(TurnCompleted("s-1", "t1", content=""))
    # The in-process port holds the resend buffer (the channel keeps no copy of it).
    backlog = [json.loads(data) for _, data in live.ledger.backlog()]
    live.end()
    summary = [(m["type"], m.get("item_id"), m.get("lost", False)) for m in backlog]
    assert summary == [
        ("audio_start", "m1", False),
        ("audio_end", "m1", True),  # the drop
        ("audio_start", "m2", False),
        ("audio_end", "m2", True),  # the resume: its frames went nowhere
        ("audio_start", "m3", False),
        ("audio_end", "m3", False),
        ("done", None, False),
    ]
    (fresh,) = [decode_frame(data) for data in second.binary]
    assert (fresh.media_id, fresh.sequence, fresh.is_last) == ("m3", 0, True)
    assert fresh.metadata.mime_type == "audio/pcm"


async def test_a_full_queue_drops_frames_and_ends_the_item_lost() -> None:
    live = await live_session()
    socket = _Socket(room=False)
    live.attach(socket)  # type: ignore[arg-type]
    live.on_turn_event(media(0, last=True))
    assert [(m["type"], m.get("lost")) for m in socket.text] == [
        ("audio_start", None),
        ("audio_end", True),
    ]


async def test_a_cancelled_turn_ends_its_open_items_before_done() -> None:
    live = await live_session()
    socket = _Socket()
    live.attach(socket)  # type: ignore[arg-type]
    live.on_turn_event(media(0))
    live.on_turn_event(TurnCompleted("s-1", "t1", content="", cancelled=True))
    assert [(m["type"], m.get("lost")) for m in socket.text] == [
        ("audio_start", None),
        ("audio_end", True),
        ("done", None),
    ]


async def test_without_the_capability_media_are_dropped() -> None:
    live = await live_session(("resume",))
    socket = _Socket()
    live.attach(socket)  # type: ignore[arg-type]
    live.on_turn_event(media(0, last=True))
    assert socket.text == []
    assert socket.binary == []


async def test_a_spoken_turn_failing_ends_its_items_lost_then_its_error() -> None:
    live = await live_session()
    socket = _Socket()
    live.attach(socket)  # type: ignore[arg-type]
    spoken = SpokenTurns("s-1", transcripts=True, new_turn_id=lambda: "vturn-1")
    for event in (Transcript("hi"), AudioOut(data=b"ab"), DuplexFailure("X", "y")):
        for out in spoken.on_event(event):
            live.voice_out(out)
    assert [(m["type"], m.get("turn_id"), m.get("lost")) for m in socket.text] == [
        ("transcript", None, None),
        ("audio_start", "vturn-1", None),
        ("audio_end", "vturn-1", True),
        ("error", "vturn-1", None),
    ]


async def test_spoken_turns_are_not_recorded_as_ended_archived_turns() -> None:
    live = await live_session()
    live.on_turn_event(TurnCompleted("s-1", "vturn-1", content="spoken"))
    live.on_turn_event(TurnCompleted("s-1", "turn-1", content="typed"))
    snapshot = await live.ledger.states.load("s-1")
    assert snapshot is not None
    assert snapshot.ended_turns == ("turn-1",)
