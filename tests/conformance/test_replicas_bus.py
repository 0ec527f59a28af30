"""Two `portico serve` replicas sharing PostgreSQL and Redis (`bus=redis`), each client
on the replica the test picks: turn output, control and the one-turn rule across them
behave as on one process (issue 16 items 1 and 2, spec/replicas.md 2 and 3)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.omnia import OmniaClient, scenario
from support.postgres import create_schema, drop_schemas, require_postgres, schema_url
from support.redis import REDIS_URL
from support.replicas import free_port
from support.rpc import RpcProbe
from support.server import SCRIPT, ServerProcess
from support.tcpgate import TcpGate

WAIT = 10.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    require_postgres()
    schema = asyncio.run(create_schema())
    prefix = f"portico-test:{uuid.uuid4().hex[:12]}:"
    root = tmp_path_factory.mktemp("replicas-bus")
    servers = [
        ServerProcess(
            root / f"rep-{index}",
            args=("--store", "postgres", "--runtime", "scripted", "--script", str(SCRIPT)),
            port=free_port(),
            env={
                "PORTICO_DATABASE_URL": schema_url(schema),
                "PORTICO_REPLICA_ID": f"rep-{index}",
                "PORTICO_BUS": "redis",
                "PORTICO_REDIS_URL": REDIS_URL,
                "PORTICO_REDIS_KEY_PREFIX": prefix,
                "PORTICO_CLIENT_TOOL_TIMEOUT": "20",
                "PORTICO_TOOL_ACK_TIMEOUT": "10",
            },
        )
        for index in range(2)
    ]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()
        asyncio.run(drop_schemas([schema]))


async def omnia(http: aiohttp.ClientSession, server: ServerProcess) -> OmniaClient:
    return OmniaClient(await http.ws_connect(server.ws_url))


def shape(frames: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(f["type"], f.get("content") or f.get("tool_call", {}).get("name")) for f in frames]


async def test_a_ws_client_sees_the_turn_another_replica_runs_for_its_session(
    http: aiohttp.ClientSession, pair: list[ServerProcess]
) -> None:
    a, b = pair
    watcher = await omnia(http, a)
    session_id = (await watcher.connected())["session_id"]
    assert shape(await watcher.ask("hi")) == [
        ("chunk", "Hello "),
        ("chunk", "world"),
        ("done", "Hello world"),
    ]
    # The same user continues the session from a connection on the other replica.
    other = await omnia(http, b)
    await other.connected()
    await other.send({"type": "message", "session_id": session_id, "content": "again"})
    runner_frames = await other.turn()
    watched = await watcher.turn()
    assert shape(watched) == shape(runner_frames)
    assert shape(watched) == [("chunk", "Hello "), ("chunk", "world"), ("done", "Hello world")]
    assert {f["session_id"] for f in watched} == {session_id}
    await watcher.expect_silence()  # exactly once: no second copy
    await other.expect_silence()


async def test_a_tool_call_is_answered_on_the_replica_the_turn_does_not_run_on(
    http: aiohttp.ClientSession, pair: list[ServerProcess]
) -> None:
    a, b = pair
    answering = await omnia(http, a)
    session_id = (await answering.connected())["session_id"]
    await answering.ask("hi")  # attaches it to the session
    runner = await omnia(http, b)
    await runner.connected()
    await runner.send(
        {"type": "message", "session_id": session_id, "content": "where", **scenario("tool")}
    )
    call = await answering.recv()  # relayed from B
    assert call["type"] == "tool_call", call
    assert (await runner.recv())["type"] == "tool_call"
    call_id = call["tool_call"]["id"]
    await answering.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call_id}})
    await answering.send(
        {"type": "tool_result", "tool_result": {"call_id": call_id, "result": {"city": "Oslo"}}}
    )
    done = (await runner.turn())[-1]
    assert done["type"] == "done", done
    assert "status=completed" in done["content"], done
    assert "Oslo" in done["content"], done
    assert (await answering.turn())[-1]["content"] == done["content"]
    # The call has ended: a late repeat is refused the way one process refuses it.
    await answering.send({"type": "tool_result", "tool_result": {"call_id": call_id, "result": 1}})
    refused = await answering.recv()
    assert refused["type"] == "error", refused
    assert refused["error"]["code"] == "INVALID_MESSAGE", refused


async def test_a_stop_sent_to_another_replica_stops_the_turn(
    http: aiohttp.ClientSession, pair: list[ServerProcess]
) -> None:
    a, b = pair
    runner = await omnia(http, b)
    session_id = (await runner.connected())["session_id"]
    await runner.send({"type": "message", "content": "slow", **scenario("slow")})
    assert (await runner.recv())["type"] == "chunk"  # B runs it
    rpc = await RpcProbe.open(http, f"ws://127.0.0.1:{a.port}/v1/rpc")
    try:
        stopped = await rpc.call("v1.turn.stop", {"session_id": session_id})
        assert stopped is not None
        done = await runner.recv(within=1.5)  # well before the 2 s the turn would take
        assert done["type"] == "done", done
        async with asyncio.timeout(WAIT):
            while True:  # the archive says so on any replica
                listed = await rpc.call("v1.turn.list", {"session_id": session_id})
                if [t["status"] for t in listed["items"]] == ["cancelled"]:
                    break
                await asyncio.sleep(0.05)
        assert await rpc.call("v1.turn.stop", {"session_id": session_id}) is not None
    finally:
        await rpc.close()


async def until_done(client: OmniaClient) -> list[dict[str, Any]]:
    frames = [await client.recv(WAIT)]
    while frames[-1]["type"] != "done":
        frames.append(await client.recv(WAIT))
    return frames


async def test_two_replicas_receiving_messages_for_one_session_at_once_run_one_turn(
    http: aiohttp.ClientSession, pair: list[ServerProcess]
) -> None:
    a, b = pair
    first = await omnia(http, a)
    session_id = (await first.connected())["session_id"]
    await first.ask("hi")
    second = await omnia(http, b)
    await second.connected()
    await second.send({"type": "message", "session_id": session_id, "content": "hi"})
    await second.turn()
    await first.turn()  # both connections are attached to the session now
    for _ in range(3):
        frame = {"type": "message", "session_id": session_id, "content": "x", **scenario("slow")}
        await asyncio.gather(first.send(frame), second.send(frame))
        seen = await asyncio.gather(until_done(first), until_done(second))
        errors = [f["error"]["code"] for frames in seen for f in frames if f["type"] == "error"]
        # One replica ran it; the other answered as one process does for a busy session.
        assert errors == ["TURN_IN_PROGRESS"], seen
        for frames in seen:  # the one turn's stream reached both connections, once
            assert [f["type"] for f in frames if f["type"] != "error"] == ["chunk", "done"]
        await first.expect_silence(0.2)  # no second turn; the lock is released meanwhile
        await second.expect_silence(0.2)


async def test_an_rpc_client_sees_live_updates_and_chunks_of_a_turn_on_another_replica(
    http: aiohttp.ClientSession, pair: list[ServerProcess]
) -> None:
    a, b = pair
    rpc = await RpcProbe.open(http, f"ws://127.0.0.1:{a.port}/v1/rpc")
    try:
        start = rpc.connected.get("offset", 0)
        runner = await omnia(http, b)
        session_id = (await runner.connected())["session_id"]
        await runner.ask("hi")
        turn = await rpc.wait_turn_end(session_id)
        assert turn["status"] == "completed", turn

        def reply_done(probe: RpcProbe) -> bool:
            return any(
                m["session_id"] == session_id
                and m["role"] == "assistant"
                and m["status"] == "completed"
                for m in probe.entities("message")
            )

        await rpc.until(reply_done)
        assert rpc.gaps == []
        seen = rpc.offsets()
        assert seen == sorted(set(seen)), seen  # in offset order, each once
        assert seen == list(range(seen[0], seen[-1] + 1)), seen  # none skipped
        assert seen[0] >= start
        texts = [live["delta"] for live in rpc.live if live["session_id"] == session_id]
        assert texts == ["Hello ", "world"], rpc.live
    finally:
        await rpc.close()


async def test_an_rtc_result_submitted_on_another_replica_reaches_the_waiting_turn(
    http: aiohttp.ClientSession, pair: list[ServerProcess]
) -> None:
    a, b = pair
    rpc = await RpcProbe.open(http, f"ws://127.0.0.1:{a.port}/v1/rpc")
    try:
        runner = await omnia(http, b)
        session_id = (await runner.connected())["session_id"]
        await runner.send({"type": "message", "content": "where", **scenario("tool")})
        assert (await runner.recv())["type"] == "tool_call"  # B's turn waits for it

        def has_rtc(probe: RpcProbe) -> bool:
            return any(r["session_id"] == session_id for r in probe.entities("rtc"))

        await rpc.until(has_rtc)  # the Rtc reached A's RPC client as an update
        rtc = next(r for r in rpc.entities("rtc") if r["session_id"] == session_id)
        submitted = await rpc.call(
            "v1.rtc.submit_result",
            {"rtc_id": rtc["id"], "success": True, "result": {"city": "Oslo"}, "client_id": "t"},
        )
        assert (submitted["status"], submitted["result"]) == ("completed", {"city": "Oslo"})
        done = (await runner.turn())[-1]
        assert done["type"] == "done", done
        assert done["content"].startswith("status=completed"), done
        # Submitted again: idempotent, as on one process.
        again = await rpc.call(
            "v1.rtc.submit_result",
            {"rtc_id": rtc["id"], "success": True, "result": {"city": "Oslo"}, "client_id": "t"},
        )
        assert again["status"] == "completed"
    finally:
        await rpc.close()


@pytest.fixture
async def gated(tmp_path: Path) -> AsyncIterator[tuple[ServerProcess, TcpGate]]:
    """One bus=redis replica whose Redis is behind a gate the test opens and closes."""
    require_postgres()
    schema = await create_schema()
    gate = await TcpGate("127.0.0.1", 6379).start()
    server = ServerProcess(
        tmp_path / "gated",
        args=("--store", "postgres", "--runtime", "scripted", "--script", str(SCRIPT)),
        env={
            "PORTICO_DATABASE_URL": schema_url(schema),
            "PORTICO_REPLICA_ID": "rep-gated",
            "PORTICO_BUS": "redis",
            "PORTICO_REDIS_URL": f"redis://127.0.0.1:{gate.port}/0",
            "PORTICO_REDIS_KEY_PREFIX": f"portico-test:{uuid.uuid4().hex[:12]}:",
        },
    )
    # Started in a thread: the gate relays on this loop while the server starts.
    await asyncio.to_thread(server.start)
    try:
        yield server, gate
    finally:
        await asyncio.to_thread(server.stop)
        await gate.stop()
        await drop_schemas([schema])


async def test_with_redis_away_new_turns_are_refused_running_ones_finish_and_it_recovers(
    http: aiohttp.ClientSession, gated: tuple[ServerProcess, TcpGate]
) -> None:
    server, gate = gated
    client = await omnia(http, server)
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "message", "content": "slow", **scenario("slow")})
    assert (await client.recv())["type"] == "chunk"
    gate.close()  # Redis goes away mid-turn
    assert (await client.recv(WAIT))["type"] == "done"  # the running turn ends here as usual
    # A new turn cannot take its session's lock: a clear refusal, no hang.
    await client.send({"type": "message", "session_id": session_id, "content": "hi"})
    refused = await client.recv(WAIT)
    assert refused["type"] == "error", refused
    assert refused["error"]["code"] == "SERVICE_UNAVAILABLE", refused
    gate.open()
    async with asyncio.timeout(WAIT):  # back by itself, the same session included
        while True:
            await client.send({"type": "message", "session_id": session_id, "content": "hi"})
            frame = await client.recv(WAIT)
            if frame["type"] == "chunk":
                break
            assert frame["error"]["code"] == "SERVICE_UNAVAILABLE", frame
            await asyncio.sleep(0.2)
    assert [f["type"] for f in await client.turn()] == ["chunk", "done"]
