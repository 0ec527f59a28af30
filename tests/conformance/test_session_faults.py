"""`/v1/session` against a real server through the fault-injection proxy.

Every test ends by checking the session's effect ledger in the archive (messages,
turns and tool results counted by id, `support.archive.assert_ledger`): zero loss,
zero duplicates, whatever the proxy did to the frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from portico.client import SessionClient
from portico.domain.states import TurnState
from support.archive import Ledger, assert_ledger, wait_for_messages
from support.faultproxy import (
    CLIENT_TO_SERVER,
    SERVER_TO_CLIENT,
    FaultProxy,
    Rule,
    cut,
    duplicate,
    suppress,
)
from support.redis import SESSION_STATES, session_state
from support.server import SCRIPT, ServerProcess
from support.session import Closed, SessionProbe

ALICE, BOB = "alice-token", "bob-token"
WINDOW = 1.5  # resume window, seconds
BUFFER = 200  # resend buffer, messages
TOOL_TIMEOUT = 5.0
HELLO = "Hello world"  # the scripted default reply
MEDIUM = "y" * 120  # the `medium` scenario's reply: 120 chunks, then done


@pytest.fixture(scope="module", params=SESSION_STATES)
def session_server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    with session_state(request.param) as state_env:
        process = ServerProcess(
            tmp_path_factory.mktemp("portico-sessions"),
            args=("--runtime", "scripted", "--script", str(SCRIPT)),
            env={
                "PORTICO_AUTH": "apikey",
                "PORTICO_API_KEYS": f"{ALICE}=alice,{BOB}=bob",
                "PORTICO_RESUME_WINDOW": str(WINDOW),
                "PORTICO_RESEND_BUFFER_MESSAGES": str(BUFFER),
                "PORTICO_TOOL_ACK_TIMEOUT": str(TOOL_TIMEOUT),
                **state_env,
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

    async def resume(
        self, token: str | None = ALICE, *, session_id: str | None = None, **hello: Any
    ) -> dict[str, Any]:
        """Reconnect with the session id and position; returns `ready` (or an error).
        `token=None` sends no credential at all."""
        old = self.probe
        assert old is not None
        probe = await SessionProbe.connect(self.http, self.proxy.url("/v1/session"))
        probe.handled, probe.next_seq, probe.received = old.handled, old.next_seq, old.received
        self.probe = probe
        if token is not None:
            hello["credential"] = token
        return await probe.hello(
            session_id=session_id or self.session_id, last_seq=old.handled, **hello
        )

    @property
    def p(self) -> SessionProbe:
        assert self.probe is not None
        return self.probe


def exchange(text: str, reply: str = HELLO) -> list[tuple[str, str]]:
    """One user message and the agent's reply, as the ledger lists them."""
    return [("user", text), ("assistant", reply)]


async def ledger(
    server: ServerProcess,
    client: Client | str,
    messages: Sequence[tuple[str, str]],
    **expected: Any,
) -> Ledger:
    session_id = client if isinstance(client, str) else client.session_id
    return await assert_ledger(server.archive_path, session_id, messages, **expected)


def scenario(name: str) -> dict[str, Any]:
    return {"metadata": {"mock_scenario": name}}


async def read_forever(probe: SessionProbe) -> None:
    while True:
        await probe.recv(5)


async def wait_dropped(probe: SessionProbe) -> None:
    with pytest.raises(Closed):
        await read_forever(probe)


async def flush(probe: SessionProbe) -> None:
    """Read until the server answers a ping: whatever it sent in answer to the frames
    before the ping (errors included) has arrived by then."""
    await probe.send({"type": "ping"})
    while (await probe.recv())["type"] != "pong":
        pass


def errors(probe: SessionProbe) -> list[dict[str, Any]]:
    return [frame for frame in probe.received if frame["type"] == "error"]


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
    await ledger(session_server, client, exchange("hi"))


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
    assert frames[-1]["content"] == HELLO
    await ledger(session_server, client, exchange("only once"))


async def test_drop_while_ready_is_in_flight_then_resume_again(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("stream", **scenario("medium"))
    assert (await client.p.recv_numbered())["seq"] == 1
    await proxy.cut_all()
    # The turn ends while nobody is connected: seqs 2..121 wait, unacknowledged.
    await wait_for_messages(session_server.archive_path, client.session_id, 2)
    # The first resume's `ready` is lost with its connection (and the backlog behind it).
    proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, type="ready"))
    with pytest.raises(Closed):
        await client.resume()
    ready = await client.resume()
    assert (ready["type"], ready["resumed"], ready["last_seq"]) == ("ready", True, 1)
    frames = await client.p.turn()
    done = frames[-1]
    assert (done["type"], done["seq"], done["content"]) == ("done", 121, MEDIUM)
    await client.p.message("after")
    assert (await client.p.turn())[-1]["content"] == HELLO
    # Every seq exactly once, in order, across the three connections.
    assert client.p.numbered_seqs() == list(range(1, 125))
    await ledger(session_server, client, exchange("stream", MEDIUM) + exchange("after"))


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
    await ledger(session_server, client, exchange("stream", MEDIUM))


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
    await ledger(session_server, client, exchange("twice?"))


async def test_duplicated_frames_reach_a_session_client_once(
    proxy: FaultProxy, session_server: ServerProcess
) -> None:
    """The SDK through the proxy, every chunk, done and ack duplicated both ways."""
    proxy.add_rule(
        Rule(duplicate(1), direction=SERVER_TO_CLIENT, type={"chunk", "done", "ack"}, times=None)
    )
    proxy.add_rule(
        Rule(duplicate(2), direction=CLIENT_TO_SERVER, type={"message", "ack"}, times=None)
    )
    # ack_every=1: the client acknowledges every server message at once, so its acks flow.
    client = SessionClient(proxy.url("/v1/session"), credential=ALICE, ack_every=1)
    texts = [f"twice {n}?" for n in range(3)]
    async with client, asyncio.timeout(10):
        replies = [await client.ask(text) for text in texts]
        # Both sides' acks went through the proxy, duplicated, before the session ends.
        for direction in (SERVER_TO_CLIENT, CLIENT_TO_SERVER):
            await proxy.events.wait_for_frame(direction, type="ack", action="duplicate")
        session_id = client.session_id
    assert session_id is not None
    assert [reply.text for reply in replies] == [HELLO] * 3
    assert [[type(f).__name__ for f in reply.frames] for reply in replies] == [
        ["Chunk", "Chunk", "Done"]
    ] * 3
    # What the client delivered: strictly increasing seqs, none twice, none missing.
    assert [frame.seq for reply in replies for frame in reply.frames] == list(range(1, 10))
    duplicated = proxy.events.frames(action="duplicate")
    assert {(e.direction, e.type) for e in duplicated} >= {
        (SERVER_TO_CLIENT, "chunk"),
        (SERVER_TO_CLIENT, "done"),
        (SERVER_TO_CLIENT, "ack"),
        (CLIENT_TO_SERVER, "message"),
        (CLIENT_TO_SERVER, "ack"),
    }
    await ledger(session_server, session_id, [m for t in texts for m in exchange(t)])


# -- acknowledgement and numbering errors --------------------------------------------------


async def test_regressing_ack_is_ignored(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
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
    await ledger(session_server, client, exchange("a") + exchange("b"))


async def test_ack_beyond_the_highest_seq_closes_4400_and_stays_resumable(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
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
    await client.p.message("b")
    assert (await client.p.turn())[-1]["content"] == HELLO
    assert client.p.numbered_seqs() == [1, 2, 3, 4, 5, 6]
    await ledger(session_server, client, exchange("a") + exchange("b"))


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
    await ledger(session_server, client, exchange("first", "first") + exchange("second", "second"))


# -- resume window, takeover, refusals -----------------------------------------------------


async def close_and_wait(probe: SessionProbe, fraction: float) -> None:
    """Close the connection, then sleep until `fraction` of the window has passed since
    the server saw the close (wall-clock time by definition). The server's window starts
    between the close's start and its end: a fraction below 1 is counted from the start,
    one above 1 from the end, so scheduling noise can only widen the margin."""
    started = time.monotonic()
    await probe.ws.close()
    origin = started if fraction < 1 else time.monotonic()
    await asyncio.sleep(max(0.0, origin + WINDOW * fraction - time.monotonic()))


@pytest.mark.parametrize(("fraction", "resumes"), [(0.9, True), (1.1, False)])
async def test_resume_inside_and_outside_the_window(
    http: aiohttp.ClientSession,
    proxy: FaultProxy,
    session_server: ServerProcess,
    fraction: float,
    resumes: bool,
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("before")
    await client.p.turn()
    await close_and_wait(client.p, fraction)
    answer = await client.resume()
    if resumes:
        assert (answer["type"], answer["resumed"], answer["last_seq"]) == ("ready", True, 1)
        await client.p.message("after")
        assert (await client.p.turn())[-1]["content"] == HELLO
        await ledger(session_server, client, exchange("before") + exchange("after"))
    else:
        assert answer["error"]["code"] == "RESUME_FAILED"
        assert (await client.p.closed())[0] == 4404
        await ledger(session_server, client, exchange("before"))


async def test_the_window_counts_from_the_last_connections_close(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    """Neither the session's opening nor a replaced connection's close starts the window:
    a connection that stays up longer than the window, then closes, can be resumed."""
    client = Client(http, proxy)
    await client.open()
    first = client.p
    assert (await client.resume())["resumed"] is True  # takes the session over
    assert (await first.closed())[0] == 4409
    # Connected for longer than the window, pinging.
    until = time.monotonic() + 1.1 * WINDOW
    while time.monotonic() < until:
        await client.p.send({"type": "ping"})
        assert (await client.p.recv())["type"] == "pong"
        await asyncio.sleep(0.25)
    await close_and_wait(client.p, 0.5)
    ready = await client.resume()
    assert (ready["type"], ready["resumed"]) == ("ready", True)
    await client.p.message("still here")
    assert (await client.p.turn())[-1]["content"] == HELLO
    await ledger(session_server, client, exchange("still here"))


async def test_half_open_connection_is_taken_over(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("before")
    await client.p.turn()
    await client.p.ack()
    old = client.p
    # Connection 0 goes half-open: both ends think it is up, nothing gets through.
    proxy.add_rule(Rule(suppress(), connection=0, times=None), first=True)
    lost = await old.message("into the void")
    await proxy.events.wait_for_frame(CLIENT_TO_SERVER, seq=lost, action="suppress")
    ready = await client.resume()
    assert (ready["resumed"], ready["last_seq"]) == (True, 1)  # message 2 never arrived
    # The old end still thinks it is up and sends on. Were it counted, this would be the
    # session's message 3, and the new connection's 3 a duplicate. (The 4409 may have
    # reached it first: then the send cannot even be written, which proves as much.)
    with contextlib.suppress(ConnectionResetError):
        await old.message("from the old socket", seq=3)
    assert (await old.closed())[0] == 4409
    await client.p.message("into the void", seq=lost)  # the client resends above last_seq
    assert (await client.p.turn())[-1]["content"] == HELLO
    await client.p.message("new connection", seq=3)
    assert (await client.p.turn())[-1]["content"] == HELLO
    await ledger(
        session_server,
        client,
        exchange("before") + exchange("into the void") + exchange("new connection"),
    )


@pytest.mark.parametrize("case", ["other principal", "unknown id", "after end"])
async def test_resume_failed_never_reveals_existence(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess, case: str
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("mine")
    await client.p.turn()
    if case == "after end":
        await client.p.numbered("end")
        assert (await client.p.closed())[0] == 1000
    answer = await client.resume(
        BOB if case == "other principal" else ALICE,
        session_id="sess-does-not-exist" if case == "unknown id" else None,
    )
    assert answer == {
        "type": "error",
        "error": {"code": "RESUME_FAILED", "message": "the session cannot be resumed"},
    }
    assert (await client.p.closed())[0] == 4404
    if case != "after end":  # a refused stranger takes nothing from the owner
        ready = await client.resume()
        assert (ready["type"], ready["resumed"], ready["last_seq"]) == ("ready", True, 1)
    await ledger(session_server, client, exchange("mine"))


@pytest.mark.parametrize("credential", ["wrong-token", None], ids=["wrong", "missing"])
async def test_a_resume_is_authenticated_too(
    http: aiohttp.ClientSession,
    proxy: FaultProxy,
    session_server: ServerProcess,
    credential: str | None,
) -> None:
    client = Client(http, proxy)
    await client.open()
    await client.p.message("mine")
    await client.p.turn()
    await client.p.ws.close()
    answer = await client.resume(credential)
    assert answer["type"] == "error"
    assert answer["error"]["code"] == "UNAUTHENTICATED"
    assert (await client.p.closed())[0] == 4401
    ready = await client.resume()  # the owner, with the right credential
    assert (ready["type"], ready["resumed"], ready["last_seq"]) == ("ready", True, 1)
    await client.p.message("still mine")
    assert (await client.p.turn())[-1]["content"] == HELLO
    await ledger(session_server, client, exchange("mine") + exchange("still mine"))


async def test_capabilities_are_intersected_and_fixed_for_the_sessions_lifetime(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    opened = await client.open(capabilities=["tools", "bogus"])
    assert opened["capabilities"] == ["resume", "tools"]  # unknown names ignored
    await client.p.ws.close()
    resumed = await client.resume(capabilities=["tools", "context", "audio", "bogus"])
    assert resumed["capabilities"] == opened["capabilities"]
    assert "audio" not in resumed
    # What the resume listed is not in effect: `context` is still refused.
    seq = await client.p.numbered("context", context={"doc": "a.md"})
    refused = await client.p.recv_numbered()
    assert (refused["ref_seq"], refused["error"]["code"]) == (seq, "INVALID_MESSAGE")
    await client.p.message("which context?", **scenario("context"))
    assert (await client.p.turn())[-1]["content"] == "{}"
    await ledger(session_server, client, exchange("which context?", "{}"))


@pytest.mark.parametrize("key", ["token", "access_token", "credential", "authorization", "Token"])
async def test_credential_in_the_url_is_refused(
    http: aiohttp.ClientSession, proxy: FaultProxy, key: str
) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await http.ws_connect(proxy.url(f"/v1/session?agent=default&{key}={ALICE}"))
    assert refused.value.status == 400
    assert [(e.kind, e.code) for e in proxy.events] == [("refused", 400)]


@pytest.mark.parametrize("first", [{"type": "ping"}, {"type": "message", "seq": 1, "content": "x"}])
async def test_anything_before_hello_is_a_protocol_error(
    http: aiohttp.ClientSession, proxy: FaultProxy, first: dict[str, Any]
) -> None:
    probe = await SessionProbe.connect(http, proxy.url("/v1/session"))
    await probe.send(first)
    assert (await probe.recv())["error"]["code"] == "PROTOCOL_ERROR"
    assert (await probe.closed())[0] == 4400


async def test_second_hello_is_a_protocol_error(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    await client.open()
    assert (await client.p.hello(credential=ALICE))["error"]["code"] == "PROTOCOL_ERROR"
    assert (await client.p.closed())[0] == 4400
    await ledger(session_server, client, [])


async def test_bad_credential_closes_4401(http: aiohttp.ClientSession, proxy: FaultProxy) -> None:
    probe = await SessionProbe.connect(http, proxy.url("/v1/session"))
    assert (await probe.hello(credential="nope"))["error"]["code"] == "UNAUTHENTICATED"
    assert (await probe.closed())[0] == 4401


async def test_a_client_that_never_acks_overflows_the_buffer(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
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
    # The session ended, its turn did not: the reply is archived whole, once.
    await ledger(session_server, client, exchange("flood", "x" * 300))


# -- context -----------------------------------------------------------------------------------


async def test_context_reaches_server_code_with_each_turn(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    """The scripted `context` step streams `TurnInput.context`: what server code gets."""
    client = Client(http, proxy)
    await client.open(capabilities=["context"], context={"doc": "a.md"})
    await client.p.message("which?", **scenario("context"))
    assert (await client.p.turn())[-1]["content"] == '{"doc":"a.md"}'
    await client.p.numbered("context", context={"doc": "b.md", "line": 3})
    await client.p.message("and now?", **scenario("context"))
    assert (await client.p.turn())[-1]["content"] == '{"doc":"b.md","line":3}'
    # It stays with the session across a drop.
    await proxy.cut_all()
    await client.resume()
    await client.p.message("after a drop?", **scenario("context"))
    assert (await client.p.turn())[-1]["content"] == '{"doc":"b.md","line":3}'
    await flush(client.p)
    assert errors(client.p) == []
    await ledger(
        session_server,
        client,
        exchange("which?", '{"doc":"a.md"}')
        + exchange("and now?", '{"doc":"b.md","line":3}')
        + exchange("after a drop?", '{"doc":"b.md","line":3}'),
    )


async def test_context_without_the_capability_is_refused(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    ready = await client.open(capabilities=["tools"], context={"doc": "a.md"})
    assert "context" not in ready["capabilities"]
    seq = await client.p.numbered("context", context={"doc": "b.md"})
    refused = await client.p.recv_numbered()
    assert refused == {
        "type": "error",
        "seq": 1,
        "ref_seq": seq,
        "error": {"code": "INVALID_MESSAGE", "message": refused["error"]["message"]},
    }
    # The connection stays open, and neither context reached the session.
    await client.p.message("which?", **scenario("context"))
    assert (await client.p.turn())[-1]["content"] == "{}"
    await ledger(session_server, client, exchange("which?", "{}"))


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
    reply = "".join(f"p{i} " for i in range(10))
    contents = [f.get("content") for f in client.p.received if f["type"] in ("chunk", "done")]
    assert contents == [f"p{i} " for i in range(10)] + [reply]
    assert client.p.numbered_seqs() == list(range(1, 12))
    assert frames[-1]["type"] == "done"
    await ledger(session_server, client, exchange("go", reply))


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
    reply = 'status=completed result={"city":"Oslo"} error='
    assert frames[-1]["content"] == reply
    # Applied twice, the resent result would have been answered with an `error`.
    await flush(client.p)
    assert errors(client.p) == []
    await ledger(
        session_server, client, exchange("where", reply), tool_results={call_id: {"city": "Oslo"}}
    )


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
    await ledger(
        session_server, client, exchange("go", done["content"]), turns=[TurnState.CANCELLED]
    )


async def test_server_idle_close_is_4000(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    idle = {"PORTICO_SESSION_IDLE_TIMEOUT": "0.5", "PORTICO_HEARTBEAT_INTERVAL": "0.2"}
    server = ServerProcess(tmp_path, env=idle).start()
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
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
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
    await ledger(session_server, client, exchange("sound", ""))  # media are not archived


async def test_without_the_audio_capability_media_are_dropped(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
) -> None:
    client = Client(http, proxy)
    ready = await client.open(audio={"output": [PCM]})  # formats alone do not ask for it
    assert "audio" not in ready["capabilities"]
    assert "audio" not in ready  # null stays off the wire
    await client.p.message("sound", **scenario("media"))
    frames = await client.p.turn()
    assert [f["type"] for f in frames] == ["done"]
    assert client.p.binary == []
    await ledger(session_server, client, exchange("sound", ""))


async def test_a_drop_mid_item_loses_it_and_the_next_item_starts_fresh(
    http: aiohttp.ClientSession, proxy: FaultProxy, session_server: ServerProcess
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
    await ledger(session_server, client, exchange("sound", ""))
