"""Drain on SIGTERM, on a real server process: every protocol's client is told to move
(close 1001) as soon as no turn runs on its connection, running turns finish within
`drain_timeout` or end interrupted with one terminal frame, nothing new is admitted,
and the process exits 0."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from portico.domain.states import TurnState
from support.archive import open_archive
from support.omnia import OmniaClient, scenario
from support.rpc import RpcProbe
from support.server import SCRIPT, ServerProcess
from support.session import SessionProbe

EXIT_WITHIN = 30.0  # a deadline on the process's exit, not a measured figure
# Two principals: an RPC connection carries its principal's turns, so the idle RPC
# client must be someone else's for it to be idle.
ALICE, BOB = "alice-key", "bob-key"


def draining_server(tmp_path: Path, *, drain_timeout: float) -> ServerProcess:
    return ServerProcess(
        tmp_path / "data",
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={
            "PORTICO_DRAIN_TIMEOUT": str(drain_timeout),
            "PORTICO_AUTH": "apikey",
            "PORTICO_API_KEYS": f"{ALICE}=alice,{BOB}=bob",
        },
    ).start()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def held_turn(
    http: aiohttp.ClientSession, server: ServerProcess
) -> tuple[OmniaClient, str, str]:
    """Alice's /ws client whose turn waits for its answer to a client tool call: it runs
    until the test answers, however long the drain takes to get there. The client, the
    call id, the session id."""
    client = OmniaClient(await http.ws_connect(server.ws_url, headers=bearer(ALICE)))
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "message", "content": "where?", **scenario("tool")})
    call = await client.recv()
    assert call["type"] == "tool_call", call
    call_id = call["tool_call"]["id"]
    await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call_id}})
    return client, call_id, session_id


async def close_code(ws: aiohttp.ClientWebSocketResponse) -> int | None:
    """Read to the close frame; its code (frames before it are skipped)."""
    while True:
        msg = await ws.receive(timeout=10)
        if msg.type is aiohttp.WSMsgType.CLOSE:
            return int(msg.data)
        if msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
            return ws.close_code


async def readyz(http: aiohttp.ClientSession, server: ServerProcess) -> tuple[int, Any]:
    async with http.get(server.http_url + "/readyz") as response:
        return response.status, await response.json()


async def exit_status(server: ServerProcess) -> int:
    process = server.process
    assert process is not None
    return await asyncio.to_thread(process.wait, EXIT_WITHIN)


async def test_idle_clients_of_every_protocol_move_at_once_and_the_turn_finishes_first(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = draining_server(tmp_path, drain_timeout=60)
    try:
        busy, call_id, session_id = await held_turn(http, server)
        idle_ws = OmniaClient(await http.ws_connect(server.ws_url, headers=bearer(ALICE)))
        await idle_ws.connected()
        idle_session = await SessionProbe.connect(http, server.http_url + "/v1/session")
        assert (await idle_session.hello(credential=ALICE))["type"] == "ready"
        idle_rpc = await RpcProbe.open(http, server.http_url + "/v1/rpc", token=BOB)
        assert idle_rpc.connected["type"] == "connected"
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)

        # The idle ones are told while the turn still waits for its tool result.
        assert await close_code(idle_ws.ws) == 1001
        assert await close_code(idle_session.ws) == 1001
        assert await close_code(idle_rpc.ws) == 1001
        status, body = await readyz(http, server)
        assert (status, body["status"]) == (503, "draining")
        for path in ("/ws", "/v1/session", "/v1/rpc"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(server.http_url + path, headers=bearer(ALICE))
            assert refused.value.status == 503
            assert refused.value.headers is not None
            assert "Retry-After" in refused.value.headers

        # The turn goes on: answered, it finishes, then its client is told.
        await busy.send(
            {"type": "tool_result", "tool_result": {"call_id": call_id, "result": "Oslo"}}
        )
        frames = await busy.turn()
        assert frames[-1]["type"] == "done"
        assert await close_code(busy.ws) == 1001
        assert await exit_status(server) == 0
    finally:
        server.stop()
    async with open_archive(server.archive_path) as store:
        (turn,) = await store.list_turns(session_id)
    assert turn.state is TurnState.COMPLETED


@pytest.mark.parametrize("protocol", ["ws", "session"])
async def test_a_turn_longer_than_drain_timeout_ends_interrupted_with_one_terminal_frame(
    http: aiohttp.ClientSession, tmp_path: Path, protocol: str
) -> None:
    server = draining_server(tmp_path, drain_timeout=0.5)
    try:
        if protocol == "ws":
            client, _, session_id = await held_turn(http, server)
            ws = client.ws
            assert server.process is not None
            server.process.send_signal(signal.SIGTERM)
            terminal = await client.recv()
            assert (terminal["type"], terminal["session_id"]) == ("error", session_id)
        else:
            probe = await SessionProbe.connect(http, server.http_url + "/v1/session")
            ready = await probe.hello(credential=ALICE)
            session_id = ready["session_id"]
            await probe.message("slow", **scenario("lingering"))
            assert (await probe.recv_numbered())["type"] in ("turn_started", "chunk", "delta")
            ws = probe.ws
            assert server.process is not None
            server.process.send_signal(signal.SIGTERM)
            frames = await probe.turn()
            terminal = frames[-1]
            assert terminal["type"] == "error", frames
            assert [f for f in frames if f["type"] in ("done", "error")] == [terminal]
        # The close comes next: no second terminal frame in between.
        msg = await ws.receive(timeout=10)
        assert (msg.type, msg.data) == (aiohttp.WSMsgType.CLOSE, 1001), msg
        assert await exit_status(server) == 0
    finally:
        server.stop()
    async with open_archive(server.archive_path) as store:
        (turn,) = await store.list_turns(session_id)
    assert turn.state is TurnState.INTERRUPTED


async def test_a_second_signal_cuts_the_drain_short(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = draining_server(tmp_path, drain_timeout=600)
    try:
        client, _, _ = await held_turn(http, server)
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        status, _ = await readyz(http, server)
        assert status == 503
        server.process.send_signal(signal.SIGTERM)
        terminal = await client.recv()
        assert terminal["type"] == "error"
        assert await close_code(client.ws) == 1001
        assert await exit_status(server) == 0
    finally:
        server.stop()
