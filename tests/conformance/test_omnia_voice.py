"""Voice calls on `/ws` (spec/realtime-audio.md), end to end on a real server process
with the scripted duplex runtime: binary and base64 clients, barge-in, hangup, IsLast,
an unsatisfiable format, a failed call, the limits, parking and `?resume`, and the
archive keeping the call's turns as text."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import msgspec
import pytest

from portico.protocols.omnia.binary import BinaryFrame, BinaryMetadata, encode_frame
from portico.protocols.omnia.voice import AUDIO_AFTER_LAST
from support.archive import open_archive, wait_for_messages
from support.server import ServerProcess
from support.voicecall import (
    FORMAT,
    LOUD,
    QUIET,
    WAIT,
    Dial,
    is_type,
    kinds,
    metric,
    texts,
    write_voice_config,
)

RATE = 100  # bytes per second of caller audio: the burst is what a test sends at once
BURST = 64_000
GRACE = 30.0  # seconds: the resume tests reconnect long before it
SHORT_GRACE = 0.3
REPLY = "Hi, how can I help?"


def start_voice_server(
    tmp_path_factory: pytest.TempPathFactory, name: str, **settings: Any
) -> ServerProcess:
    data_dir = tmp_path_factory.mktemp(name)
    config = write_voice_config(
        data_dir,
        max_audio_sessions_per_principal=2,
        max_audio_bytes_per_second=RATE,
        audio_burst_bytes=BURST,
        **settings,
    )
    return ServerProcess(data_dir, args=("--config", str(config))).start()


@pytest.fixture(scope="module")
def voice_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_voice_server(tmp_path_factory, "voice", realtime_grace_window=GRACE)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def short_grace_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_voice_server(tmp_path_factory, "voice-short", realtime_grace_window=SHORT_GRACE)
    yield process
    process.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def dial(http: aiohttp.ClientSession, voice_server: ServerProcess) -> Dial:
    return Dial(http, voice_server)


@pytest.fixture
def dial_short(http: aiohttp.ClientSession, short_grace_server: ServerProcess) -> Dial:
    return Dial(http, short_grace_server)


# -- a call end to end -------------------------------------------------------------------


async def test_a_call_end_to_end_on_a_binary_client(
    dial: Dial, voice_server: ServerProcess
) -> None:
    caller = await dial("?binary=true", token=dial.user())
    await caller.speak(LOUD, LOUD, LOUD, first=True)
    frames = await caller.until(is_type("done"))
    assert kinds(frames)[0] == "session_config"  # before any audio
    assert frames[0]["session_config"] == {"codec": "pcm16", "sample_rate": 16000, "channels": 1}
    assert {"type": "chunk", "content": "hello there", "role": "user",
            "session_id": caller.session_id} in frames  # fmt: skip
    assert {"type": "chunk", "content": REPLY, "session_id": caller.session_id} in frames
    assert frames[-1] == {"type": "done", "content": REPLY, "session_id": caller.session_id}
    audio = [f for f in frames if isinstance(f, BinaryFrame)]
    assert len(audio) == 5  # 100 ms of speech in 20 ms frames
    assert {f.media_id for f in audio} == {"a1"}
    assert [f.sequence for f in audio] == list(range(5))
    assert audio[0].metadata.sample_rate == 16000
    assert len(audio[0].payload) == 640
    assert "media_chunk" not in kinds(frames)
    await caller.send({"type": "hangup"})

    messages = await wait_for_messages(voice_server.archive_path, caller.session_id, 2)
    assert [(m.role, m.content) for m in messages] == [
        ("user", "hello there"),
        ("assistant", REPLY),
    ]
    async with open_archive(voice_server.archive_path) as store:
        (turn,) = await store.list_turns(caller.session_id)
    assert turn.state == "completed"


async def test_a_client_without_binary_gets_base64_media_chunks(dial: Dial) -> None:
    caller = await dial(token=dial.user())
    await caller.speak(LOUD, LOUD, LOUD, first=True)
    frames = await caller.until(is_type("done"))
    assert "binary" not in kinds(frames)
    chunks = [f["media_chunk"] for f in texts(frames) if f["type"] == "media_chunk"]
    assert len(chunks) == 5
    assert [c["sequence"] for c in chunks] == list(range(5))
    assert chunks[0]["mime_type"] == "audio/pcm;rate=16000;channels=1"
    assert kinds(frames).index("session_config") < kinds(frames).index("media_chunk")
    await caller.send({"type": "hangup"})


async def test_text_messages_keep_working_during_a_call(dial: Dial) -> None:
    caller = await dial("?binary=true", token=dial.user())
    await caller.speak(LOUD, first=True)  # the agent waits for three loud frames
    assert kinds(await caller.until(is_type("session_config"))) == ["session_config"]
    await caller.send({"type": "message", "content": "hi"})
    text_turn = await caller.until(is_type("done"))
    assert texts(text_turn)[-1]["content"] == "Hello world"
    await caller.speak(LOUD, LOUD)
    voice_turn = await caller.until(is_type("done"))
    assert texts(voice_turn)[-1]["content"] == REPLY
    await caller.send({"type": "hangup"})


async def test_barge_in_interrupts_the_agents_speech(dial: Dial) -> None:
    caller = await dial("?binary=true&agent=long", token=dial.user())
    await caller.speak(LOUD, LOUD, LOUD, first=True)
    await caller.until(lambda f: isinstance(f, BinaryFrame))  # the agent is speaking
    await caller.speak(LOUD)  # the caller talks over it
    frames = await caller.until(is_type("interrupt"))
    assert "done" not in kinds(frames)  # an interrupted turn is not done
    await caller.send({"type": "hangup"})


async def test_hangup_ends_the_call_and_the_next_frame_starts_another(dial: Dial) -> None:
    caller = await dial("?binary=true", token=dial.user())
    await caller.speak(LOUD, first=True)
    await caller.until(is_type("session_config"))
    await caller.send({"type": "hangup"})
    await caller.speak(LOUD, first=True)  # a new call: the format comes again
    assert kinds(await caller.until(is_type("session_config"))) == ["session_config"]
    await caller.send({"type": "hangup"})
    await caller.ws.close()
    # Hung up, not parked: nothing to resume.
    again = await dial(f"?resume={caller.session_id}", token=caller.token)
    assert again.connected_frame["connected"]["resumed"] is False


async def test_is_last_ends_the_call_after_the_agents_reply(
    dial: Dial, voice_server: ServerProcess
) -> None:
    caller = await dial("?binary=true", token=dial.user())
    await caller.speak(LOUD, LOUD, LOUD, first=True, is_last=True)
    frames = await caller.until(is_type("done"))
    assert texts(frames)[-1]["content"] == REPLY
    # The call is over once the agent's reply is: a frame sent before that gets one
    # error (and later ones none), a frame sent after starts a new call.
    refusals = []
    async with asyncio.timeout(WAIT):
        while True:
            await caller.speak(LOUD, first=True)
            try:
                frame = await caller.next(within=0.2)
            except TimeoutError:
                continue
            if is_type("session_config")(frame):
                break
            refusals.append(frame)
    assert refusals in ([], [{"type": "error", "session_id": caller.session_id, "error": {
        "code": "INVALID_MESSAGE", "message": AUDIO_AFTER_LAST}}])  # fmt: skip
    await caller.send({"type": "hangup"})
    messages = await wait_for_messages(voice_server.archive_path, caller.session_id, 2)
    assert [m.content for m in messages] == ["hello there", REPLY]


async def test_chunked_caller_audio_is_reassembled_and_a_broken_transfer_refused(
    dial: Dial,
) -> None:
    caller = await dial("?binary=true", token=dial.user())

    async def transfer(payload: bytes, media_id: str, *, first: bool = False) -> None:
        half = len(payload) // 2
        for index, part in enumerate((payload[:half], payload[half:])):
            meta = FORMAT if first and index == 0 else BinaryMetadata()
            meta = msgspec.structs.replace(meta, total_chunks=2)
            await caller.ws.send_bytes(
                encode_frame(
                    BinaryFrame(chunked=True, sequence=index, media_id=media_id, metadata=meta,
                                payload=part)
                )
            )  # fmt: skip

    await transfer(LOUD, "t1", first=True)
    await transfer(LOUD, "t2")
    broken = BinaryFrame(
        chunked=True, sequence=1, media_id="t3", metadata=BinaryMetadata(total_chunks=2),
        payload=LOUD,
    )  # fmt: skip
    await caller.ws.send_bytes(encode_frame(broken))  # no chunk 0: refused, not applied
    frames = await caller.until(is_type("error"))
    assert texts(frames)[-1]["error"]["code"] == "INVALID_MESSAGE"
    assert "done" not in kinds(frames)  # two payloads heard, not three
    await transfer(LOUD, "t4")  # the third whole payload: the agent answers
    assert texts(await caller.until(is_type("done")))[-1]["content"] == REPLY
    await caller.send({"type": "hangup"})


# -- failures ------------------------------------------------------------------------------


async def test_a_video_counter_offer_is_unsatisfiable_and_the_socket_stays(dial: Dial) -> None:
    caller = await dial("?binary=true&agent=video", token=dial.user())
    await caller.speak(LOUD, first=True)
    (error,) = await caller.until(is_type("error"))
    assert isinstance(error, dict)
    assert error["error"]["code"] == "UNSATISFIABLE_FORMAT"
    await caller.speak(LOUD, LOUD)
    await caller.silent()
    assert (await caller.ask("hi"))[-1]["type"] == "done"


async def test_a_failed_call_is_exactly_one_duplex_error(dial: Dial) -> None:
    caller = await dial("?binary=true&agent=failing", token=dial.user())
    await caller.speak(LOUD, LOUD, first=True)
    frames = await caller.until(is_type("error"))
    assert kinds(frames) == ["session_config", "error"]
    assert frames[-1]["error"] == {  # type: ignore[index]
        "code": "DUPLEX_ERROR",
        "message": "the voice model is unavailable",
        "details": {"reason": "PROVIDER_UNAVAILABLE"},
    }
    await caller.speak(*[LOUD] * 10)
    await caller.silent()
    assert (await caller.ask("hi"))[-1]["type"] == "done"


# -- limits --------------------------------------------------------------------------------


async def test_inbound_audio_over_the_rate_gets_one_rate_limited(dial: Dial) -> None:
    caller = await dial("?binary=true", token=dial.user())
    over = BURST // len(QUIET) + 20  # the burst, then twenty frames more, at once
    # Silence: the agent has nothing to answer, so only the limit speaks.
    await caller.speak(*[QUIET] * over, first=True)
    await caller.send({"type": "message", "content": "hi"})  # a marker after the audio
    frames = await caller.until(
        lambda f: isinstance(f, dict) and f["type"] == "done" and f["content"] == "Hello world"
    )
    limited = [f for f in texts(frames) if f["type"] == "error"]
    assert [f["error"]["code"] for f in limited] == ["RATE_LIMITED"]
    await caller.send({"type": "hangup"})


async def test_calls_past_the_principal_limit_are_rate_limited(dial: Dial) -> None:
    token = dial.user()
    callers = [await dial("?binary=true", token=token) for _ in range(3)]
    for caller in callers[:2]:
        await caller.speak(LOUD, first=True)
        await caller.until(is_type("session_config"))
    await callers[2].speak(LOUD, first=True)
    (refused,) = await callers[2].until(is_type("error"))
    assert isinstance(refused, dict)
    assert refused["error"]["code"] == "RATE_LIMITED"
    await callers[2].speak(LOUD)
    await callers[2].silent()
    other = await dial("?binary=true", token=dial.user())  # another principal's call starts
    await other.speak(LOUD, first=True)
    await other.until(is_type("session_config"))
    for caller in (*callers[:2], other):
        await caller.send({"type": "hangup"})


# -- parking and resume --------------------------------------------------------------------


async def test_a_dropped_call_is_reclaimed_with_resume_in_its_window(
    dial: Dial, voice_server: ServerProcess
) -> None:
    token = dial.user()
    caller = await dial("?binary=true", token=token)
    await caller.speak(LOUD, first=True)
    await caller.until(is_type("session_config"))
    await caller.ws.close()  # dropped without hangup: parked
    again = await dial(f"?binary=true&resume={caller.session_id}", token=token)
    assert again.session_id == caller.session_id
    assert again.connected_frame["connected"]["resumed"] is True
    assert kinds(await again.until(is_type("session_config"))) == ["session_config"]
    again.sequence = caller.sequence
    await again.speak(LOUD, LOUD)  # the call goes on where it was: two more make three
    frames = await again.until(is_type("done"))
    assert {"type": "chunk", "content": "hello there", "role": "user",
            "session_id": caller.session_id} in frames  # fmt: skip
    await again.send({"type": "hangup"})
    assert await metric(dial.http, voice_server, "portico_audio_sessions_unparked_total"
                        '{outcome="reclaimed"}') >= 1  # fmt: skip


async def test_a_resume_takes_the_call_over_from_a_connection_still_open(dial: Dial) -> None:
    token = dial.user()
    first = await dial("?binary=true", token=token)
    await first.speak(LOUD, first=True)
    await first.until(is_type("session_config"))
    # The client reconnected before the server saw its old socket go.
    second = await dial(f"?binary=true&resume={first.session_id}", token=token)
    assert second.connected_frame["connected"]["resumed"] is True
    (moved,) = await first.until(is_type("error"))
    assert moved["error"] == {  # type: ignore[index]
        "code": "DUPLEX_ERROR",
        "message": "the call was resumed on another connection",
    }
    await second.until(is_type("session_config"))
    second.sequence = first.sequence
    await second.speak(LOUD, LOUD)
    assert texts(await second.until(is_type("done")))[-1]["content"] == REPLY
    await first.speak(LOUD)  # the old connection's frames go nowhere now
    await first.silent()
    await second.send({"type": "hangup"})


async def test_another_principal_cannot_reclaim_a_parked_call(dial: Dial) -> None:
    alice, bob = dial.user(), dial.user()
    caller = await dial("?binary=true", token=alice)
    await caller.speak(LOUD, first=True)
    await caller.until(is_type("session_config"))
    await caller.ws.close()
    stranger = await dial(f"?binary=true&resume={caller.session_id}", token=bob)
    assert stranger.connected_frame["connected"]["resumed"] is False
    assert stranger.session_id != caller.session_id  # a fresh session
    (refused,) = await stranger.until(is_type("error"))
    assert refused == {
        "type": "error",
        "error": {
            "code": "SESSION_EXPIRED",
            "message": "session context has expired; start a new session",
        },
        "session_id": caller.session_id,
    }
    owner = await dial(f"?binary=true&resume={caller.session_id}", token=alice)
    assert owner.connected_frame["connected"]["resumed"] is True
    await owner.send({"type": "hangup"})


async def test_a_parked_call_ends_when_its_window_passes(
    dial_short: Dial, short_grace_server: ServerProcess
) -> None:
    token = dial_short.user()
    caller = await dial_short("?binary=true", token=token)
    await caller.speak(LOUD, first=True)
    await caller.until(is_type("session_config"))
    before = await metric(
        dial_short.http,
        short_grace_server,
        'portico_audio_sessions_unparked_total{outcome="ended"}',
    )
    await caller.ws.close()
    deadline = time.monotonic() + WAIT
    while (
        await metric(
            dial_short.http,
            short_grace_server,
            'portico_audio_sessions_unparked_total{outcome="ended"}',
        )
        <= before
    ):
        assert time.monotonic() < deadline, "the parked call never ended"
        await asyncio.sleep(0.05)
    again = await dial_short(f"?binary=true&resume={caller.session_id}", token=token)
    assert again.connected_frame["connected"]["resumed"] is False
    assert (await again.until(is_type("error")))[-1]["error"]["code"] == "SESSION_EXPIRED"  # type: ignore[index]


async def test_a_malformed_resume_refuses_the_upgrade(
    http: aiohttp.ClientSession, voice_server: ServerProcess
) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
        await http.ws_connect(
            voice_server.ws_url + "?resume=no%20spaces",
            headers={"Authorization": "Bearer voice-0"},
        )
    assert caught.value.status == 400


async def test_voice_metrics_count_calls_frames_and_bytes(
    dial: Dial, voice_server: ServerProcess
) -> None:
    caller = await dial("?binary=true", token=dial.user())
    before = await metric(dial.http, voice_server, 'portico_audio_bytes_total{direction="in"}')
    await caller.speak(LOUD, LOUD, LOUD, first=True)
    await caller.until(is_type("done"))
    await caller.send({"type": "hangup"})
    after = await metric(dial.http, voice_server, 'portico_audio_bytes_total{direction="in"}')
    assert after - before == 3 * len(LOUD)
    assert await metric(dial.http, voice_server, "portico_audio_sessions_total") >= 1
    assert await metric(dial.http, voice_server, 'portico_audio_frames_total{direction="out"}') >= 5
