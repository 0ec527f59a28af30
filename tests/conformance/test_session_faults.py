"""`/v1/session` against a real server through the fault-injection proxy.

Every test checks the effect ledger in the archive (messages and turns by id):
zero loss, zero duplicates, whatever the proxy did to the frames.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from portico.core.states import TurnState
from support.archive import open_archive, wait_for_messages
from support.faultproxy import (
    CLIENT_TO_SERVER,
    SERVER_TO_CLIENT,
    FaultProxy,
    Rule,
    cut,
    duplicate,
)
from support.server import SCRIPT, ServerProcess
from support.session import Closed, SessionProbe

ALICE, BOB = "alice-token", "bob-token"
WINDOW = 1.5  # resume window, seconds
BUFFER = 200  # resend buffer, messages
TOOL_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def session_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("portico-sessions"),
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={
            "PORTICO_AUTH": "apikey",
            "PORTICO_API_KEYS": f"{ALICE}=alice,{BOB}=bob",
            "PORTICO_RESUME_WINDOW": str(WINDOW),
            "PORTICO_RESEND_BUFFER_MESSAGES": str(BUFFER),
            "PORTICO_TOOL_ACK_TIMEOUT": str(TOOL_TIMEOUT),
        },
    ).start()
    yield process
    process.stop()


@pytest.fixture
async def proxy(session_server: ServerProcess) -> AsyncIterator[FaultProxy]:
    async with FaultProxy(session_server.http_url) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


class Client:
    """A probe that resumes: keeps its session id and its seq counters across drops."""

    def __init__(self, http: aiohttp.ClientSession, proxy: FaultProxy) -> None:
        self.http = http
        self.proxy = proxy
        self.probe: SessionProbe | None = None
        self.session_id = ""

    async def open(self, token: str = ALICE, **hello: Any) -> dict[str, Any]:
        self.probe = await SessionProbe.connect(self.http, self.proxy.url("/v1/session"))
        ready = await self.probe.hello(credential=token, **hello)
        assert ready["type"] == "ready", ready
        self.session_id = ready["session_id"]
        return ready

    async def resume(self, token: str = ALICE) -> dict[str, Any]:
        """Reconnect with the same session id and position; returns `ready` (or an error)."""
        old = self.probe
        assert old is not None
        probe = await SessionProbe.connect(self.http, self.proxy.url("/v1/session"))
        probe.handled, probe.next_seq, probe.received = old.handled, old.next_seq, old.received
        self.probe = probe
        return await probe.hello(credential=token, session_id=self.session_id, last_seq=old.handled)

    @property
    def p(self) -> SessionProbe:
        assert self.probe is not None
        return self.probe


async def ledger(server: ServerProcess, session_id: str, count: int) -> list[tuple[str, str]]:
    messages = await wait_for_messages(server.archive_path, session_id, count)
    return [(m.role, m.content) for m in messages]


def scenario(name: str) -> dict[str, Any]:
    return {"metadata": {"mock_scenario": name}}


async def read_forever(probe: SessionProbe) -> None:
    while True:
        await probe.recv(5)


async def wait_dropped(probe: SessionProbe) -> None:
    with pytest.raises(Closed):
        await read_forever(probe)


# -- exactly once across drops ---------------------------------------------------------------


async def test_server_message_lost_in_a_drop_is_resent_once(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open()
    # The second chunk never reaches the client: the connection drops with it.
    proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, type="chunk", nth=2))
    await client.p.message("hi")
    assert (await client.p.recv_numbered())["content"] == "Hello "
    await wait_dropped(client.p)
    ready = await client.resume()
    assert (ready["resumed"], ready["last_seq"]) == (True, 1)
    rest = await client.p.turn()
    assert [f["type"] for f in rest] == ["chunk", "done"]
    assert client.p.numbered_seqs() == [1, 2, 3]
    assert await ledger(session_server, client.session_id, 2) == [
        ("user", "hi"),
        ("assistant", "Hello world"),
    ]


async def test_client_message_handled_but_unacked_is_not_applied_twice(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open()
    # The server's ack and reply never arrive; the client will resend message 1.
    proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, type={"ack", "chunk"}))
    await client.p.message("only once")
    await wait_dropped(client.p)
    ready = await client.resume()
    assert ready["last_seq"] == 1  # the server had handled it
    await client.p.message("only once", seq=1)  # what a client resends above last_seq=0
    frames = await client.p.turn()
    assert frames[-1]["content"] == "Hello world"
    assert await ledger(session_server, client.session_id, 2) == [
        ("user", "only once"),
        ("assistant", "Hello world"),
    ]
    async with open_archive(session_server.archive_path) as store:
        assert len(await store.list_turns(client.session_id)) == 1


async def test_drop_while_ready_is_in_flight_then_resume_again(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("before")
    await client.p.turn()
    await client.p.ack()
    proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, type="ready"))
    with pytest.raises(Closed):
        await client.resume()
    ready = await client.resume()
    assert (ready["type"], ready["resumed"], ready["last_seq"]) == ("ready", True, 1)
    await client.p.message("after")
    assert (await client.p.turn())[-1]["content"] == "Hello world"
    assert client.p.numbered_seqs() == [1, 2, 3, 4, 5, 6]
    assert await ledger(session_server, client.session_id, 4) == [
        ("user", "before"),
        ("assistant", "Hello world"),
        ("user", "after"),
        ("assistant", "Hello world"),
    ]


async def test_drop_in_the_middle_of_a_resend_backlog(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("stream", **scenario("medium"))  # 120 chunks and a done
    await client.p.recv_numbered()
    await proxy.cut_all()
    # The turn finishes while nobody is connected; then the backlog is cut halfway.
    await wait_for_messages(session_server.archive_path, client.session_id, 2)
    proxy.add_rule(Rule(cut(forward=True), direction=SERVER_TO_CLIENT, type="chunk", nth=60))
    await client.resume()
    await wait_dropped(client.p)
    await client.resume()
    frames = await client.p.turn()
    assert frames[-1]["type"] == "done"
    assert client.p.numbered_seqs() == list(range(1, 122))
    contents = [f.get("content") for f in client.p.received if f["type"] == "chunk"]
    assert contents == ["y"] * 120


async def test_duplicated_frames_in_both_directions_take_effect_once(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open()
    proxy.add_rule(Rule(duplicate(2), direction=CLIENT_TO_SERVER, type="message", times=None))
    proxy.add_rule(Rule(duplicate(1), direction=SERVER_TO_CLIENT, type="chunk", times=None))
    await client.p.message("twice?")
    seen: list[int] = []
    while True:
        frame = await client.p.recv_numbered()
        seen.append(frame["seq"])
        if frame["type"] == "done":
            break
    assert seen == [1, 1, 2, 2, 3]  # the probe sees duplicates; a client discards by seq
    await asyncio.sleep(0.2)
    assert await ledger(session_server, client.session_id, 2) == [
        ("user", "twice?"),
        ("assistant", "Hello world"),
    ]
    async with open_archive(session_server.archive_path) as store:
        assert len(await store.list_turns(client.session_id)) == 1


# -- acknowledgement and numbering errors --------------------------------------------------


async def test_regressing_ack_is_ignored(http: aiohttp.ClientSession, proxy: FaultProxy) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("a")
    await client.p.turn()
    await client.p.ack(3)
    await client.p.ack(1)
    await client.p.send({"type": "ping"})
    assert (await client.p.recv())["type"] in ("pong", "ack")
    await client.p.message("b")
    assert (await client.p.turn())[-1]["type"] == "done"


async def test_ack_beyond_the_highest_seq_closes_4400_and_stays_resumable(
    http: aiohttp.ClientSession, proxy: FaultProxy
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("a")
    await client.p.turn()
    await client.p.ack(99)
    error = await client.p.recv_numbered()
    assert error["error"]["code"] == "PROTOCOL_ERROR"
    assert (await client.p.closed())[0] == 4400
    ready = await client.resume()
    assert (ready["type"], ready["resumed"]) == ("ready", True)


async def test_seq_gap_closes_4400_and_order_holds_after_resume(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("third", seq=3)
    assert (await client.p.recv_numbered())["error"]["code"] == "PROTOCOL_ERROR"
    assert (await client.p.closed())[0] == 4400
    ready = await client.resume()
    assert ready["last_seq"] == 0
    for seq, text in ((1, "first"), (2, "second")):
        await client.p.message(text, seq=seq, **scenario("echo"))
        await client.p.turn()
    assert [c for _, c in await ledger(session_server, client.session_id, 4)] == [
        "first",
        "first",
        "second",
        "second",
    ]


# -- resume window, takeover, refusals -----------------------------------------------------


@pytest.mark.parametrize(("fraction", "resumes"), [(0.6, True), (1.3, False)])
async def test_resume_inside_and_outside_the_window(
    http: aiohttp.ClientSession, proxy: FaultProxy, fraction: float, resumes: bool
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.ws.close()
    await asyncio.sleep(WINDOW * fraction)  # the window is wall-clock time by definition
    answer = await client.resume()
    if resumes:
        assert (answer["type"], answer["resumed"]) == ("ready", True)
    else:
        assert answer["error"]["code"] == "RESUME_FAILED"
        assert (await client.p.closed())[0] == 4404


async def test_half_open_connection_is_taken_over(
    http: aiohttp.ClientSession, proxy: FaultProxy
) -> None:
    client = Client(http, proxy)
    await client.open()
    old = client.p
    ready = await client.resume()
    assert ready["resumed"] is True
    assert (await old.closed())[0] == 4409
    await client.p.message("new connection")
    assert (await client.p.turn())[-1]["type"] == "done"


@pytest.mark.parametrize("case", ["other principal", "unknown id", "after end"])
async def test_resume_failed_never_reveals_existence(
    http: aiohttp.ClientSession, proxy: FaultProxy, case: str
) -> None:
    client = Client(http, proxy)
    await client.open()
    if case == "after end":
        await client.p.numbered("end")
        assert (await client.p.closed())[0] == 1000
    if case == "unknown id":
        client.session_id = "sess-does-not-exist"
    answer = await client.resume(BOB if case == "other principal" else ALICE)
    assert answer == {
        "type": "error",
        "error": {"code": "RESUME_FAILED", "message": "the session cannot be resumed"},
    }
    assert (await client.p.closed())[0] == 4404


async def test_credential_in_the_url_is_refused(
    http: aiohttp.ClientSession, session_server: ServerProcess
) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await http.ws_connect(session_server.http_url + "/v1/session?token=" + ALICE)
    assert refused.value.status == 400


@pytest.mark.parametrize("first", [{"type": "ping"}, {"type": "message", "seq": 1, "content": "x"}])
async def test_anything_before_hello_is_a_protocol_error(
    http: aiohttp.ClientSession, proxy: FaultProxy, first: dict[str, Any]
) -> None:
    probe = await SessionProbe.connect(http, proxy.url("/v1/session"))
    await probe.send(first)
    assert (await probe.recv())["error"]["code"] == "PROTOCOL_ERROR"
    assert (await probe.closed())[0] == 4400


async def test_second_hello_is_a_protocol_error(
    http: aiohttp.ClientSession, proxy: FaultProxy
) -> None:
    client = Client(http, proxy)
    await client.open()
    assert (await client.p.hello(credential=ALICE))["error"]["code"] == "PROTOCOL_ERROR"
    assert (await client.p.closed())[0] == 4400


async def test_bad_credential_closes_4401(http: aiohttp.ClientSession, proxy: FaultProxy) -> None:
    probe = await SessionProbe.connect(http, proxy.url("/v1/session"))
    assert (await probe.hello(credential="nope"))["error"]["code"] == "UNAUTHENTICATED"
    assert (await probe.closed())[0] == 4401


async def test_a_client_that_never_acks_overflows_the_buffer(
    http: aiohttp.ClientSession, proxy: FaultProxy
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("flood", **scenario("long"))  # 301 messages > the 200 buffer
    frames = []
    while True:
        frame = await client.p.recv_numbered()
        frames.append(frame)
        if frame["type"] == "error":
            break
    assert frame["error"]["code"] == "RESUME_FAILED"
    assert frame["error"]["details"] == {"reason": "buffer_overflow"}
    assert (await client.p.closed())[0] == 4404
    assert (await client.resume())["error"]["code"] == "RESUME_FAILED"


# -- turns across drops --------------------------------------------------------------------


async def test_a_turn_that_streams_while_away_is_delivered_on_resume(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("go", **scenario("paced"))
    assert (await client.p.recv_numbered())["content"] == "p0 "
    await proxy.cut_all()
    await wait_for_messages(session_server.archive_path, client.session_id, 2)
    await client.resume()
    frames = await client.p.turn()
    contents = [f.get("content") for f in client.p.received if f["type"] in ("chunk", "done")]
    assert contents == [f"p{i} " for i in range(10)] + ["".join(f"p{i} " for i in range(10))]
    assert client.p.numbered_seqs() == list(range(1, 12))
    assert frames[-1]["type"] == "done"


async def test_tool_result_sent_across_a_drop_reaches_the_agent_once(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open(capabilities=["tools"])
    await client.p.message("where", **scenario("tool"))
    call = await client.p.recv_numbered()
    assert call["type"] == "tool_call"
    call_id = call["tool_call"]["id"]
    # The result reaches the server, but the connection drops before any answer.
    proxy.add_rule(Rule(cut(forward=True), direction=CLIENT_TO_SERVER, type="tool_result"))
    result_seq = await client.p.numbered("tool_result", call_id=call_id, result={"city": "Oslo"})
    await wait_dropped(client.p)
    ready = await client.resume()
    assert ready["last_seq"] == result_seq
    # A client that missed the ack resends it anyway: it must not apply twice.
    await client.p.numbered("tool_result", seq=result_seq, call_id=call_id, result="again")
    frames = await client.p.turn()
    assert frames[-1]["content"] == 'status=completed result={"city":"Oslo"} error='
    async with open_archive(session_server.archive_path) as store:
        (record,) = await store.list_tool_calls(client.session_id)
    assert record.result == {"city": "Oslo"}


async def test_interrupt_during_a_stream_ends_it_cancelled(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("go", **scenario("paced"))
    first = await client.p.recv_numbered()
    await client.p.numbered("interrupt")
    frames = [first, *await client.p.turn()]
    done = frames[-1]
    assert done["type"] == "done"
    assert done["cancelled"] is True
    assert done["content"] == "".join(f["content"] for f in frames[:-1])
    assert sum(f["type"] in ("done", "error") for f in frames) == 1
    async with open_archive(session_server.archive_path) as store:
        (turn,) = await store.list_turns(client.session_id)
    assert turn.state is TurnState.CANCELLED


async def test_server_idle_close_is_4000(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, env={"PORTICO_SESSION_IDLE_TIMEOUT": "0.5"}).start()
    try:
        probe = await SessionProbe.connect(http, server.http_url + "/v1/session")
        assert (await probe.hello())["type"] == "ready"
        assert (await probe.closed(5))[0] == 4000
    finally:
        server.stop()


# -- the `audio` capability: media items in binary frames --------------------------------------

PCM = {"codec": "pcm16", "sample_rate": 24000, "channels": 1}


def media_payload(size: int) -> bytes:
    """What the scripted `media_chunk` step streams: the pattern i % 256."""
    return (bytes(range(256)) * (size // 256 + 1))[:size]


async def test_audio_items_arrive_in_binary_frames_between_start_and_end(
    http: aiohttp.ClientSession, proxy: FaultProxy
) -> None:
    client = Client(http, proxy)
    ready = await client.open(capabilities=["audio"], audio={"output": [{"codec": "x"}, PCM]})
    assert "audio" in ready["capabilities"]
    assert ready["audio"] == {"input": None, "output": PCM}  # the first format it can send
    await client.p.message("sound", **scenario("media"))
    frames = await client.p.turn()
    start, end, done = frames
    assert start["type"] == "audio_start"
    assert start["format"] == {"codec": "pcm16", "mime_type": "audio/pcm"}
    assert end == {
        "type": "audio_end",
        "seq": end["seq"],
        "turn_id": start["turn_id"],
        "item_id": start["item_id"],
    }
    assert done["type"] == "done"
    binary = client.p.binary
    assert [b.media_id for b in binary] == [start["item_id"]] * 4
    assert [b.sequence for b in binary] == [0, 1, 2, 3]
    assert [b.is_last for b in binary] == [False, False, False, True]
    assert binary[0].metadata.mime_type == "audio/pcm"
    assert binary[0].metadata.session_id == client.session_id
    assert binary[1].metadata.mime_type is None  # metadata on the first frame only
    assert b"".join(b.payload for b in binary) == media_payload(200000)
    # Binary frames sit between the item's start and end, and are never numbered.
    kinds = [f if isinstance(f, dict) else "binary" for f in client.p.received_all]
    order = [k["type"] if isinstance(k, dict) else k for k in kinds]
    first, last = order.index("audio_start"), order.index("audio_end")
    assert order[first + 1 : last].count("binary") == 4
    assert client.p.numbered_seqs() == [1, 2, 3]


async def test_without_the_audio_capability_media_are_dropped(
    http: aiohttp.ClientSession, proxy: FaultProxy
) -> None:
    client = Client(http, proxy)
    ready = await client.open(audio={"output": [PCM]})  # formats alone do not ask for it
    assert "audio" not in ready["capabilities"]
    assert "audio" not in ready  # null stays off the wire
    await client.p.message("sound", **scenario("media"))
    frames = await client.p.turn()
    assert [f["type"] for f in frames] == ["done"]
    assert client.p.binary == []


async def test_a_drop_mid_item_loses_it_and_the_next_item_starts_fresh(
    http: aiohttp.ClientSession, proxy: FaultProxy
) -> None:
    client = Client(http, proxy)
    await client.open(capabilities=["audio"], audio={"output": [PCM]})
    # The connection drops with the first item's second binary frame.
    proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, kind="binary", nth=2))
    await client.p.message("sound", **scenario("media_twice"))
    await wait_dropped(client.p)
    assert [b.sequence for b in client.p.binary] == [0]  # what arrived of the first item
    await client.resume()
    frames = await client.p.turn()
    received = client.p.received
    starts = [f for f in received if f["type"] == "audio_start"]
    ends = [f for f in received if f["type"] == "audio_end"]
    # Control messages exactly once, in order, across the drop.
    assert client.p.numbered_seqs() == list(range(1, len(client.p.numbered_seqs()) + 1))
    assert [s["item_id"] for s in starts] == [e["item_id"] for e in ends]
    assert len({s["item_id"] for s in starts}) == len(starts) == 2
    assert frames[-1]["type"] == "done"
    assert sum(f["type"] == "done" for f in received) == 1
    # The second item: a new id, all its frames from sequence 0, metadata on the first.
    fresh = [b for b in client.p.binary if b.media_id == starts[1]["item_id"]]
    assert [b.sequence for b in fresh] == [0, 1, 2]
    assert fresh[0].metadata.mime_type == "audio/pcm"
    assert b"".join(b.payload for b in fresh) == media_payload(1000)
    assert ends[1].get("lost") is None
    # Binary frames are never resent: nothing of the first item on the new connection.
    assert not [b for b in client.p.binary if b.media_id == starts[0]["item_id"]]
