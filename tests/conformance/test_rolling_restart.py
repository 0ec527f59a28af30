"""A rolling restart of three replicas behind round-robin HAProxy (tests/support/
replicas.py) while a `/ws` client and a `/v1/rpc` client keep chatting through the
balancer: each replica in turn gets SIGTERM, drains (its clients told 1001 once their
turn is done), exits and starts again. The clients see nothing but the move: a close
1001, perhaps a 503 from the balancer or the draining replica while they reconnect,
and the one answer a message gets when it reaches a replica in the instant it starts
draining (`RATE_LIMITED` "draining": sent again after the reconnect). `/ws` continues
by session id, RPC recovers from its offset; every turn completes, none is lost.

A `/v1/session` client (the SDK, which resumes by itself) chats through the balancer
too: its session state is in Redis, so each resume lands on any replica, and every
reply arrives once, whole and in order (seqs 1..n).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from portico.client import ReconnectPolicy, SessionClient
from portico.domain.states import TurnState
from portico.protocols.session import frames as f
from portico.store.postgres import PostgresStore
from support.omnia import OmniaClient
from support.postgres import schema_url
from support.replicas import REPLICAS, Replicas, balanced_replicas
from support.rpc import RpcClosed, RpcProbe

TEST_DEADLINE = 240.0  # the whole test, restarts included
TURNS_AFTER = 3  # turns each client completes after the last restart
PAUSE = 0.02  # between a client's messages
RETRY = 0.1  # before a client reconnects after a refusal


@dataclass
class Stats:
    turns: int = 0
    moves: int = 0  # connections the server ended (1001, or dropped: `closes` None)
    refused: int = 0  # upgrades the balancer or a draining replica answered 503
    shed: int = 0  # messages answered "draining", sent again after the reconnect
    reconciled: int = 0  # RPC resends answered client_id_conflict (the first landed)
    recovered: int = 0  # RPC reconnects with `recovered: true`
    session_id: str = ""
    completed: set[str] = field(default_factory=set, repr=False)  # RPC: turns seen completed
    closes: list[int | None] = field(default_factory=list)


class Moved(Exception):
    def __init__(self, code: int | None) -> None:
        self.code = code


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[tuple[Replicas, str]]:
    async with balanced_replicas(tmp_path) as group_and_schema:
        yield group_and_schema


async def upgrade(http: aiohttp.ClientSession, url: str, stats: Stats) -> Any:
    """Connect through the balancer, retrying its (and a draining replica's) refusals."""
    while True:
        try:
            return await http.ws_connect(url, autoping=True)
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status != 503:
                raise
        except aiohttp.ClientConnectionError:
            pass
        stats.refused += 1
        await asyncio.sleep(RETRY)


async def omnia_turn(client: OmniaClient, content: str, session_id: str) -> list[dict[str, Any]]:
    try:
        await client.send({"type": "message", "content": content, "session_id": session_id})
        return await client.turn()
    except (AssertionError, ConnectionError) as exc:
        raise Moved(await close_code(client.ws)) from exc


async def close_code(ws: aiohttp.ClientWebSocketResponse) -> int | None:
    """The code of the server's close frame; None when the connection dropped without
    one reaching the client. aiohttp's server closes the TCP connection right after its
    close frame instead of waiting for the client's reply, so a client whose message
    crossed the close can see its write fail and lose the frame (docs/replicas.md)."""
    while True:
        msg = await ws.receive(timeout=10)
        if msg.type is aiohttp.WSMsgType.CLOSE:
            return int(msg.data)
        if msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
            return None


async def ws_chatter(
    http: aiohttp.ClientSession, url: str, stop: asyncio.Event, stats: Stats
) -> None:
    count = 0
    while not stop.is_set():
        client = OmniaClient(await upgrade(http, url + "/ws", stats))
        try:
            connected = await client.connected()
        except AssertionError:
            stats.closes.append(await close_code(client.ws))  # told before its first frame
            continue
        stats.session_id = stats.session_id or connected["session_id"]
        try:
            while not stop.is_set():
                frames = await omnia_turn(client, f"w{count}", stats.session_id)
                last = frames[-1]
                if last["type"] == "error":
                    assert last["error"]["code"] == "RATE_LIMITED", last
                    assert "draining" in last["error"]["message"], last
                    stats.shed += 1
                    raise Moved(await close_code(client.ws))  # the 1001 that follows
                assert last["type"] == "done", frames
                assert {f["session_id"] for f in frames} == {stats.session_id}
                count += 1
                stats.turns += 1
                await asyncio.sleep(PAUSE)
            await client.ws.close()
        except Moved as moved:
            stats.closes.append(moved.code)
            stats.moves += 1


async def rpc_chatter(
    http: aiohttp.ClientSession, url: str, stop: asyncio.Event, stats: Stats
) -> None:
    offset: int | None = None
    epoch: str | None = None
    count = 0
    run = uuid.uuid4().hex[:8]
    sent: set[int] = set()  # the counts sent at least once
    while not stop.is_set():
        probe = RpcProbe(await upgrade(http, url + "/v1/rpc", stats))
        connect: dict[str, Any] = {"type": "connect"}
        if offset is not None:
            connect.update(offset=offset, epoch=epoch)
        try:
            await probe.send(connect)
            probe.connected = await probe.next_frame()
            if offset is not None:
                assert probe.connected["recovered"] is True, probe.connected
                stats.recovered += 1
            epoch = probe.connected["epoch"]
            while not stop.is_set():
                params: dict[str, Any] = {
                    "content_data": f"r{count}",
                    "client_id": f"{run}-{count}",
                }
                if stats.session_id:
                    params["server_session_id"] = stats.session_id
                repeat = count in sent
                sent.add(count)
                reply = await probe.request("v1.message.send", params)
                if "error" in reply and reply["error"]["code"] == "client_id_conflict":
                    assert repeat, reply  # only a resend may find its client_id taken
                    # A resend whose first attempt landed on a replica that closed before
                    # replying (the drain): the error names what it created, which is the
                    # protocol's reconciliation (rpc-protocol.md), as the SDK does it.
                    reply = {"result": reply["error"]["details"]}
                    stats.reconciled += 1
                if "error" in reply:
                    assert reply["error"]["code"] == "rate_limited", reply
                    stats.shed += 1
                    await probe.until(lambda p: False, within=10)  # the 1001 that follows
                session_id = stats.session_id = reply["result"]["session_id"]
                await probe.until(new_turn_completed(session_id, set(stats.completed)))
                stats.completed |= completed(probe, session_id)
                count += 1
                stats.turns += 1
                offset = max([offset or 0, *probe.offsets(), *probe.gaps])
                await asyncio.sleep(PAUSE)
            await probe.close()
        except (RpcClosed, ConnectionError):
            stats.closes.append(await close_code(probe.ws))
            stats.moves += 1
            if probe.updates or probe.gaps:
                offset = max([offset or 0, *probe.offsets(), *probe.gaps])


async def session_chatter(url: str, stop: asyncio.Event, stats: Stats) -> None:
    """The SDK's resumable session: a drain's 1001 is a resume wherever the balancer
    sends it; a message a draining replica refused is sent again."""
    policy = ReconnectPolicy(initial=0.05, maximum=0.5, give_up_after=60.0)
    seqs: list[int] = []
    async with SessionClient(url + "/v1/session", reconnect=policy) as client:
        while not stop.is_set():
            text = f"s{stats.turns} says hello"
            reply = await client.ask(text, metadata={"mock_scenario": "echo"})
            stats.moves = client.connections - 1  # each later connection is a resume
            # A refusal is a numbered frame too: count it before looking at what it says.
            seqs += [frame.seq or 0 for frame in reply.frames]
            if reply.error is not None:
                assert reply.error.code == "RATE_LIMITED", reply.error
                assert "draining" in reply.error.message, reply.error
                stats.shed += 1
                continue
            assert reply.text == text, (text, reply.frames)
            # Every chunk (the echo's words) once and in order, also for a turn whose
            # session moved to another replica while it ran (the new holder replays it).
            chunks = [frame.content.strip() for frame in reply.frames if isinstance(frame, f.Chunk)]
            assert chunks == text.split(" "), (text, reply.frames)
            stats.session_id = client.session_id or ""
            stats.turns += 1
            await asyncio.sleep(PAUSE)
    assert seqs == list(range(1, len(seqs) + 1)), seqs  # every message once, in order


def completed(probe: RpcProbe, session_id: str) -> set[str]:
    """Ids of the session's turns this client has seen complete (on any connection)."""
    return {
        t["id"]
        for t in probe.entities("turn")
        if t["session_id"] == session_id and t["status"] == "completed"
    }


def new_turn_completed(session_id: str, before: set[str]) -> Callable[[RpcProbe], bool]:
    return lambda probe: bool(completed(probe, session_id) - before)


async def keep_chatting(stats: Stats, chatter: asyncio.Task[None], turns: int) -> None:
    """Until the client has completed `turns` more turns (its task failing fails this)."""
    target = stats.turns + turns
    while stats.turns < target:
        if chatter.done():
            chatter.result()
            raise AssertionError("the client stopped")
        await asyncio.sleep(0.05)


async def test_a_rolling_restart_costs_the_clients_nothing_but_the_reconnect(
    http: aiohttp.ClientSession, replicas: tuple[Replicas, str]
) -> None:
    group, schema = replicas
    stop = asyncio.Event()
    ws, rpc, session = Stats(), Stats(), Stats()
    chatters = {
        "ws": asyncio.create_task(ws_chatter(http, group.ws_url, stop, ws)),
        "rpc": asyncio.create_task(rpc_chatter(http, group.ws_url, stop, rpc)),
        "session": asyncio.create_task(session_chatter(group.ws_url, stop, session)),
    }
    clients = ((ws, "ws"), (rpc, "rpc"), (session, "session"))
    try:
        async with asyncio.timeout(TEST_DEADLINE):
            for stats, name in clients:
                await keep_chatting(stats, chatters[name], TURNS_AFTER)
            for index in range(REPLICAS):
                # SIGTERM, wait for the exit (the drain), start again, back in rotation.
                restart = asyncio.create_task(asyncio.to_thread(group.restart, index))
                while not restart.done():
                    for name, task in chatters.items():
                        if task.done():
                            task.result()
                            raise AssertionError(f"the {name} client stopped")
                    await asyncio.sleep(0.05)
                await restart
            for stats, name in clients:
                await keep_chatting(stats, chatters[name], TURNS_AFTER)
            stop.set()
            await asyncio.gather(*chatters.values())
    finally:
        stop.set()
        for task in chatters.values():
            task.cancel()
        await asyncio.gather(*chatters.values(), return_exceptions=True)
    # Every replica held each client at some point, so each was moved at least once;
    # every close frame a client read said 1001 (None: the connection dropped as the
    # client wrote, see `close_code`), and an RPC client always recovered.
    for stats in (ws, rpc, session):
        assert stats.moves >= 1, stats
        assert set(stats.closes) <= {1001, None}, stats
    assert rpc.recovered == rpc.moves
    # And every connection a replica closed, it closed 1001 (1000: the clients' own
    # close at the end).
    codes = {
        line.rpartition("close_code=")[2].split()[0]
        for server in group.servers
        for line in server.log_text().splitlines()
        if "connection closed" in line
    }
    assert codes <= {"1001", "1000"}, codes
    archive = PostgresStore(schema_url(schema), pool_size=1)
    await archive.open()
    try:
        for stats in (ws, rpc, session):
            turns = await archive.list_turns(stats.session_id)
            assert [t.state for t in turns] == [TurnState.COMPLETED] * stats.turns, stats
            messages = await archive.list_messages(stats.session_id, limit=10_000)
            assert len(messages) == 2 * stats.turns
    finally:
        await archive.close()
