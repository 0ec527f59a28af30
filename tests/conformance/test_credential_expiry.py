"""Credential expiry and refresh on a real `portico serve --auth jwt` (spec identity.md).

Tokens are minted here with lifetimes of seconds; the server's margin
(`PORTICO_CREDENTIAL_EXPIRY_MARGIN`) is shortened to match, so each rule plays out in
a few seconds. Every wait is bounded; the assertions compare when the close came
with the token's own `exp`, which is the rule under test.

On each protocol: an idle connection is closed `4401` "credential expired" before
its token's `exp`; the close waits for a running turn; a refresh with a later token
moves the deadline; a refresh that breaks a rule is ignored, with no reply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import jwt
import pytest

from portico.client import ConnectionStatus, ReconnectPolicy, RpcClient, SessionClient
from support.jwks import AUDIENCE, Issuer, served_issuer
from support.rpc import RpcClosed, RpcProbe
from support.server import ServerProcess
from support.session import SessionProbe

MARGIN = 2.0  # seconds before `exp` the server closes (PORTICO_CREDENTIAL_EXPIRY_MARGIN)
LIFE = 6  # seconds a short-lived token lives: it is closed at about 4
LONGER = 12
BOUND = 30.0  # no wait in this module is longer
SLOW_WORD_DELAY = "0.01"  # the demo's `slow` reply then streams for about 8 s


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    yield from served_issuer()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, issuer: Issuer) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("portico-expiry"),
        args=("--auth", "jwt", "--runtime", "demo"),
        env={
            "PORTICO_JWT_ISSUER": issuer.url,
            "PORTICO_JWT_AUDIENCE": AUDIENCE,
            "PORTICO_JWT_SESSION_CLAIM": "sid",
            "PORTICO_CREDENTIAL_EXPIRY_MARGIN": str(MARGIN),
            "PORTICO_DEMO_WORD_DELAY": SLOW_WORD_DELAY,
        },
    ).start()
    yield process
    process.stop()


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession() as session:
        yield session


class Tokens:
    """Tokens of one user and one device (`sid`), each expiring `life` s from now."""

    def __init__(self, issuer: Issuer, user: str) -> None:
        self.issuer = issuer
        self.user = user

    def token(self, life: int = LIFE, *, sub: str | None = None, sid: str = "dev-1") -> str:
        exp = int(time.time()) + life
        return self.issuer.token(sub=sub or self.user, sid=sid, exp=exp)


def exp_of(token: str) -> int:
    exp: int = jwt.decode(token, options={"verify_signature": False})["exp"]
    return exp


def bad_refreshes(tokens: Tokens, current: str) -> list[str]:
    """Every way a refresh is ignored: a repeat, an earlier exp, another principal,
    another session-binding value, and a token that does not verify."""
    return [
        current,
        tokens.token(LIFE - 2),
        tokens.token(LONGER, sub=f"{tokens.user}-other"),
        tokens.token(LONGER, sid="dev-2"),
        tokens.token(LONGER)[:-4] + "AAAA",
    ]


# -- /ws ----------------------------------------------------------------------------------


def ws_url(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/ws?agent=default"


async def ws_open(http: aiohttp.ClientSession, server: ServerProcess, token: str) -> Any:
    ws = await http.ws_connect(ws_url(server), headers={"Authorization": f"Bearer {token}"})
    assert (await ws.receive_json(timeout=BOUND))["type"] == "connected"
    return ws


async def ws_until_close(ws: Any) -> tuple[int | None, str, list[dict[str, Any]]]:
    """Frames until the server's close; its code, reason and the frames on the way."""
    frames: list[dict[str, Any]] = []
    async with asyncio.timeout(BOUND):
        while True:
            msg = await ws.receive()
            if msg.type is not aiohttp.WSMsgType.TEXT:
                return ws.close_code, msg.extra or "", frames
            frames.append(msg.json())


async def test_ws_idle_connection_is_closed_4401_before_exp(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    token = Tokens(issuer, "ws-idle").token()
    ws = await ws_open(http, server, token)
    code, reason, frames = await ws_until_close(ws)
    assert (code, reason) == (4401, "credential expired")
    assert time.time() < exp_of(token)
    assert frames == []


async def test_ws_close_waits_for_the_running_turn_and_late_messages_are_refused(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    token = Tokens(issuer, "ws-turn").token()
    ws = await ws_open(http, server, token)
    await ws.send_json({"type": "message", "content": "slow"})
    frames: list[dict[str, Any]] = []
    late_sent = False
    async with asyncio.timeout(BOUND):
        while not frames or frames[-1]["type"] != "done":
            msg = await ws.receive()
            assert msg.type is aiohttp.WSMsgType.TEXT, (msg, frames[-3:])
            frames.append(msg.json())
            if not late_sent and time.time() > exp_of(token) + 0.5:
                await ws.send_json({"type": "message", "content": "after the deadline"})
                late_sent = True
    assert late_sent, "the turn ended before the deadline: nothing was deferred"
    refused = [f for f in frames if f["type"] == "error"]
    assert [f["error"]["code"] for f in refused] == ["CREDENTIAL_EXPIRED"]
    code, reason, after = await ws_until_close(ws)
    assert (code, reason) == (4401, "credential expired")
    assert all(f["type"] != "done" for f in after)  # the late message started nothing


async def test_ws_credential_refresh_moves_the_deadline(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    tokens = Tokens(issuer, "ws-refresh")
    first = tokens.token()
    ws = await ws_open(http, server, first)
    later = tokens.token(LONGER)
    await ws.send_json({"type": "credential_refresh", "token": later})
    code, reason, frames = await ws_until_close(ws)
    assert (code, reason) == (4401, "credential expired")
    assert exp_of(first) < time.time() < exp_of(later)
    assert frames == []  # no reply to the refresh
    log = server.log_path.read_text()
    assert "credential refreshed protocol=omnia" in log
    assert later not in log


async def test_ws_refreshes_that_break_a_rule_are_ignored(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    tokens = Tokens(issuer, "ws-bad-refresh")
    first = tokens.token()
    ws = await ws_open(http, server, first)
    for token in bad_refreshes(tokens, first):
        await ws.send_json({"type": "credential_refresh", "token": token})
    code, reason, frames = await ws_until_close(ws)
    assert (code, reason) == (4401, "credential expired")
    assert time.time() < exp_of(first)
    assert frames == []


# -- /v1/session --------------------------------------------------------------------------


async def session_open(
    http: aiohttp.ClientSession, server: ServerProcess, token: str
) -> SessionProbe:
    probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
    ready = await probe.hello(credential=token, agent="default")
    assert ready["type"] == "ready", ready
    return probe


async def session_close(probe: SessionProbe) -> tuple[int | None, str, list[dict[str, Any]]]:
    before = len(probe.received)
    code, reason = await probe.closed(BOUND)
    frames = [f for f in probe.received[before:] if f["type"] not in ("ack", "pong")]
    return code, reason, frames


async def test_session_idle_connection_is_closed_4401_before_exp_and_resumes(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    tokens = Tokens(issuer, "session-idle")
    token = tokens.token()
    probe = await session_open(http, server, token)
    session_id = probe.received[0]["session_id"]
    code, reason, frames = await session_close(probe)
    assert (code, reason) == (4401, "credential expired")
    assert time.time() < exp_of(token)
    assert frames == []
    # The resume window keeps the session: a fresh token resumes it.
    again = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
    ready = await again.hello(credential=tokens.token(LONGER), session_id=session_id, last_seq=0)
    assert (ready["type"], ready.get("resumed")) == ("ready", True), ready
    await again.ws.close()


async def test_session_close_waits_for_the_running_turn(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    token = Tokens(issuer, "session-turn").token()
    probe = await session_open(http, server, token)
    await probe.message("slow")
    frames = await probe.turn(BOUND)
    assert frames[-1]["type"] == "done"
    assert time.time() > exp_of(token), "the turn ended before the deadline"
    code, reason, _ = await session_close(probe)
    assert (code, reason) == (4401, "credential expired")


async def test_session_message_after_the_deadline_is_credential_expired_and_kept(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    """Sent during a turn that outlives the deadline: refused, not handled, so a resume
    with a fresh token has it resent and answered (nothing is lost)."""
    tokens = Tokens(issuer, "session-late")
    token = tokens.token()
    probe = await session_open(http, server, token)
    session_id = probe.received[0]["session_id"]
    await probe.message("slow")
    async with asyncio.timeout(BOUND):
        while time.time() <= exp_of(token) + 0.5:
            await probe.recv_numbered(BOUND)
    late = await probe.message("echo kept")
    code, _ = await probe.closed(BOUND)
    assert code == 4401
    errors = [f for f in probe.received if f["type"] == "error" and "seq" not in f]
    assert [f["error"]["code"] for f in errors] == ["CREDENTIAL_EXPIRED"]
    again = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
    again.handled = probe.handled
    ready = await again.hello(
        credential=tokens.token(LONGER), session_id=session_id, last_seq=probe.handled
    )
    assert ready["type"] == "ready", ready
    slow_rest = await again.turn(BOUND)  # the slow reply's rest, resent
    assert slow_rest[-1]["type"] == "done"
    await again.message("echo kept", seq=late)
    reply = await again.turn(BOUND)
    assert reply[-1]["type"] == "done"
    assert "kept" in reply[-1]["content"]
    await again.ws.close()


async def test_session_credential_message_moves_the_deadline(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    tokens = Tokens(issuer, "session-refresh")
    first = tokens.token()
    probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
    session_id = (await probe.hello(credential=first, agent="default"))["session_id"]
    later = tokens.token(LONGER)
    await probe.send({"type": "credential", "credential": later})
    code, reason, frames = await session_close(probe)
    assert (code, reason) == (4401, "credential expired")
    assert exp_of(first) < time.time() < exp_of(later)
    assert frames == []
    assert later not in server.log_path.read_text()
    # The refresh is on the session's trace, its owner's to read; nothing of the token.
    rpc = await rpc_open(http, server, tokens.token(LONGER))
    async with asyncio.timeout(BOUND):
        while True:
            trace = await rpc.call("v1.session.trace", {"session_id": session_id})
            refreshed = [i for i in trace["items"] if i["type"] == "credential.refreshed"]
            if refreshed:
                break
            await asyncio.sleep(0.05)
    assert [item["data"] for item in refreshed] == [{"protocol": "session"}]
    await rpc.ws.close()


async def test_session_credentials_that_break_a_rule_are_ignored(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    tokens = Tokens(issuer, "session-bad-refresh")
    first = tokens.token()
    probe = await session_open(http, server, first)
    for token in bad_refreshes(tokens, first):
        await probe.send({"type": "credential", "credential": token})
    code, reason, frames = await session_close(probe)
    assert (code, reason) == (4401, "credential expired")
    assert time.time() < exp_of(first)
    assert frames == []


# -- /v1/rpc ------------------------------------------------------------------------------


async def rpc_open(http: aiohttp.ClientSession, server: ServerProcess, token: str) -> RpcProbe:
    probe = await RpcProbe.open(http, f"ws://127.0.0.1:{server.port}/v1/rpc", token=token)
    assert probe.connected["type"] == "connected", probe.connected
    return probe


async def rpc_close(probe: RpcProbe) -> tuple[int | None, list[dict[str, Any]]]:
    frames: list[dict[str, Any]] = []
    async with asyncio.timeout(BOUND):
        while True:
            try:
                frames.append(await probe.next_frame(BOUND))
            except RpcClosed as closed:
                return closed.code, frames


async def test_rpc_idle_connection_is_closed_4401_before_exp(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    token = Tokens(issuer, "rpc-idle").token()
    probe = await rpc_open(http, server, token)
    code, frames = await rpc_close(probe)
    assert code == 4401
    assert time.time() < exp_of(token)
    assert frames == []


async def test_rpc_close_waits_for_the_running_turn_and_late_requests_are_refused(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    token = Tokens(issuer, "rpc-turn").token()
    probe = await rpc_open(http, server, token)
    sent = await probe.call("v1.message.send", {"content_data": "slow", "client_id": "c-slow"})
    session_id = sent["session_id"]
    async with asyncio.timeout(BOUND):
        while time.time() <= exp_of(token) + 0.5:
            await probe.next_frame(BOUND)
    refused = await probe.error("v1.session.list")
    assert refused["code"] == "credential_expired"
    turn = await probe.wait_turn_end(session_id)
    assert turn["status"] == "completed"
    code, _ = await rpc_close(probe)
    assert code == 4401


async def test_rpc_credential_message_moves_the_deadline(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    tokens = Tokens(issuer, "rpc-refresh")
    first = tokens.token()
    probe = await rpc_open(http, server, first)
    later = tokens.token(LONGER)
    await probe.send({"type": "credential", "credential": later})
    code, frames = await rpc_close(probe)
    assert code == 4401
    assert exp_of(first) < time.time() < exp_of(later)
    assert frames == []


async def test_rpc_credentials_that_break_a_rule_are_ignored(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    tokens = Tokens(issuer, "rpc-bad-refresh")
    first = tokens.token()
    probe = await rpc_open(http, server, first)
    for token in bad_refreshes(tokens, first):
        await probe.send({"type": "credential", "credential": token})
    code, frames = await rpc_close(probe)
    assert code == 4401
    assert time.time() < exp_of(first)
    assert frames == []


# -- the Python SDK -----------------------------------------------------------------------


class Provider:
    """The app's token callback: a fresh short-lived token each call, after `stale`
    calls that hand back the first token again (an app whose token was not renewed)."""

    def __init__(self, tokens: Tokens, *, stale: int = 0) -> None:
        self.tokens = tokens
        self.stale = stale
        self.issued: list[str] = []

    async def __call__(self) -> str:
        if self.issued and len(self.issued) <= self.stale:
            self.issued.append(self.issued[0])
        else:
            self.issued.append(self.tokens.token())
        return self.issued[-1]


async def until(condition: Any, what: str) -> None:
    """Poll `condition()` until it holds, within BOUND."""
    async with asyncio.timeout(BOUND):
        while not condition():  # noqa: ASYNC110 (a clock or another task's state)
            await asyncio.sleep(0.05)


def refreshed_in_log(server: ServerProcess, protocol: str, principal: str) -> bool:
    log = server.log_path.read_text()
    return any(
        "credential refreshed" in line and f"protocol={protocol}" in line and principal in line
        for line in log.splitlines()
    )


async def test_sdk_session_client_refreshes_through_its_callback(
    server: ServerProcess, issuer: Issuer
) -> None:
    provider = Provider(Tokens(issuer, "sdk-session-refresh"))
    statuses: list[ConnectionStatus] = []
    url = f"ws://127.0.0.1:{server.port}/v1/session"
    async with SessionClient(url, credential_provider=provider, on_status=statuses.append) as c:
        assert "one" in (await asyncio.wait_for(c.ask("echo one"), BOUND)).text
        first_exp = exp_of(provider.issued[0])
        await until(lambda: time.time() > first_exp + 0.5, "the first token's exp")
        assert "two" in (await asyncio.wait_for(c.ask("echo two"), BOUND)).text
        assert c.connections == 1
    assert [s.state for s in statuses][:1] == ["open"]
    assert "dropped" not in [s.state for s in statuses]
    assert len(provider.issued) >= 2
    assert refreshed_in_log(server, "session", "sdk-session-refresh")
    assert all(token not in server.log_path.read_text() for token in provider.issued)


async def test_sdk_session_client_resumes_after_a_4401_with_nothing_lost(
    server: ServerProcess, issuer: Issuer
) -> None:
    """The callback has nothing newer at refresh time: the server closes 4401; a
    message sent while disconnected is resent on the resumed session and answered."""
    provider = Provider(Tokens(issuer, "sdk-session-4401"), stale=1)
    statuses: list[ConnectionStatus] = []
    url = f"ws://127.0.0.1:{server.port}/v1/session"
    policy = ReconnectPolicy(initial=1.0, jitter=0.0)
    async with SessionClient(
        url, credential_provider=provider, on_status=statuses.append, reconnect=policy
    ) as client:
        session_id = client.session_id
        await until(lambda: any(s.state == "dropped" for s in statuses), "the 4401")
        dropped = next(s for s in statuses if s.state == "dropped")
        assert dropped.close_code == 4401
        turn = await client.start_turn("echo kept")  # while disconnected
        reply = await asyncio.wait_for(turn.reply(), BOUND)
        assert "kept" in reply.text
        assert client.session_id == session_id
        assert client.connections == 2
        assert client.ready is not None
        assert client.ready.resumed


async def test_sdk_rpc_client_refreshes_through_its_callback(
    server: ServerProcess, issuer: Issuer
) -> None:
    provider = Provider(Tokens(issuer, "sdk-rpc-refresh"))
    url = f"ws://127.0.0.1:{server.port}/v1/rpc"
    async with RpcClient(url, token_provider=provider, request_timeout=BOUND) as client:
        first_exp = exp_of(provider.issued[0])
        await until(lambda: time.time() > first_exp + 0.5, "the first token's exp")
        await client.session_list()
        assert client.connections == 1
    assert refreshed_in_log(server, "rpc", "sdk-rpc-refresh")


async def test_sdk_rpc_client_reconnects_after_a_4401_and_recovers_its_stream(
    server: ServerProcess, issuer: Issuer
) -> None:
    provider = Provider(Tokens(issuer, "sdk-rpc-4401"), stale=1)
    url = f"ws://127.0.0.1:{server.port}/v1/rpc"
    async with RpcClient(url, token_provider=provider, request_timeout=BOUND) as client:
        sent = await client.message_send("echo before")
        await until(lambda: client.connections == 2, "the reconnect after the 4401")
        assert client.recovered
        again = await client.message_send("echo after", server_session_id=sent.result.session_id)
        assert again.result.session_id == sent.result.session_id
        page = await client.message_list(sent.result.session_id)
        contents = [m.content_data for m in page.items]
        assert any("before" in str(c) for c in contents)
