"""Voice on `/v1/session` (spec/realtime-audio.md, "On `/v1/session`"), end to end on a
real `portico serve` with the scripted duplex runtime: the `audio` capability with an
input format, client audio items in binary frames, transcripts, the agent's spoken
turns as audio items and `done`, the client's `interrupt`, a drop mid-call and a
resume (numbered messages exactly once, audio in flight lost), every bad input, the
limits, and the SDK sending audio."""

from __future__ import annotations

import asyncio
import itertools
import os
import struct
import subprocess
import sys
import wave
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from portico.client import SessionClient
from portico.domain.states import TurnState
from portico.protocols.omnia.binary import (
    BinaryFrame,
    BinaryMetadata,
    decode_frame,
    encode_frame,
)
from portico.protocols.session import frames as f
from portico.protocols.session.voice import ITEM_FORMAT, ITEM_OPEN, UNKNOWN_ITEM
from portico.server.session_ws import NO_AUDIO_INPUT
from support.archive import open_archive, wait_for_messages
from support.server import SCRIPT, ServerProcess
from support.session import SessionProbe, check_frame
from support.voicecall import agent

USERS = 60
WINDOW = 30.0  # resume window, seconds: the resume tests reconnect long before it
SHORT_WINDOW = 0.5  # seconds: a session nobody resumes
WAIT = 10.0  # seconds; a deadline, never a threshold
LOUD = struct.pack("<320h", *([9000] * 320))  # 20 ms of 16 kHz mono pcm16, loud
QUIET = bytes(640)
PCM16K = {"codec": "pcm16", "sample_rate": 16000, "channels": 1}
AUDIO = {"input": [PCM16K], "output": [{"codec": "pcm16"}]}
REPLY = "Hi, how can I help?"
STORY = "Once upon a time"

_users = itertools.count()


def start_server(data_dir: Path, window: float) -> ServerProcess:
    config = data_dir / "portico.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "auth": "apikey",
                "api_keys": {f"voice-{n}": f"speaker-{n}" for n in range(USERS)},
                "runtime": "scripted",
                "script": str(SCRIPT),
                "agents": {
                    "default": agent("voice.yaml"),
                    "long": agent("voice_long.yaml"),
                    "failing": agent("voice_fail.yaml"),
                    "text": {"runtime": "scripted", "script": str(SCRIPT)},
                },
                "resume_window": window,
                "max_audio_sessions_per_principal": 1,
                "max_audio_bytes_per_second": 2000,
                "audio_burst_bytes": 64_000,
            }
        )
    )
    return ServerProcess(data_dir, args=("--config", str(config))).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server(tmp_path_factory.mktemp("session-voice"), WINDOW)
    yield process
    process.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def token() -> str:
    return f"voice-{next(_users)}"


class Speaker:
    """A frame-level `/v1/session` client that speaks, and resumes."""

    def __init__(self, http: aiohttp.ClientSession, server: ServerProcess, credential: str):
        self.http = http
        self.url = server.http_url + "/v1/session"
        self.credential = credential
        self.probe: SessionProbe | None = None
        self.session_id = ""
        self.sequence = 0

    @property
    def p(self) -> SessionProbe:
        assert self.probe is not None
        return self.probe

    async def open(self, **hello: Any) -> dict[str, Any]:
        self.probe = await SessionProbe.connect(self.http, self.url)
        fields = {"capabilities": ["audio", "transcripts"], "audio": AUDIO, **hello}
        ready = await self.probe.hello(credential=self.credential, **fields)
        if ready["type"] == "ready":
            self.session_id = ready["session_id"]
        return ready

    async def resume(self) -> dict[str, Any]:
        old = self.p
        probe = await SessionProbe.connect(self.http, self.url)
        probe.handled, probe.next_seq, probe.received = old.handled, old.next_seq, old.received
        self.probe = probe
        return await probe.hello(
            credential=self.credential, session_id=self.session_id, last_seq=old.handled
        )

    def drop(self) -> None:
        """Drop the connection abruptly, as a network failure would."""
        connection = self.p.ws._response.connection  # type: ignore[attr-defined]
        assert connection is not None
        assert connection.transport is not None
        connection.transport.abort()

    async def speak(
        self, item: str, *payloads: bytes, first: bool = True, last: bool = False
    ) -> None:
        """Frames of audio item `item` (Sequence from 0 when `first`)."""
        if first:
            self.sequence = 0
        for index, payload in enumerate(payloads):
            meta = BinaryMetadata(**PCM16K) if self.sequence == 0 else BinaryMetadata()
            frame = BinaryFrame(
                media_id=item,
                sequence=self.sequence,
                metadata=meta,
                payload=payload,
                is_last=last and index == len(payloads) - 1,
            )
            self.sequence += 1
            await self.p.ws.send_bytes(encode_frame(frame))

    async def until(
        self, done: Callable[[dict[str, Any]], bool], within: float = WAIT
    ) -> list[dict[str, Any]]:
        """Numbered frames up to and including the first for which `done` holds."""
        seen: list[dict[str, Any]] = []
        async with asyncio.timeout(within):
            while not seen or not done(seen[-1]):
                seen.append(await self.p.recv_numbered())
        return seen

    async def binary_of(self, item_id: str) -> list[BinaryFrame]:
        """Read (text frames too) until a binary frame of `item_id` arrived; its frames."""
        async with asyncio.timeout(WAIT):
            while not (got := [b for b in self.p.binary if b.media_id == item_id]):
                msg = await self.p.ws.receive()
                if msg.type is aiohttp.WSMsgType.BINARY:
                    self.p.binary.append(decode_frame(msg.data))
                elif msg.type is aiohttp.WSMsgType.TEXT:
                    frame = check_frame(msg.data)
                    self.p.received.append(frame)
                    if frame["type"] not in ("ack", "pong", "ping", "ready"):
                        self.p.handled = max(self.p.handled, frame["seq"])
                else:
                    raise AssertionError(f"the socket ended: {msg.type!r}")
        return got

    async def flush(self) -> list[dict[str, Any]]:
        """Numbered frames until the server answered a ping (what it said before it)."""
        await self.p.send({"type": "ping"})
        seen = []
        while (frame := await self.p.recv())["type"] != "pong":
            if frame["type"] not in ("ack", "ping"):
                seen.append(frame)
        return seen


def of(kind: str) -> Callable[[dict[str, Any]], bool]:
    return lambda frame: frame["type"] == kind


def types(frames: list[dict[str, Any]]) -> list[str]:
    return [frame["type"] for frame in frames]


@pytest.fixture
def speaker(http: aiohttp.ClientSession, server: ServerProcess) -> Speaker:
    return Speaker(http, server, token())


# -- negotiation --------------------------------------------------------------------------------


async def test_ready_chooses_an_input_and_an_output_format(speaker: Speaker) -> None:
    offer = {"input": [{"codec": "opus", "sample_rate": 48000}, PCM16K], "output": [PCM16K]}
    ready = await speaker.open(audio=offer)
    assert ready["audio"] == {"input": PCM16K, "output": PCM16K}
    assert ready["capabilities"] == ["audio", "resume", "transcripts"]


async def test_an_agent_without_a_voice_runtime_chooses_no_input(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    speaker = Speaker(http, server, token())
    ready = await speaker.open(agent="text")
    assert ready["audio"] == {"input": None, "output": {"codec": "pcm16"}}
    await speaker.speak("c1", LOUD)  # a session that hears nothing: a client bug
    error = await speaker.p.recv()
    assert error["error"] == {"code": "PROTOCOL_ERROR", "message": NO_AUDIO_INPUT}
    assert (await speaker.p.closed())[0] == 4400


async def test_binary_frames_without_the_audio_capability_close_4400(speaker: Speaker) -> None:
    ready = await speaker.open(capabilities=["tools"])
    assert "audio" not in ready
    await speaker.speak("c1", LOUD)
    assert (await speaker.p.recv())["error"]["code"] == "PROTOCOL_ERROR"
    assert (await speaker.p.closed())[0] == 4400


# -- a spoken exchange --------------------------------------------------------------------------


async def test_audio_in_gives_a_transcript_a_spoken_reply_and_done(
    speaker: Speaker, server: ServerProcess
) -> None:
    await speaker.open()
    await speaker.speak("c1", LOUD, LOUD, LOUD)  # voice.yaml: three loud frames
    frames = await speaker.until(of("done"))
    assert types(frames) == ["transcript", "chunk", "audio_start", "audio_end", "done"]
    transcript, chunk, start, end, done = frames
    assert transcript == {"type": "transcript", "seq": 1, "role": "user", "text": "hello there"}
    turn = chunk["turn_id"]
    assert turn.startswith("vturn-")
    assert chunk["content"] == REPLY
    assert start["turn_id"] == end["turn_id"] == done["turn_id"] == turn
    assert start["format"]["codec"] == "pcm16"
    assert "rate=16000" in start["format"]["mime_type"]
    assert "lost" not in end
    assert done == {"type": "done", "seq": 5, "turn_id": turn, "content": REPLY}
    # The speech: 100 ms of tone in 20 ms frames, then an empty frame marked last.
    speech = [b for b in speaker.p.binary if b.media_id == start["item_id"]]
    assert [b.sequence for b in speech] == list(range(6))
    assert [b.is_last for b in speech] == [False] * 5 + [True]
    assert speech[-1].payload == b""
    assert all(len(b.payload) == 640 for b in speech[:-1])
    assert speaker.p.numbered_seqs() == [1, 2, 3, 4, 5]
    # Archived as a text turn, as on /ws.
    messages = await wait_for_messages(server.archive_path, speaker.session_id, 2)
    assert [(m.role, m.content, m.metadata) for m in messages] == [
        ("user", "hello there", {"source": "voice"}),
        ("assistant", REPLY, {"source": "voice"}),
    ]
    async with open_archive(server.archive_path) as store:
        turns = await store.list_turns(speaker.session_id)
    assert [t.state for t in turns] == [TurnState.COMPLETED]


async def test_without_transcripts_no_transcript_is_sent(speaker: Speaker) -> None:
    await speaker.open(capabilities=["audio"])
    await speaker.speak("c1", LOUD, LOUD, LOUD, last=True)
    frames = await speaker.until(of("done"))
    assert types(frames) == ["chunk", "audio_start", "audio_end", "done"]


async def test_a_second_item_goes_to_the_same_call(speaker: Speaker) -> None:
    await speaker.open()
    await speaker.speak("c1", LOUD, LOUD, LOUD, last=True)
    first = await speaker.until(of("done"))
    await speaker.speak("c2", LOUD, LOUD, LOUD, last=True)  # the script's turn repeats
    second = await speaker.until(of("done"))
    assert first[-1]["turn_id"] != second[-1]["turn_id"]
    assert types(second) == ["transcript", "chunk", "audio_start", "audio_end", "done"]


async def test_text_messages_keep_working_during_a_call(speaker: Speaker) -> None:
    await speaker.open()
    await speaker.speak("c1", LOUD, LOUD, LOUD)
    await speaker.until(of("done"))
    await speaker.p.message("hi")
    frames = await speaker.p.turn()
    assert frames[-1]["type"] == "done"
    assert not frames[-1]["turn_id"].startswith("vturn-")


# -- barge-in -----------------------------------------------------------------------------------


async def test_the_clients_interrupt_cuts_the_agents_speech(
    speaker: Speaker, server: ServerProcess
) -> None:
    await speaker.open(agent="long")
    await speaker.speak("c1", LOUD, LOUD, LOUD, last=True)
    start = (await speaker.until(of("audio_start")))[-1]
    interrupt_seq = await speaker.p.numbered("interrupt")
    frames = await speaker.until(of("done"))
    end, done = frames[-2:]
    assert end == {
        "type": "audio_end",
        "seq": end["seq"],
        "turn_id": start["turn_id"],
        "item_id": start["item_id"],
        "lost": True,  # the client drops what it buffered
    }
    assert done == {
        "type": "done",
        "seq": done["seq"],
        "turn_id": start["turn_id"],
        "content": STORY,
        "cancelled": True,
    }
    # The rest of that speech never comes; the interrupt was acknowledged.
    assert await speaker.flush() == []
    assert interrupt_seq == 1
    messages = await wait_for_messages(server.archive_path, speaker.session_id, 2)
    assert [(m.role, m.content) for m in messages] == [
        ("user", "tell me a story"),
        ("assistant", STORY),
    ]
    async with open_archive(server.archive_path) as store:  # written with its messages
        turns = await store.list_turns(speaker.session_id)
    assert [t.state for t in turns] == [TurnState.CANCELLED]
    # The runtime, never told, speaks on: nothing of it reaches the client. The
    # caller's next utterance (its first loud frame the runtime's own barge-in) is
    # answered as a new turn, with nothing in between.
    await speaker.speak("c2", LOUD, LOUD, LOUD, LOUD, last=True)
    transcript, *turn = await speaker.until(of("done"))
    assert transcript["type"] == "transcript"
    assert turn[0]["type"] == "chunk"
    assert {frame["turn_id"] for frame in turn} == {turn[0]["turn_id"]} != {start["turn_id"]}


async def test_talking_over_the_agent_is_a_barge_in_too(speaker: Speaker) -> None:
    await speaker.open(agent="long")
    await speaker.speak("c1", LOUD, LOUD, LOUD)
    await speaker.until(of("audio_start"))
    await speaker.speak("c1", LOUD, first=False)  # the runtime hears the caller speak
    done = (await speaker.until(of("done")))[-1]
    assert done["cancelled"] is True
    assert done["content"] == STORY


# -- drops and resumes --------------------------------------------------------------------------


async def test_a_drop_mid_call_loses_audio_in_flight_and_keeps_messages_exactly_once(
    speaker: Speaker, server: ServerProcess
) -> None:
    await speaker.open(agent="long")
    await speaker.speak("c1", LOUD, LOUD, LOUD)  # the item stays open: in flight
    first = (await speaker.until(of("audio_start")))[-1]
    await speaker.binary_of(first["item_id"])
    speaker.drop()
    ready = await speaker.resume()
    assert ready["type"] == "ready"
    assert ready["resumed"] is True
    # The call went on: the open items ended lost, the speech goes on in a new item.
    frames = await speaker.until(
        lambda frame: frame["type"] == "audio_start" and frame["item_id"] != first["item_id"]
    )
    fresh = frames[-1]
    assert fresh["turn_id"] == first["turn_id"]
    ends = [frame for frame in speaker.p.received if frame["type"] == "audio_end"]
    assert ends
    assert all(end["lost"] for end in ends)
    new_frames = await speaker.binary_of(fresh["item_id"])
    assert new_frames[0].sequence == 0
    assert new_frames[0].metadata.mime_type is not None
    # The client's item in flight is gone: its next frame names an unknown item.
    await speaker.speak("c1", QUIET, first=False)
    errors = [frame for frame in await speaker.flush() if frame["type"] == "error"]
    assert [e["error"]["message"] for e in errors] == [UNKNOWN_ITEM]
    await speaker.speak("c2", QUIET)  # the next audio starts a new item
    assert [frame for frame in await speaker.flush() if frame["type"] == "error"] == []
    await speaker.p.numbered("interrupt")
    done = (await speaker.until(of("done")))[-1]
    assert done["cancelled"] is True
    # Every numbered message exactly once, in order, across the drop.
    received = speaker.p.received
    assert speaker.p.numbered_seqs() == list(range(1, len(speaker.p.numbered_seqs()) + 1))
    assert sum(frame["type"] == "transcript" for frame in received) == 1
    assert sum(frame["type"] == "done" for frame in received) == 1
    starts = [frame["item_id"] for frame in received if frame["type"] == "audio_start"]
    assert starts == [frame["item_id"] for frame in received if frame["type"] == "audio_end"]


async def test_end_hangs_the_call_up_and_archives_its_turn(
    speaker: Speaker, server: ServerProcess
) -> None:
    await speaker.open(agent="long")
    await speaker.speak("c1", LOUD, LOUD, LOUD)
    await speaker.until(of("audio_start"))
    await speaker.p.numbered("end")
    assert (await speaker.p.closed())[0] == 1000
    messages = await wait_for_messages(server.archive_path, speaker.session_id, 2)
    assert [(m.role, m.content) for m in messages] == [
        ("user", "tell me a story"),
        ("assistant", STORY),
    ]
    # The call's slot is free again: the same principal can call once more.
    again = Speaker(speaker.http, server, speaker.credential)
    await again.open()
    await again.speak("c1", LOUD, LOUD, LOUD)
    assert (await again.until(of("done")))[-1]["content"] == REPLY


async def test_a_session_past_its_window_hangs_its_call_up(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    own = start_server(tmp_path, SHORT_WINDOW)
    try:
        credential = token()
        speaker = Speaker(http, own, credential)
        await speaker.open(agent="long")
        await speaker.speak("c1", LOUD, LOUD, LOUD)
        await speaker.until(of("audio_start"))
        speaker.drop()  # and never resumed
        messages = await wait_for_messages(own.archive_path, speaker.session_id, 2)
        assert [(m.role, m.content) for m in messages] == [
            ("user", "tell me a story"),
            ("assistant", STORY),
        ]
        async with open_archive(own.archive_path) as store:
            turns = await store.list_turns(speaker.session_id)
        assert [t.state for t in turns] == [TurnState.CANCELLED]  # the call ended mid-turn
        assert (await speaker.resume())["error"]["code"] == "RESUME_FAILED"
        # Its slot is free: the principal (one call at most) calls again.
        again = Speaker(http, own, credential)
        await again.open(agent="long")
        await again.speak("c1", LOUD, LOUD, LOUD)
        assert (await again.until(of("audio_start")))[0]["type"] == "transcript"
    finally:
        own.stop()


# -- bad inputs and limits ----------------------------------------------------------------------


async def test_every_bad_frame_is_one_error_and_changes_nothing(speaker: Speaker) -> None:
    await speaker.open()
    await speaker.p.ws.send_bytes(b"OMNI" + bytes(8))  # a malformed header
    stray = BinaryFrame(media_id="zz", sequence=1, payload=LOUD)
    await speaker.p.ws.send_bytes(encode_frame(stray))  # a frame for an unknown item
    wrong = BinaryFrame(
        media_id="c9", sequence=0, metadata=BinaryMetadata(codec="pcm16", sample_rate=44100)
    )
    await speaker.p.ws.send_bytes(encode_frame(wrong))  # a format ready did not choose
    await speaker.speak("c1", LOUD)
    await speaker.speak("c2", LOUD)  # a second item while c1 is open
    errors = await speaker.flush()
    assert [(e["error"]["code"], e["error"]["message"]) for e in errors] == [
        ("INVALID_MESSAGE", "invalid header size"),
        ("INVALID_MESSAGE", UNKNOWN_ITEM),
        ("UNSATISFIABLE_FORMAT", ITEM_FORMAT),
        ("INVALID_MESSAGE", ITEM_OPEN),
    ]
    assert all("ref_seq" not in e and "turn_id" not in e for e in errors)
    assert errors[1]["error"]["details"] == {"item_id": "zz"}
    # Nothing changed: c1 goes on where it was and the call answers as usual.
    await speaker.speak("c1", LOUD, LOUD, first=False)
    frames = await speaker.until(of("done"))
    assert types(frames) == ["transcript", "chunk", "audio_start", "audio_end", "done"]
    assert speaker.p.numbered_seqs() == list(range(1, 10))


async def test_a_failed_call_is_one_duplex_error_and_the_next_item_calls_again(
    speaker: Speaker,
) -> None:
    await speaker.open(agent="failing")
    await speaker.speak("c1", LOUD, LOUD)
    (error,) = await speaker.until(of("error"))
    assert error["error"] == {
        "code": "DUPLEX_ERROR",
        "message": "the voice model is unavailable",
        "details": {"reason": "PROVIDER_UNAVAILABLE"},
    }
    await speaker.speak("c1", LOUD, LOUD, LOUD, first=False, last=True)
    assert [e for e in await speaker.flush() if e["type"] == "error"] == []  # its call is over
    await speaker.speak("c2", LOUD, LOUD)
    assert (await speaker.until(of("error")))[-1]["error"]["code"] == "DUPLEX_ERROR"


async def test_calls_past_the_principal_limit_are_rate_limited(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    credential = token()
    first, second = Speaker(http, server, credential), Speaker(http, server, credential)
    await first.open()
    await first.speak("c1", LOUD)
    await first.flush()  # the call started
    await second.open()
    await second.speak("c1", LOUD)
    (error,) = await second.until(of("error"))
    assert error["error"]["code"] == "RATE_LIMITED"
    await second.speak("c1", LOUD, LOUD, LOUD, first=False)  # the refused item: dropped
    assert await second.flush() == []


async def test_audio_over_the_byte_rate_is_dropped_with_one_error(speaker: Speaker) -> None:
    await speaker.open()
    await speaker.speak("c1", *([QUIET] * 120))  # 76,800 bytes at once: past the burst
    errors = [e for e in await speaker.flush() if e["type"] == "error"]
    assert [(e["error"]["code"], e["error"]["details"]) for e in errors] == [
        ("RATE_LIMITED", {"item_id": "c1"})
    ]


# -- the SDK ------------------------------------------------------------------------------------


async def test_the_sdk_sends_audio_and_gets_transcripts_and_the_spoken_reply(
    server: ServerProcess,
) -> None:
    client = SessionClient(
        server.http_url + "/v1/session",
        credential=token(),
        audio_input=[f.AudioFormat(codec="pcm16", sample_rate=16000, channels=1)],
        audio_output=[f.AudioFormat(codec="pcm16")],
        transcripts=True,
    )
    async with client:
        assert client.audio_input == f.AudioFormat(codec="pcm16", sample_rate=16000, channels=1)
        for _ in range(3):
            assert await client.send_audio(LOUD)
        await client.end_audio()
        reply = await client.voice_reply(within=WAIT)
        assert reply.heard == "hello there"
        assert reply.text == REPLY
        assert not reply.cancelled
        (item,) = reply.audio
        assert item.complete
        assert len(item.data) == 5 * 640


async def test_the_sdk_barges_in(server: ServerProcess) -> None:
    client = SessionClient(
        server.http_url + "/v1/session",
        credential=token(),
        agent="long",
        audio_input=[f.AudioFormat(codec="pcm16", sample_rate=16000, channels=1)],
        audio_output=[f.AudioFormat(codec="pcm16")],
    )
    async with client:
        for _ in range(3):
            await client.send_audio(LOUD)
        async with asyncio.timeout(WAIT):
            async for frame in client:
                if isinstance(frame, f.AudioStart):
                    break
        await client.interrupt()
        reply = await client.voice_reply(within=WAIT)
        assert reply.cancelled
        assert reply.text == STORY
        (item,) = reply.audio
        assert not item.complete  # ended `lost`: the client drops it


async def test_the_sdk_starts_a_new_item_after_a_reconnect(server: ServerProcess) -> None:
    opened = asyncio.Event()
    client = SessionClient(
        server.http_url + "/v1/session",
        credential=token(),
        audio_input=[f.AudioFormat(codec="pcm16", sample_rate=16000, channels=1)],
        transcripts=True,
        on_status=lambda status: opened.set() if status.resumed else None,
    )
    async with client:
        assert await client.send_audio(QUIET)  # item c1, left open
        await client.ask("hi")  # answered: the server has read the frame before it
        client.abort_connection()
        async with asyncio.timeout(WAIT):
            await opened.wait()
        for _ in range(3):  # a new item: the server does not see a frame of a lost one
            assert await client.send_audio(LOUD)
        reply = await client.voice_reply(within=WAIT)
        assert [type(frame).__name__ for frame in reply.frames] == [
            "Transcript",
            "Chunk",
            "AudioStart",
            "AudioEnd",
            "Done",
        ]  # and no error: nothing of the lost item reached the server after the drop
        assert reply.heard == "hello there"


async def test_the_sdk_refuses_audio_the_server_does_not_hear(server: ServerProcess) -> None:
    client = SessionClient(
        server.http_url + "/v1/session",
        credential=token(),
        agent="text",
        audio_input=[f.AudioFormat(codec="pcm16", sample_rate=16000)],
    )
    async with client:
        assert client.audio_input is None
        with pytest.raises(Exception, match="hears no audio"):
            await client.send_audio(LOUD)


# -- portico chat -------------------------------------------------------------------------------


def test_portico_chat_says_a_wav_file_and_prints_the_voice_reply(
    server: ServerProcess, tmp_path: Path
) -> None:
    speech = tmp_path / "hello.wav"
    with wave.open(str(speech), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(16000)
        wav.writeframes(LOUD * 3)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "portico",
            "chat",
            "--url",
            server.ws_url.replace("/ws", "/v1/session"),
            "--credential",
            token(),
        ],
        input=f"/say {speech}\n/say {tmp_path / 'missing.wav'}\n",
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("PORTICO_")},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == ["[heard] hello there", REPLY, "[audio: 0.1 s]"]
    assert lines[3].startswith("[voice] ")
    assert "missing.wav" in lines[3]
