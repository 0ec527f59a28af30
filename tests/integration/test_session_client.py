"""`SessionClient` against real `portico serve` processes over real sockets."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from portico.client import (
    AuthenticationError,
    ConnectError,
    ConnectionLostError,
    ConnectionStatus,
    ProtocolError,
    ReconnectPolicy,
    ResumeFailedError,
    ServerMessage,
    SessionClient,
    SessionClosedError,
    SessionError,
    SessionReplacedError,
)
from portico.protocols.session import frames as f
from support.archive import assert_ledger, wait_for_messages
from support.faultproxy import SERVER_TO_CLIENT, FaultProxy, Rule, close, suppress
from support.redis import SESSION_STATES, session_state
from support.server import SCRIPT, ServerProcess

SCRIPTED = ("--runtime", "scripted", "--script", str(SCRIPT))
# The server closes a connection silent for this long (4000), so an idle client
# that stays connected proves its pings get there.
SERVER_IDLE_TIMEOUT = 1.0
SHORT_ENV = {
    "PORTICO_SESSION_IDLE_TIMEOUT": str(SERVER_IDLE_TIMEOUT),
    "PORTICO_HEARTBEAT_INTERVAL": "0.25",
    "PORTICO_RESUME_WINDOW": "10",
}
HEARTBEAT = 0.2  # the client's ping interval in these tests; dead after 2.5 of them
FAST_RETRY = ReconnectPolicy(initial=0.05, maximum=0.4, give_up_after=15.0)
WITHIN = 10.0  # seconds any single step of a test may take
TOOL_REPLY = "status={status} result={result} error={error}"


@pytest.fixture(scope="module", params=SESSION_STATES)
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    with session_state(request.param) as state_env:
        process = ServerProcess(
            tmp_path_factory.mktemp("session-client"),
            args=SCRIPTED,
            env={**SHORT_ENV, **state_env},
        ).start()
        yield process
        process.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server of the test's own, for tests that restart or pause it."""
    process = ServerProcess(tmp_path / "server", args=SCRIPTED, env=SHORT_ENV).start()
    yield process
    if process.process is not None:
        os.kill(process.process.pid, signal.SIGCONT)  # in case the test paused it
    process.stop()


def session_url(server: ServerProcess | FaultProxy) -> str:
    if isinstance(server, FaultProxy):
        return server.url("/v1/session")
    return f"ws://127.0.0.1:{server.port}/v1/session"


def make_client(server: ServerProcess | FaultProxy, **overrides: Any) -> SessionClient:
    """A client of `server`, or of the server behind a proxy."""
    settings: dict[str, Any] = {
        "heartbeat_interval": HEARTBEAT,
        "reconnect": FAST_RETRY,
        "connect_timeout": 2.0,
        "close_timeout": 2.0,
    }
    settings.update(overrides)
    return SessionClient(session_url(server), **settings)


@pytest.fixture
async def proxy(server: ServerProcess) -> AsyncIterator[FaultProxy]:
    async with FaultProxy(server.http_url) as running:
        yield running


class Statuses:
    """Collects `on_status` calls and lets a test wait for one."""

    def __init__(self) -> None:
        self.seen: list[ConnectionStatus] = []
        self._changed = asyncio.Event()

    def __call__(self, status: ConnectionStatus) -> None:
        self.seen.append(status)
        self._changed.set()

    def count(self, state: str, *, resumed: bool | None = None) -> int:
        return sum(
            1
            for status in self.seen
            if status.state == state and (resumed is None or status.resumed is resumed)
        )

    async def wait_for(self, state: str, count: int, *, resumed: bool | None = None) -> None:
        async with asyncio.timeout(WITHIN):
            while self.count(state, resumed=resumed) < count:
                await self._changed.wait()
                self._changed.clear()


def tool_reply(status: str, result: str = "", error: str = "") -> str:
    return TOOL_REPLY.format(status=status, result=result, error=error)


async def drain(client: SessionClient) -> list[ServerMessage]:
    """Everything the client's stream yields until it stops (or raises)."""
    async with asyncio.timeout(WITHIN):
        return [frame async for frame in client]


def kinds(frames: list[ServerMessage] | tuple[ServerMessage, ...]) -> list[str]:
    return [type(frame).__name__ for frame in frames]


# -- handshake and turns -------------------------------------------------------------------


async def test_connect_gets_ready_with_a_session_id_and_capabilities(
    server: ServerProcess,
) -> None:
    async with make_client(server) as client:
        assert client.session_id is not None
        assert client.session_id.startswith("sess-")
        assert set(client.capabilities) == {"resume", "tools", "context"}
        assert client.ready is not None
        assert client.ready.resumed is False
        assert client.connections == 1
    assert client.closed


async def test_ask_collects_the_streamed_reply(server: ServerProcess) -> None:
    async with make_client(server) as client, asyncio.timeout(WITHIN):
        reply = await client.ask("hi")
        assert reply.text == "Hello world"
        assert kinds(reply.frames) == ["Chunk", "Chunk", "Done"]
        assert [frame.seq for frame in reply.frames] == [1, 2, 3]
        assert {getattr(frame, "turn_id", None) for frame in reply.frames} == {reply.turn_id}
        assert reply.error is None
        assert not reply.cancelled


async def test_audio_items_come_with_the_reply_when_asked_for(server: ServerProcess) -> None:
    pcm = f.AudioFormat(codec="pcm16", sample_rate=24000, channels=1)
    async with make_client(server, audio_output=[pcm]) as client, asyncio.timeout(WITHIN):
        assert "audio" in client.capabilities
        assert client.ready is not None
        assert client.ready.audio == f.AudioChoice(output=pcm)
        reply = await client.ask("sound", metadata={"mock_scenario": "media"})
        assert kinds(reply.frames) == ["AudioStart", "AudioEnd", "Done"]
        (item,) = reply.audio
        assert item.complete
        assert item.turn_id == reply.turn_id
        assert item.format.mime_type == "audio/pcm"
        assert item.data == (bytes(range(256)) * 782)[:200000]
        assert client.take_audio(item.item_id) is None  # taken once


async def test_without_audio_output_media_never_arrive(server: ServerProcess) -> None:
    async with make_client(server) as client, asyncio.timeout(WITHIN):
        assert "audio" not in client.capabilities
        reply = await client.ask("sound", metadata={"mock_scenario": "media"})
        assert kinds(reply.frames) == ["Done"]
        assert reply.audio == ()


async def test_messages_outside_a_turn_object_arrive_by_iteration_in_order(
    server: ServerProcess,
) -> None:
    async with make_client(server) as client, asyncio.timeout(WITHIN):
        first = await client.send_message("one")
        assert first == 1
        texts: list[str] = []
        seqs: list[int] = []
        async for frame in client:
            seqs.append(frame.seq or 0)
            if isinstance(frame, f.Chunk):
                texts.append(frame.content)
            if isinstance(frame, f.Done):
                break
        assert "".join(texts) == "Hello world"
        assert seqs == [1, 2, 3]


async def test_a_message_during_a_turn_is_refused_and_routed_to_its_own_turn(
    server: ServerProcess,
) -> None:
    async with make_client(server) as client, asyncio.timeout(WITHIN):
        slow = await client.start_turn("slow", metadata={"mock_scenario": "slow"})
        refused = await client.ask("too early")
        assert refused.turn_id is None
        assert refused.error is not None
        assert refused.error.code == "TURN_IN_PROGRESS"
        error_frame = refused.frames[-1]
        # The refused message is the one after the slow turn's.
        assert isinstance(error_frame, f.Error)
        assert error_frame.ref_seq == slow.message_seq + 1
        finished = await slow.reply()
        assert finished.text == "a"
        assert kinds(finished.frames) == ["Chunk", "Done"]


async def test_interrupt_cancels_the_running_turn(server: ServerProcess) -> None:
    async with make_client(server) as client, asyncio.timeout(WITHIN):
        turn = await client.start_turn("slow", metadata={"mock_scenario": "slow"})
        first = await anext(turn)
        assert isinstance(first, f.Chunk)
        await client.interrupt()
        reply = await turn.reply()
        assert reply.cancelled
        assert reply.done is not None
        assert reply.done.content == "a"


async def test_a_failing_turn_ends_with_its_error(server: ServerProcess) -> None:
    async with make_client(server) as client, asyncio.timeout(WITHIN):
        reply = await client.ask("x", metadata={"mock_scenario": "fail"})
        assert reply.text == "partial"
        assert reply.error is not None
        assert reply.error.code == "PROVIDER_UNAVAILABLE"


async def test_send_context_is_accepted(server: ServerProcess) -> None:
    async with make_client(server, context={"doc": "a"}) as client, asyncio.timeout(WITHIN):
        await client.send_context({"doc": "b"})
        assert (await client.ask("hi")).text == "Hello world"
    assert client.closed


# -- the tool helper ------------------------------------------------------------------------


async def test_a_registered_tool_answers_the_call_and_the_turn_shows_it(
    server: ServerProcess,
) -> None:
    calls: list[dict[str, Any]] = []

    def get_location(**arguments: Any) -> dict[str, str]:
        calls.append(arguments)
        return {"city": "Paris"}

    client = make_client(server)
    client.register_tool("get_location", get_location, description="where the user is")
    async with client, asyncio.timeout(WITHIN):
        reply = await client.ask("where?", metadata={"mock_scenario": "tool"})
    assert reply.text == tool_reply("completed", '{"city":"Paris"}')
    assert calls == [{"query": "current"}]
    (call,) = reply.tool_calls
    assert call.name == "get_location"
    assert call.consent_message == "Allow location access?"
    assert call.categories == ("location",)


async def test_a_refused_consent_declines_the_call(server: ServerProcess) -> None:
    asked: list[str] = []

    async def consent(frame: f.ToolCall) -> bool:
        asked.append(frame.tool_call.consent_message or "")
        return False

    client = make_client(server)
    client.register_tool("get_location", lambda **_: "never run", consent=consent)
    async with client, asyncio.timeout(WITHIN):
        reply = await client.ask("where?", metadata={"mock_scenario": "tool"})
    assert reply.text == tool_reply("denied", error="declined by the user")
    assert asked == ["Allow location access?"]


async def test_a_tool_that_raises_answers_with_its_error(server: ServerProcess) -> None:
    async def get_location(**_: Any) -> str:
        raise LookupError("no fix yet")

    client = make_client(server)
    client.register_tool("get_location", get_location, consent=lambda frame: True)
    async with client, asyncio.timeout(WITHIN):
        reply = await client.ask("where?", metadata={"mock_scenario": "tool"})
    assert reply.text == tool_reply("error", error="no fix yet")


async def test_an_unregistered_tool_is_left_to_the_application(server: ServerProcess) -> None:
    async with make_client(server) as client, asyncio.timeout(WITHIN):
        turn = await client.start_turn("where?", metadata={"mock_scenario": "tool"})
        call = await anext(turn)
        assert isinstance(call, f.ToolCall)
        await client.nack_tool_call(call.tool_call.id, "not here")
        reply = await turn.reply()
    assert reply.text == tool_reply("denied", error="not here")


# -- reconnects ------------------------------------------------------------------------------


async def test_drops_mid_conversation_lose_and_duplicate_nothing(server: ServerProcess) -> None:
    statuses = Statuses()
    rounds = 6
    replies: list[list[ServerMessage]] = []
    async with make_client(server, on_status=statuses) as client, asyncio.timeout(4 * WITHIN):
        for index in range(rounds):
            # Each round drops one connection: the next must be up before it is dropped.
            # The reply the last drop cut can come whole from the dropped socket's read
            # buffer, while the client is still between connections: an abort then has
            # no connection to drop, and the round would not drop one.
            await statuses.wait_for("open", index + 1)
            turn = await client.start_turn(f"round {index}", metadata={"mock_scenario": "stream50"})
            if index % 2 == 0:
                client.abort_connection()  # before the message was even written
            frames: list[ServerMessage] = []
            async for frame in turn:
                frames.append(frame)
                if index % 2 == 1 and len(frames) == 2:
                    client.abort_connection()  # in the middle of the reply
            replies.append(frames)
        await statuses.wait_for("open", rounds + 1)
        session_id = client.session_id
        assert client.connections == rounds + 1
    assert statuses.count("open", resumed=True) == rounds
    assert all(status.close_code is None for status in statuses.seen if status.state == "dropped")
    seqs = [frame.seq for frames in replies for frame in frames]
    assert seqs == list(range(1, len(seqs) + 1))
    for frames in replies:
        assert kinds(frames) == ["Chunk"] * 5 + ["Done"]
        assert "".join(frame.content for frame in frames if isinstance(frame, f.Chunk)) == "c " * 5
    # Server side: each message took effect once (one user and one agent message a round).
    assert session_id is not None
    archived = await wait_for_messages(server.archive_path, session_id, 2 * rounds)
    assert [m.content for m in archived if m.role == "user"] == [
        f"round {i}" for i in range(rounds)
    ]
    assert len(archived) == 2 * rounds


async def test_a_tool_call_survives_a_drop_between_call_and_answer(server: ServerProcess) -> None:
    release = asyncio.Event()

    async def get_location(**_: Any) -> str:
        await release.wait()
        return "here"

    statuses = Statuses()
    client = make_client(server, on_status=statuses)
    client.register_tool("get_location", get_location)
    async with client, asyncio.timeout(WITHIN):
        turn = await client.start_turn("where?", metadata={"mock_scenario": "tool"})
        assert isinstance(await anext(turn), f.ToolCall)
        client.abort_connection()
        release.set()  # the result is numbered while the connection is down
        reply = await turn.reply()
        assert client.connections == 2
    assert reply.text == tool_reply("completed", '"here"')


async def test_idle_connection_stays_up_because_the_client_pings(server: ServerProcess) -> None:
    statuses = Statuses()
    async with make_client(server, on_status=statuses) as client:
        # Twice the server's idle timeout with nothing to say: only pings and pongs flow.
        await asyncio.sleep(2 * SERVER_IDLE_TIMEOUT)
        assert client.connections == 1
        assert statuses.count("dropped") == 0
        async with asyncio.timeout(WITHIN):
            assert (await client.ask("hi")).text == "Hello world"


async def test_a_client_pings_at_the_servers_shorter_heartbeat_and_is_never_idle_closed(
    server: ServerProcess,
) -> None:
    """The default 15 s interval against a server that closes silence after 1 s: the
    client pings at `ready.heartbeat_ms` (0.25 s) instead, so no 4000, no reconnect."""
    statuses = Statuses()
    async with make_client(server, on_status=statuses, heartbeat_interval=15.0) as client:
        assert client.ready is not None
        assert client.ready.heartbeat_ms == 250
        await asyncio.sleep(2 * SERVER_IDLE_TIMEOUT)
        assert [s.close_code for s in statuses.seen if s.state == "dropped"] == []
        assert client.connections == 1
        async with asyncio.timeout(WITHIN):
            assert (await client.ask("hi")).text == "Hello world"
    assert statuses.count("dropped") == 0


async def test_a_silent_server_is_detected_dead_and_the_client_resumes(
    own_server: ServerProcess,
) -> None:
    assert own_server.process is not None
    pid = own_server.process.pid
    statuses = Statuses()
    async with make_client(own_server, on_status=statuses, connect_timeout=1.0) as client:
        async with asyncio.timeout(WITHIN):
            assert (await client.ask("hi")).text == "Hello world"
        os.kill(pid, signal.SIGSTOP)
        try:
            # No pong for 2.5 intervals: the client drops the connection by itself, then
            # retries against a server that accepts TCP but never answers the upgrade.
            await statuses.wait_for("dropped", 1)
            await asyncio.sleep(1.5)
        finally:
            os.kill(pid, signal.SIGCONT)
        await statuses.wait_for("open", 1, resumed=True)
        assert statuses.seen[1].state == "dropped"
        assert statuses.seen[1].close_code is None
        async with asyncio.timeout(WITHIN):
            reply = await client.ask("again")
        assert reply.text == "Hello world"
        assert [frame.seq for frame in reply.frames] == [4, 5, 6]


# -- terminal conditions ----------------------------------------------------------------------


async def test_resume_after_a_server_restart_fails_and_is_raised(
    own_server: ServerProcess,
) -> None:
    statuses = Statuses()
    client = make_client(own_server, on_status=statuses)
    async with client:
        async with asyncio.timeout(WITHIN):
            assert (await client.ask("hi")).text == "Hello world"
        own_server.restart()  # same port, a process that never heard of the session
        with pytest.raises(ResumeFailedError) as raised:
            await drain(client)
        assert raised.value.code == "RESUME_FAILED"
        assert raised.value.close_code == 4404
        with pytest.raises(ResumeFailedError):
            await client.send_message("into a new session?")
        assert client.closed
    assert statuses.seen[-1].state == "closed"
    assert isinstance(statuses.seen[-1].error, ResumeFailedError)


async def test_resume_after_the_window_passed_fails(tmp_path: Path) -> None:
    window = 0.3
    env = {**SHORT_ENV, "PORTICO_RESUME_WINDOW": str(window)}
    process = ServerProcess(tmp_path / "server", args=SCRIPTED, env=env).start()
    try:
        late = ReconnectPolicy(initial=4 * window, jitter=0.0, give_up_after=WITHIN)
        async with make_client(process, reconnect=late) as client:
            client.abort_connection()
            with pytest.raises(ResumeFailedError):
                async with asyncio.timeout(WITHIN):
                    await client.ask("anyone?")
    finally:
        process.stop()


async def test_a_newer_connection_replaces_the_client(server: ServerProcess) -> None:
    async with make_client(server) as client, aiohttp.ClientSession() as http:
        ws = await http.ws_connect(session_url(server))
        await ws.send_json({"type": "hello", "session_id": client.session_id, "last_seq": 0})
        ready = await ws.receive_json(timeout=WITHIN)
        assert ready["type"] == "ready"
        assert ready["resumed"] is True
        with pytest.raises(SessionReplacedError):
            await drain(client)
        await ws.close()


async def test_after_end_iteration_stops_and_sending_is_refused(server: ServerProcess) -> None:
    async with make_client(server) as client, asyncio.timeout(WITHIN):
        await client.ask("hi")
        assert await client.end() is True
        assert [frame async for frame in client] == []
        with pytest.raises(SessionClosedError):
            await client.send_message("after the end")


async def test_an_ended_session_cannot_be_resumed(server: ServerProcess) -> None:
    async with make_client(server) as client, asyncio.timeout(WITHIN):
        session_id = client.session_id
        await client.end()
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(session_url(server))
        await ws.send_json({"type": "hello", "session_id": session_id, "last_seq": 0})
        answer = await ws.receive_json(timeout=WITHIN)
        assert answer["error"]["code"] == "RESUME_FAILED"
        await ws.receive(timeout=WITHIN)
        assert ws.close_code == 4404


async def test_an_unreachable_server_fails_the_first_connect(server: ServerProcess) -> None:
    client = SessionClient("ws://127.0.0.1:9/v1/session", connect_timeout=2.0)
    with pytest.raises(ConnectError):
        async with client:
            pass


# -- authentication ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {**SHORT_ENV, "PORTICO_AUTH": "apikey", "PORTICO_API_KEYS": "good-token=alice"}
    process = ServerProcess(tmp_path_factory.mktemp("session-auth"), args=SCRIPTED, env=env).start()
    yield process
    process.stop()


async def test_a_wrong_credential_raises_authentication_error(auth_server: ServerProcess) -> None:
    with pytest.raises(AuthenticationError) as raised:
        async with make_client(auth_server, credential="bad-token"):
            pass
    assert raised.value.close_code == 4401


async def test_a_credential_provider_gets_a_second_chance(auth_server: ServerProcess) -> None:
    tokens = iter(["expired-token", "good-token"])
    provided: list[str] = []

    async def provider() -> str:
        provided.append(next(tokens))
        return provided[-1]

    async with make_client(auth_server, credential_provider=provider) as client:
        async with asyncio.timeout(WITHIN):
            assert (await client.ask("hi")).text == "Hello world"
    assert provided == ["expired-token", "good-token"]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_a_shared_http_session_is_left_open(
    server: ServerProcess, http: aiohttp.ClientSession
) -> None:
    async with make_client(server, http=http) as client, asyncio.timeout(WITHIN):
        assert (await client.ask("hi")).text == "Hello world"
    assert not http.closed


# -- close codes, through the fault proxy (spec §10) ------------------------------------------


@pytest.mark.parametrize("code", [1001, 1009, 4000, 4400, 4408, 4429])
async def test_a_close_that_asks_for_a_resume_is_resumed(
    server: ServerProcess, proxy: FaultProxy, code: int
) -> None:
    """The proxy closes the client's side with `code` mid-reply (the server sees the
    client leave): the client resumes and the reply arrives whole, once."""
    proxy.add_rule(Rule(close(code, "test"), direction=SERVER_TO_CLIENT, type="chunk", nth=2))
    statuses = Statuses()
    async with make_client(proxy, on_status=statuses) as client, asyncio.timeout(WITHIN):
        reply = await client.ask("hi")
        session_id = client.session_id
    assert reply.text == "Hello world"
    assert [frame.seq for frame in reply.frames] == [1, 2, 3]
    assert [s.close_code for s in statuses.seen if s.state == "dropped"] == [code]
    assert statuses.count("open", resumed=True) == 1
    assert session_id is not None
    await assert_ledger(
        server.archive_path, session_id, [("user", "hi"), ("assistant", "Hello world")]
    )


@pytest.mark.parametrize("code", [1009, 4400])
async def test_three_client_fault_closes_in_a_row_stop_with_protocol_error(
    server: ServerProcess, proxy: FaultProxy, code: int
) -> None:
    """Resuming resends the same frames: refused three times in a row is a client bug."""
    statuses = Statuses()
    async with make_client(proxy, on_status=statuses) as client:
        proxy.add_rule(Rule(close(code), direction=SERVER_TO_CLIENT, type="ready", times=None))
        client.abort_connection()
        with pytest.raises(ProtocolError) as raised:
            await drain(client)
    assert raised.value.close_code == code
    assert [s.close_code for s in statuses.seen if s.state == "dropped"] == [None, code, code]
    closes = proxy.events.select(SERVER_TO_CLIENT, kind="close", action="close")
    assert [event.code for event in closes] == [code] * 3


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (1000, SessionClosedError),
        (4401, AuthenticationError),
        (4404, ResumeFailedError),
        (4409, SessionReplacedError),
    ],
)
async def test_a_close_that_means_stop_stops_the_client(
    server: ServerProcess, proxy: FaultProxy, code: int, error: type[SessionError]
) -> None:
    proxy.add_rule(Rule(close(code), direction=SERVER_TO_CLIENT, type="chunk"))
    statuses = Statuses()
    async with make_client(proxy, on_status=statuses) as client, asyncio.timeout(WITHIN):
        with pytest.raises(error):
            await client.ask("hi")
        assert client.closed
    assert statuses.count("open") == 1  # no resume was tried
    assert statuses.count("dropped") == 0
    assert len(proxy.connections) == 1


async def test_the_client_gives_up_after_give_up_after(server: ServerProcess) -> None:
    proxy = await FaultProxy(server.http_url).start()
    policy = ReconnectPolicy(initial=0.05, maximum=0.1, give_up_after=0.6)
    statuses = Statuses()
    async with make_client(proxy, reconnect=policy, on_status=statuses) as client:
        await proxy.stop()  # its port refuses every connection from now on
        with pytest.raises(ConnectionLostError):
            await drain(client)
    waits = [s.retry_in for s in statuses.seen if s.state == "dropped"]
    assert len(waits) >= 3
    assert all(wait is not None and 0.025 <= wait <= 0.1 for wait in waits)


# -- the README's example ---------------------------------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "ws://127.0.0.1:8080/v1/session"


def test_the_readme_session_client_example_runs(server: ServerProcess) -> None:
    section = README.read_text(encoding="utf-8").split("## Python client", 1)[1]
    section = section.split("\n## ", 1)[0]
    (snippet,) = re.findall(r"```python\n(.+?)\n```", section, re.DOTALL)
    assert README_URL in snippet
    result = subprocess.run(
        [sys.executable, "-c", snippet.replace(README_URL, session_url(server))],
        capture_output=True,
        text=True,
        timeout=WITHIN,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "Hello world"  # `ask`: the scripted default reply
    assert [line.split(" ", 1)[0] for line in lines[1:]] == ["Chunk", "Chunk", "Done"]


# -- continuing a conversation (hello.continue) ------------------------------------------------


async def test_continue_after_restart_keeps_the_conversation_and_what_was_sent_meanwhile(
    own_server: ServerProcess,
) -> None:
    """Opt-in: after a failed resume the client continues the same conversation in a new
    numbering, and a message sent while the server was down reaches the new server."""
    statuses = Statuses()
    client = make_client(own_server, on_status=statuses, continue_after_restart=True)
    async with client:
        async with asyncio.timeout(WITHIN):
            assert (await client.ask("before")).text == "Hello world"
        session_id = client.session_id
        await asyncio.to_thread(own_server.stop)
        await statuses.wait_for("dropped", 1)
        turn = await client.start_turn("typed while down")  # no connection is up
        await asyncio.to_thread(own_server.start)
        async with asyncio.timeout(WITHIN):
            assert (await turn.reply()).text == "Hello world"
            assert (await client.ask("after")).text == "Hello world"
        assert client.session_id == session_id
        assert [s.continued for s in statuses.seen if s.state == "open"] == [False, True]
    assert session_id is not None
    messages = await wait_for_messages(own_server.archive_path, session_id, 6)
    assert [m.content for m in messages if m.role == "user"] == [
        "before",
        "typed while down",
        "after",
    ]


async def test_continue_session_opens_by_continuing_an_archived_conversation(
    server: ServerProcess,
) -> None:
    async with make_client(server) as first:
        async with asyncio.timeout(WITHIN):
            await first.ask("first client")
        session_id = first.session_id
    assert session_id is not None
    statuses = Statuses()
    async with make_client(server, continue_session=session_id, on_status=statuses) as second:
        assert second.session_id == session_id
        assert statuses.seen[0].continued
        async with asyncio.timeout(WITHIN):
            assert (await second.ask("second client")).text == "Hello world"
    messages = await wait_for_messages(server.archive_path, session_id, 4)
    assert [m.content for m in messages if m.role == "user"] == ["first client", "second client"]


async def test_continue_session_of_an_unknown_id_fails_to_connect(server: ServerProcess) -> None:
    with pytest.raises(ConnectError) as raised:
        async with make_client(server, continue_session="sess-unknown"):
            pass
    assert raised.value.close_code == 4404


async def test_a_turn_cut_by_a_killed_server_ends_with_resume_failed_and_the_client_goes_on(
    own_server: ServerProcess,
) -> None:
    """The old numbering owed the rest of the turn: it is never replayed, the turn ends
    with an error saying so, and the conversation goes on in the new numbering."""
    statuses = Statuses()
    client = make_client(own_server, on_status=statuses, continue_after_restart=True)
    async with client:
        turn = await client.start_turn("slow", metadata={"mock_scenario": "slow"})
        async with asyncio.timeout(WITHIN):
            first = await anext(turn)
            assert isinstance(first, f.Chunk)
            await asyncio.to_thread(own_server.stop, signal.SIGKILL)
            await asyncio.to_thread(own_server.start)
            ending = [frame async for frame in turn]
            assert (await client.ask("after")).text == "Hello world"
        assert len(ending) == 1
        assert isinstance(ending[0], f.Error)
        assert ending[0].turn_id == first.turn_id
        assert ending[0].error.code == "RESUME_FAILED"
        assert ending[0].error.details == {"reason": "continued"}
        assert [s.continued for s in statuses.seen if s.state == "open"] == [False, True]


# -- idempotency keys ----------------------------------------------------------------------


async def test_every_message_has_a_key_and_one_sent_again_is_answered_from_the_archive(
    server: ServerProcess,
) -> None:
    async with make_client(server) as client:
        async with asyncio.timeout(WITHIN):
            turn = await client.start_turn("only once")
            first = await turn.reply()
            again = await client.ask("only once", client_id=turn.client_id)
        session_id = client.session_id
    assert session_id is not None
    assert turn.client_id.startswith("cm-")
    assert again.duplicate is not None
    assert (again.duplicate["turn_id"], again.duplicate["turn_state"]) == (
        first.turn_id,
        "completed",
    )
    assert again.text == first.text == "Hello world"
    messages = await wait_for_messages(server.archive_path, session_id, 2)
    assert [(m.role, m.client_id) for m in messages] == [
        ("user", turn.client_id),
        ("assistant", ""),
    ]


async def test_a_key_sent_again_while_its_turn_runs_follows_that_turn(
    server: ServerProcess,
) -> None:
    """A second client continues the conversation while the first one's turn runs and
    sends that message again with its key: it gets the running turn, not a new one."""
    async with make_client(server) as first:
        async with asyncio.timeout(WITHIN):
            turn = await first.start_turn("slow", metadata={"mock_scenario": "slow"})
            assert isinstance(await anext(turn), f.Chunk)
        session_id = first.session_id
        async with make_client(server, continue_session=session_id) as second:
            async with asyncio.timeout(WITHIN):
                reply = await second.ask("slow", client_id=turn.client_id)
    assert reply.turn_id == turn.turn_id
    assert isinstance(reply.frames[0], f.Error)  # the notice, then the turn's own end
    assert reply.frames[0].error.code == "DUPLICATE_MESSAGE"
    assert reply.done is not None
    assert session_id is not None
    messages = await wait_for_messages(server.archive_path, session_id, 2)
    assert [m.role for m in messages] == ["user", "assistant"]


async def test_a_message_a_killed_server_had_archived_is_sent_again_and_taken_once(
    own_server: ServerProcess,
) -> None:
    """Its ack and reply never arrived; after the restart the client sends it again in
    the new numbering with its key, and its turn ends with the archived answer."""
    async with FaultProxy(own_server.http_url) as proxy:
        hidden = proxy.add_rule(
            Rule(suppress(), direction=SERVER_TO_CLIENT, type={"ack", "chunk", "done"}, times=None)
        )
        async with make_client(proxy, continue_after_restart=True) as client:
            turn = await client.start_turn("only once")
            session_id = client.session_id
            assert session_id is not None
            await wait_for_messages(own_server.archive_path, session_id, 2)
            await asyncio.to_thread(own_server.stop, signal.SIGKILL)
            proxy.remove_rule(hidden)
            await asyncio.to_thread(own_server.start)
            async with asyncio.timeout(WITHIN):
                reply = await turn.reply()
    assert reply.duplicate is not None
    assert reply.duplicate["turn_state"] == "completed"
    assert reply.text == "Hello world"
    await assert_ledger(
        own_server.archive_path, session_id, [("user", "only once"), ("assistant", "Hello world")]
    )
