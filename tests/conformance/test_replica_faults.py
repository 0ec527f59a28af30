"""Faults under load on three replicas behind round-robin HAProxy (tests/support/
replicas.py), `/v1/session` clients on every replica (issue 16, spec/replicas.md 4 and 6).

Each test checks the ledger of every client in both directions: the server seqs it saw
arrived once, 1..n, across its resumes; each turn it started has exactly one terminal
frame; the archive holds each of its messages once, and a turn per message.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from support.postgres import (
    DATABASE_URL,
    create_schema,
    drop_schemas,
    require_postgres,
    schema_url,
)
from support.private_redis import PrivateRedis
from support.redis import session_state
from support.replicas import REPLICAS, Replicas, balanced_replicas, require_haproxy
from support.seaweed import ACCESS_KEY, SECRET_KEY, Seaweed
from support.session import SessionProbe
from support.session_ledger import (
    archived,
    assert_seqs_once,
    frames_until,
    hello_again,
    running_turn,
    terminals_per_turn,
)
from support.tcpgate import TcpGate
from support.tcpproxy import TcpProxy

LEASE = 1.0  # replica lease (s): a killed replica's turns end within 1.5 of them
CLIENTS_PER_REPLICA = 2
STEP = 15.0  # deadline of one step (a turn, a resume)
TEST_DEADLINE = 180.0
RETRY = 0.1  # before a client connects again after a refused upgrade
HELLO = "Hello world"  # the scripted default reply


@dataclass
class Client:
    """One `/v1/session` client: its probe, the replica it is on, what it sent."""

    probe: SessionProbe
    session_id: str
    replica: str
    sent: list[str] = field(default_factory=list)
    earlier: list[SessionProbe] = field(default_factory=list)  # numberings before a continue
    turns: list[str] = field(default_factory=list)  # "done" or the error's turn_state


@pytest.fixture
def state_env() -> Iterator[dict[str, str]]:
    with session_state("redis") as env:
        yield env


@pytest.fixture
async def replicas(
    tmp_path: Path, state_env: dict[str, str]
) -> AsyncIterator[tuple[Replicas, str]]:
    env = {**state_env, "PORTICO_REPLICA_LEASE": str(LEASE)}
    async with balanced_replicas(tmp_path, env) as (group, schema):
        yield group, schema_url(schema)


async def connect(http: aiohttp.ClientSession, url: str) -> tuple[SessionProbe, str]:
    """A connection through the balancer, retrying its 503s (a replica it has not yet
    marked down); the probe and the replica that took it."""
    async with asyncio.timeout(STEP):
        while True:
            try:
                ws = await http.ws_connect(url, autoping=True)
            except aiohttp.WSServerHandshakeError as exc:
                if exc.status != 503:
                    raise
            except aiohttp.ClientConnectionError:
                pass
            else:
                return SessionProbe(ws), ws._response.headers.get("X-Served-By", "")
            await asyncio.sleep(RETRY)


async def open_clients(http: aiohttp.ClientSession, url: str, count: int) -> list[Client]:
    clients = []
    for _ in range(count):
        probe, replica = await connect(http, url)
        ready = await probe.hello()
        clients.append(Client(probe, ready["session_id"], replica))
    return clients


async def chat(client: Client, content: str, scenario: str | None = None) -> None:
    """One message and its whole turn, acknowledged."""
    metadata = {"metadata": {"mock_scenario": scenario}} if scenario else {}
    client.sent.append(content)
    await client.probe.message(content, **metadata)
    end = (await client.probe.turn(STEP))[-1]
    client.turns.append("done" if end["type"] == "done" else turn_state(end))
    await client.probe.ack()


def turn_state(frame: dict[str, Any]) -> str:
    return str(frame["error"].get("details", {}).get("turn_state", frame["error"]["code"]))


async def chatter(client: Client, stop: asyncio.Event) -> None:
    """Turns back to back (each streams for about a second) until told to stop."""
    for n in itertools.count():
        if stop.is_set():
            return
        await chat(client, f"{client.session_id} {n}", "paced")


async def resume_through(http: aiohttp.ClientSession, url: str, client: Client) -> None:
    """The client's connection died with its replica: resume through the balancer."""
    async with asyncio.timeout(STEP):
        while True:
            probe, replica = await connect(http, url)
            ready = await hello_again(probe, client.probe, client.session_id)
            if ready["type"] == "ready":
                break
            await probe.ws.close()  # refused in the instant its replica went
            await asyncio.sleep(RETRY)
    assert ready["resumed"] is True
    assert ready["last_seq"] == len(client.sent)  # every message it sent was handled
    client.probe, client.replica = probe, replica


async def check_ledger(client: Client, database_url: str) -> None:
    """Both directions of one client's session: seqs once, one end per turn, the
    archive with each user message once and one turn for each. A numbering lost with
    the session state (then continued) leaves its last turn without its terminal
    message: the archive has it."""
    ends: dict[str, list[str]] = {}
    for probe in [*client.earlier, client.probe]:
        assert_seqs_once(probe)
        for turn_id, kinds in terminals_per_turn(probe).items():
            ends.setdefault(turn_id, []).extend(kinds)
    assert len(ends) == len(client.sent), ends
    assert all(len(kinds) <= 1 for kinds in ends.values()), ends
    assert len([kinds for kinds in ends.values() if not kinds]) == len(client.earlier), ends
    messages, turns = await archived(database_url, client.session_id, 2 * len(client.sent))
    assert [m.content for m in messages if m.role == "user"] == client.sent
    assert len([m for m in messages if m.role == "assistant"]) == len(client.sent)
    expected = ["completed" if state == "done" else state for state in client.turns]
    assert [t.state.value for t in turns] == expected


async def test_kill_9_of_a_replica_running_turns_under_load(
    http: aiohttp.ClientSession, replicas: tuple[Replicas, str]
) -> None:
    """SIGKILL of a replica while its clients' turns run and clients on every replica
    chat: each of its turns ends `interrupted` (its one terminal frame, on whichever
    replica the client resumes), the others go on untouched, nothing is lost or applied
    twice; the replica then restarts under its id, rejoins the rotation and serves."""
    group, database_url = replicas
    url = f"{group.ws_url}/v1/session"
    async with asyncio.timeout(TEST_DEADLINE):
        clients = await open_clients(http, url, CLIENTS_PER_REPLICA * REPLICAS)
        assert {c.replica for c in clients} == {f"r{i}" for i in range(REPLICAS)}
        doomed_name = clients[0].replica
        doomed = [c for c in clients if c.replica == doomed_name]
        others = [c for c in clients if c.replica != doomed_name]
        stop = asyncio.Event()
        load = [asyncio.create_task(chatter(c, stop)) for c in others]
        # Each of the doomed replica's clients has a turn that runs there (a first
        # chunk, then seconds of silence) and that the archive holds.
        for client in doomed:
            client.sent.append(f"{client.session_id} long")
            await client.probe.message(client.sent[-1], metadata={"mock_scenario": "lingering"})
            assert (await client.probe.recv_numbered(STEP))["type"] == "chunk"
            await running_turn(database_url, client.session_id)
        await asyncio.to_thread(group.kill, int(doomed_name[1:]))

        for client in doomed:
            await client.probe.closed(STEP)  # its connection died with the replica
            await resume_through(http, url, client)
            assert client.replica != doomed_name
            (ended,) = await frames_until(client.probe, 1)
            assert ended["type"] == "error", ended
            client.turns.append(turn_state(ended))
            await client.probe.ack()
            await chat(client, f"{client.session_id} after")  # the session goes on
        assert [c.turns for c in doomed] == [["interrupted", "done"]] * len(doomed)

        await asyncio.to_thread(group.restart, int(doomed_name[1:]))
        # Round robin: one of the next few connections lands on the restarted replica.
        for _ in range(2 * REPLICAS):
            (rejoined,) = await open_clients(http, url, 1)
            if rejoined.replica == doomed_name:
                break
            await rejoined.probe.ws.close()
        assert rejoined.replica == doomed_name
        await chat(rejoined, "back")
        assert rejoined.turns == ["done"]

        stop.set()
        await asyncio.gather(*load)  # each chatting client ends its turn in progress
        for client in others:
            assert client.turns, client.session_id
            assert set(client.turns) == {"done"}, client.turns
        for client in [*clients, rejoined]:
            await check_ledger(client, database_url)
            await client.probe.ws.close()


@pytest.fixture
async def replicas_on_private_redis(
    tmp_path: Path,
) -> AsyncIterator[tuple[Replicas, str, PrivateRedis, TcpGate]]:
    """The replicas on a Redis of the test's own, behind a gate the test can close."""
    require_postgres()
    require_haproxy()
    schema = await create_schema()
    redis = await asyncio.to_thread(PrivateRedis(tmp_path / "redis").start)
    gate = await TcpGate("127.0.0.1", redis.port).start()
    group = Replicas(
        tmp_path,
        database_url=schema_url(schema),
        env={
            "PORTICO_REDIS_URL": f"redis://127.0.0.1:{gate.port}/0",
            "PORTICO_REPLICA_LEASE": str(LEASE),
            "PORTICO_READINESS_TIMEOUT": "1",
        },
    )
    # In a thread: the gate relays on this loop while the replicas start.
    await asyncio.to_thread(group.start)
    try:
        yield group, schema_url(schema), redis, gate
    finally:
        await asyncio.to_thread(group.stop)
        await gate.stop()
        await asyncio.to_thread(redis.stop)
        await drop_schemas([schema])


async def recover(http: aiohttp.ClientSession, url: str, client: Client) -> bool:
    """The client's connection failed: resume through the balancer once a replica
    takes it. A session state that lost the session (Redis restarted empty) answers
    `RESUME_FAILED`: the client continues the archived conversation in a new numbering
    (nothing of the old one is replayed). True: resumed; False: continued."""
    async with asyncio.timeout(STEP):
        while True:
            probe, replica = await connect(http, url)
            answer = await hello_again(probe, client.probe, client.session_id)
            if answer["type"] == "ready":
                assert answer["resumed"] is True
                client.probe, client.replica = probe, replica
                return True
            await probe.closed()
            if answer["error"]["code"] == "RESUME_FAILED":
                break
            assert answer["error"]["code"] == "SERVICE_UNAVAILABLE", answer
            await asyncio.sleep(RETRY)
        probe, replica = await connect(http, url)
        ready = await probe.hello(**{"continue": client.session_id})
        assert (ready["type"], ready["session_id"]) == ("ready", client.session_id), ready
        client.earlier.append(client.probe)
        client.probe, client.replica = probe, replica
        return False


async def refused_while_away(http: aiohttp.ClientSession, group: Replicas) -> None:
    """With Redis away every replica leaves the rotation (`/readyz` 503 naming the bus
    and the session state) and a session opened on one is refused with a clear error,
    at once: no hang."""
    server = group.servers[0]
    async with asyncio.timeout(STEP):
        while True:
            async with http.get(server.http_url + "/readyz") as response:
                body = await response.json()
            if response.status == 503:
                break
            await asyncio.sleep(0.05)
    assert body["backends"]["session_state"]["state"] == "down", body
    assert body["backends"]["bus"]["state"] == "down", body
    probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
    refused = await probe.hello()
    assert (refused["type"], refused["error"]["code"]) == ("error", "SERVICE_UNAVAILABLE")
    assert (await probe.closed())[0] == 1011  # resume later


@pytest.mark.parametrize("fault", ["unreachable", "restarted"])
async def test_redis_away_mid_turn_costs_clients_a_reconnect_and_loses_nothing(
    http: aiohttp.ClientSession,
    replicas_on_private_redis: tuple[Replicas, str, PrivateRedis, TcpGate],
    fault: str,
) -> None:
    """The replicas' Redis (the test's own) goes away for seconds while a turn runs
    for a client on every replica: `unreachable` (cut off, back with what it held) or
    `restarted` (back empty, no persistence). Each connection is closed 1011 (session
    state unavailable, resume) on its next write; new sessions are refused with
    `SERVICE_UNAVAILABLE`; the turns run to their end and are archived. When Redis is
    back each client resumes (unreachable: its turn's one terminal message follows) or,
    its ledger gone with the restart, continues the conversation in a new numbering;
    then it chats on. Nothing it sent is lost or applied twice."""
    group, database_url, redis, gate = replicas_on_private_redis
    url = f"{group.ws_url}/v1/session"
    async with asyncio.timeout(TEST_DEADLINE):
        clients = await open_clients(http, url, CLIENTS_PER_REPLICA * REPLICAS)
        assert {c.replica for c in clients} == {f"r{i}" for i in range(REPLICAS)}
        for client in clients:
            client.sent.append(f"{client.session_id} during")
            await client.probe.message(client.sent[-1], metadata={"mock_scenario": "paced"})
            assert (await client.probe.recv_numbered(STEP))["type"] == "chunk"
        if fault == "unreachable":
            gate.close()
        else:
            await asyncio.to_thread(redis.stop)
        for client in clients:
            assert (await client.probe.closed(STEP))[0] == 1011
        await refused_while_away(http, group)
        await asyncio.sleep(1.0)  # the turns (about a second each) end while Redis is away
        if fault == "unreachable":
            gate.open()
        else:
            await asyncio.to_thread(redis.start)

        for n, client in enumerate(clients):
            # Half come back to the replica they left (the balancer may well pick it):
            # its copy of the session was dropped while its turn ran on.
            port = group.servers[int(client.replica[1:])].port
            again = f"ws://127.0.0.1:{port}/v1/session" if n % 2 else url
            if await recover(http, again, client):
                # The rest of the turn: chunks when it was still running at the resume,
                # then its one terminal message.
                (*rest, ended) = await frames_until(client.probe, 1)
                assert ended["type"] == "done", ended
                assert all(frame["type"] not in ("done", "error") for frame in rest), rest
                client.turns.append("done")
                await client.probe.ack()
            else:
                assert fault == "restarted"
                client.turns.append("done")  # archived; its numbering is gone
            await chat(client, f"{client.session_id} after")
        for client in clients:
            await check_ledger(client, database_url)
            await client.probe.ws.close()


@pytest.fixture
async def replicas_behind_a_postgres_proxy(
    tmp_path: Path, state_env: dict[str, str]
) -> AsyncIterator[tuple[Replicas, str, TcpProxy]]:
    """The replicas' archive reached through a relay the test cuts (connections reset,
    new ones refused) and restores."""
    require_postgres()
    require_haproxy()
    schema = await create_schema()
    target = urlsplit(DATABASE_URL)
    proxy = await TcpProxy(target.hostname or "127.0.0.1", target.port or 5432).restore()
    url = schema_url(schema).replace(
        f"{target.hostname}:{target.port or 5432}", f"127.0.0.1:{proxy.port}", 1
    )
    group = Replicas(
        tmp_path,
        database_url=url,
        env={**state_env, "PORTICO_REPLICA_LEASE": str(LEASE), "PORTICO_READINESS_TIMEOUT": "1"},
    )
    await asyncio.to_thread(group.start)
    try:
        yield group, schema_url(schema), proxy
    finally:
        await asyncio.to_thread(group.stop)
        await proxy.cut()
        await drop_schemas([schema])


async def test_a_postgres_connection_reset_mid_turn_ends_each_turn_once_and_service_returns(
    http: aiohttp.ClientSession,
    replicas_behind_a_postgres_proxy: tuple[Replicas, str, TcpProxy],
) -> None:
    """Every replica's archive connections are reset while a turn runs for a client on
    each, and new ones are refused for a moment: `/readyz` says so, a new session is
    refused with an error at once, each running turn ends with exactly one terminal
    frame (no hang), and once PostgreSQL is reachable again every client chats on,
    with no turn left unfinished in the archive and no message lost or doubled."""
    group, database_url, proxy = replicas_behind_a_postgres_proxy
    url = f"{group.ws_url}/v1/session"
    async with asyncio.timeout(TEST_DEADLINE):
        clients = await open_clients(http, url, CLIENTS_PER_REPLICA * REPLICAS)
        for client in clients:
            client.sent.append(f"{client.session_id} during")
            await client.probe.message(client.sent[-1], metadata={"mock_scenario": "paced"})
            assert (await client.probe.recv_numbered(STEP))["type"] == "chunk"
            # Cut once the archive holds the message and its running turn: a message
            # whose own write the cut fails is lost with an error for its turn
            # (docs/replicas.md, "Backend faults").
            await running_turn(database_url, client.session_id)
        await proxy.cut()
        server = group.servers[0]
        async with asyncio.timeout(STEP):
            while True:
                async with http.get(server.http_url + "/readyz") as response:
                    body = await response.json()
                if response.status == 503:
                    break
                await asyncio.sleep(0.05)
        assert body["backends"]["archive"]["state"] == "down", body
        probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
        refused = await probe.hello()
        assert (refused["type"], refused["error"]["code"]) == ("error", "SERVICE_UNAVAILABLE")
        assert (await probe.closed())[0] == 1011  # try again soon
        for client in clients:
            end = (await client.probe.turn(STEP))[-1]
            client.turns.append("done" if end["type"] == "done" else end["error"]["code"])
            await client.probe.ack()
        await proxy.restore()

        for client in clients:
            await chat(client, f"{client.session_id} after")
            assert client.turns[-1] == "done"
        for client in clients:
            await check_turns_once(client, database_url)
            await client.probe.ws.close()


async def check_turns_once(client: Client, database_url: str) -> None:
    """The ledger's checks for turns that may have failed with their archive: seqs
    once, one terminal message per turn, each user message archived once, no turn
    left running."""
    assert_seqs_once(client.probe)
    ends = terminals_per_turn(client.probe)
    assert len(ends) == len(client.sent), ends
    assert all(len(kinds) == 1 for kinds in ends.values()), ends
    messages, turns = await archived(database_url, client.session_id, 2 * len(client.sent))
    assert [m.content for m in messages if m.role == "user"] == client.sent
    assert len(turns) == len(client.sent)
    assert all(t.state.value != "running" for t in turns), turns


@pytest.fixture
async def replicas_on_object_storage(
    tmp_path: Path, state_env: dict[str, str]
) -> AsyncIterator[tuple[Replicas, str, Seaweed]]:
    """The replicas' media in a SeaweedFS bucket of the test's own (tests/support)."""
    require_postgres()
    require_haproxy()
    store = Seaweed(tmp_path / "seaweed")
    store.directory.mkdir()
    await asyncio.to_thread(store.start)
    schema = await create_schema()
    group = Replicas(
        tmp_path,
        database_url=schema_url(schema),
        env={
            **state_env,
            "PORTICO_MEDIA": "s3",
            "PORTICO_S3_ENDPOINT_URL": store.endpoint_url,
            "PORTICO_S3_BUCKET": "portico-faults",
            "PORTICO_S3_ACCESS_KEY_ID": ACCESS_KEY,
            "PORTICO_S3_SECRET_ACCESS_KEY": SECRET_KEY,
            "PORTICO_S3_TIMEOUT": "5",
            "PORTICO_READINESS_TIMEOUT": "1",
        },
    )
    try:
        await asyncio.to_thread(group.start)
        yield group, schema_url(schema), store
    finally:
        await asyncio.to_thread(group.stop)
        await asyncio.to_thread(store.stop)
        await drop_schemas([schema])


async def upload_request(http: aiohttp.ClientSession, base: str) -> int:
    """The status of one `request-upload` (the bucket's first call) at `base`."""
    body = {"session_id": "sess-faults", "filename": "a.png", "mime_type": "image/png"}
    async with http.post(f"{base}/media/request-upload", json={**body, "size_bytes": 5}) as sent:
        return sent.status


async def uploads_work(http: aiohttp.ClientSession, base: str) -> None:
    """Until a `request-upload` through `base` succeeds (a new bucket's first write, or
    the store's return, takes SeaweedFS a while)."""
    async with asyncio.timeout(60):
        while True:
            if await upload_request(http, base) == 200:
                return
            await asyncio.sleep(0.2)


async def test_object_storage_down_for_a_moment_costs_media_only_and_comes_back(
    http: aiohttp.ClientSession,
    replicas_on_object_storage: tuple[Replicas, str, Seaweed],
) -> None:
    """The bucket goes away while a turn runs for a client on every replica: media
    requests get 503 at once on any replica (no hang), the open conversations go on
    (running turns end `done`, new ones run), and once the store is back media
    requests through the balancer succeed again by themselves."""
    group, database_url, store = replicas_on_object_storage
    url = f"{group.ws_url}/v1/session"
    async with asyncio.timeout(TEST_DEADLINE):
        await uploads_work(http, group.url)
        clients = await open_clients(http, url, REPLICAS)
        for client in clients:
            client.sent.append(f"{client.session_id} during")
            await client.probe.message(client.sent[-1], metadata={"mock_scenario": "paced"})
            assert (await client.probe.recv_numbered(STEP))["type"] == "chunk"
        await asyncio.to_thread(store.stop)
        for server in group.servers:
            assert await upload_request(http, server.http_url) == 503
        for client in clients:
            end = (await client.probe.turn(STEP))[-1]
            client.turns.append("done" if end["type"] == "done" else turn_state(end))
            await client.probe.ack()
            await chat(client, f"{client.session_id} while away")
        assert [c.turns for c in clients] == [["done", "done"]] * REPLICAS
        await asyncio.to_thread(store.start)  # the same port
        await uploads_work(http, group.url)
        for client in clients:
            await chat(client, f"{client.session_id} after")
            await check_ledger(client, database_url)
            await client.probe.ws.close()
