"""`/v1/session` across replicas: two `portico serve` processes sharing one Redis
(session state) and one PostgreSQL archive, a client that moves between them.

Each test checks both directions of the exactly-once ledger: every server seq the
client saw arrived once, in order, from 1 without a gap (across both replicas), and
the archive holds each user message and its reply exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from support.postgres import create_schema, drop_schemas, require_postgres, schema_url
from support.redis import redis_client, session_keys, session_state, until_gone
from support.replicas import REPLICAS, Replicas, require_haproxy
from support.server import SCRIPT, ServerProcess
from support.session import SessionProbe
from support.session_ledger import (
    archived,
    assert_seqs_once,
    frames_until,
    resume,
    running_turn,
)
from support.slowtcp import SlowRelay

HELLO = "Hello world"  # the scripted default reply
MEDIUM = "y" * 120  # the `medium` scenario: 120 chunks, then done
LEASE = 1.0  # replica lease (s): a killed replica's turns end within 1.5 of them
WITHIN = 15.0


class Pair:
    """Replica A and replica B, on one archive and one session state."""

    def __init__(self, a: ServerProcess, b: ServerProcess, database_url: str) -> None:
        self.a, self.b, self.database_url = a, b, database_url

    @staticmethod
    def url(server: ServerProcess) -> str:
        return f"ws://127.0.0.1:{server.port}/v1/session"


@pytest.fixture
def state_env() -> Iterator[dict[str, str]]:
    with session_state("redis") as env:
        yield env


@asynccontextmanager
async def replica_pair(
    root: Path,
    state_env: dict[str, str],
    a_env: dict[str, str] | None = None,
    *,
    window: float = 30.0,
) -> AsyncIterator[Pair]:
    """Replicas A and B on a fresh PostgreSQL schema; `a_env`: A's own settings."""
    require_postgres()
    schema = await create_schema()
    database_url = schema_url(schema)
    servers = [
        ServerProcess(
            root / name,
            args=("--store", "postgres", "--runtime", "scripted", "--script", str(SCRIPT)),
            env={
                "PORTICO_DATABASE_URL": database_url,
                "PORTICO_REPLICA_ID": f"rep-{name}",
                "PORTICO_REPLICA_LEASE": str(LEASE),
                "PORTICO_RESUME_WINDOW": str(window),
                **state_env,
                **((a_env or {}) if name == "a" else {}),
            },
        )
        for name in ("a", "b")
    ]
    try:
        for server in servers:
            server.start()
        yield Pair(servers[0], servers[1], database_url)
    finally:
        for server in servers:
            server.stop()
        await drop_schemas([schema])


@pytest.fixture
async def pair(tmp_path: Path, state_env: dict[str, str]) -> AsyncIterator[Pair]:
    async with replica_pair(tmp_path, state_env) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_a_session_resumes_on_the_other_replica_with_nothing_lost_or_twice(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    async with asyncio.timeout(4 * WITHIN):
        on_a = await SessionProbe.connect(http, Pair.url(pair.a))
        ready = await on_a.hello()
        session_id = ready["session_id"]
        await on_a.message("one")
        assert "".join(f.get("content", "") for f in await on_a.turn())  # streamed, then done
        await on_a.ack()
        # A long reply: read a little of it, then the connection drops. The rest waits
        # in the session state, recorded by A before A wrote it.
        await on_a.message("two", metadata={"mock_scenario": "medium"})
        for _ in range(5):
            await on_a.recv_numbered()
        await on_a.ws.close()
        await archived(pair.database_url, session_id, 4)  # A finished the turn

        on_b, ready = await resume(http, Pair.url(pair.b), on_a, session_id)
        assert ready["last_seq"] == 2  # B knows both client messages were handled
        rest = await frames_until(on_b, 1)
        assert (rest[-1]["type"], rest[-1]["content"]) == ("done", MEDIUM)
        await on_b.message("three")  # numbering goes on, on B
        (*_, done) = await on_b.turn()
        assert done["content"] == HELLO
        await on_b.ack()
        assert_seqs_once(on_b)
        messages, turns = await archived(pair.database_url, session_id, 6)
        assert [(m.role, m.content) for m in messages] == [
            ("user", "one"),
            ("assistant", HELLO),
            ("user", "two"),
            ("assistant", MEDIUM),
            ("user", "three"),
            ("assistant", HELLO),
        ]
        assert [t.state.value for t in turns] == ["completed"] * 3
        await on_b.ws.close()


async def test_a_turn_streaming_while_its_session_moves_twice_reaches_the_client_whole(
    http: aiohttp.ClientSession, tmp_path: Path, state_env: dict[str, str]
) -> None:
    """The turn streams on B (a chunk every 100 ms) while its session moves to A and back.
    A reaches Redis slowly: its reader of the session topic starts 0.3 s after its claim,
    and what B streams in between is neither in the ledger (the claim fenced B) nor read
    live by A; A replays it from the bus. Back on B, which runs the turn, B's new copy of
    the session replays B's own events from the bus the same way. Every chunk once, in
    order, one `done`; seqs 1..n across the three connections."""
    bus_env = {**state_env, "PORTICO_BUS": "redis"}  # turn events relayed between them
    with SlowRelay(("127.0.0.1", 6379), delay=0.3) as relay:
        a_env = {"PORTICO_REDIS_URL": f"redis://127.0.0.1:{relay.port}/0"}
        async with replica_pair(tmp_path, bus_env, a_env) as pair, asyncio.timeout(4 * WITHIN):
            on_b = await SessionProbe.connect(http, Pair.url(pair.b))
            session_id = (await on_b.hello())["session_id"]
            await on_b.message("go", metadata={"mock_scenario": "paced_long"})
            assert (await on_b.recv_numbered())["content"] == "p0 "
            await on_b.ws.close()
            on_a, _ = await resume(http, Pair.url(pair.a), on_b, session_id)
            for _ in range(3):
                assert (await on_a.recv_numbered())["type"] == "chunk"
            await on_a.ws.close()
            back, _ = await resume(http, Pair.url(pair.b), on_a, session_id)
            (*_, done) = await frames_until(back, 1)
            chunks = [f["content"] for f in back.received if f["type"] == "chunk"]
            assert chunks == [f"p{n} " for n in range(30)]
            assert (done["type"], done["content"]) == ("done", "".join(chunks))
            assert_seqs_once(back)
            await back.ws.close()


async def test_a_client_message_a_dropped_replica_never_handled_is_taken_once_on_the_other(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    """Client to server: ready.last_seq on B says what A handled; the client resends
    exactly the rest, and a resend of what A handled is discarded as a duplicate."""
    async with asyncio.timeout(4 * WITHIN):
        on_a = await SessionProbe.connect(http, Pair.url(pair.a))
        session_id = (await on_a.hello())["session_id"]
        await on_a.message("one")
        await on_a.turn()
        await on_a.ws.close()
        await archived(pair.database_url, session_id, 2)

        on_b, ready = await resume(http, Pair.url(pair.b), on_a, session_id)
        assert ready["last_seq"] == 1
        await on_b.message("one", seq=1)  # a blind resend: a duplicate, no effect
        await on_b.message("two")
        (*_, done) = await on_b.turn()
        assert done["content"] == HELLO
        await on_b.ack()
        assert_seqs_once(on_b)
        messages, _ = await archived(pair.database_url, session_id, 4)
        assert [(m.role, m.content) for m in messages] == [
            ("user", "one"),
            ("assistant", HELLO),
            ("user", "two"),
            ("assistant", HELLO),
        ]
        await on_b.ws.close()


async def test_a_session_held_by_a_killed_replica_leaves_redis_and_a_living_ones_stays(
    http: aiohttp.ClientSession, tmp_path: Path, state_env: dict[str, str]
) -> None:
    """A replica killed while it holds a connection never writes the window: the
    session's keys still leave Redis once its renewals stop (`session_expiry_grace`,
    short here). B's session, idle since before A's last write, is renewed and stays."""
    short = {**state_env, "PORTICO_SESSION_EXPIRY_GRACE": "0.3"}
    prefix = state_env["PORTICO_REDIS_KEY_PREFIX"]
    async with (
        replica_pair(tmp_path, short, window=0.2) as pair,
        redis_client(prefix) as redis,
        asyncio.timeout(4 * WITHIN),
    ):
        on_b = await SessionProbe.connect(http, Pair.url(pair.b))
        idle = (await on_b.hello())["session_id"]
        on_a = await SessionProbe.connect(http, Pair.url(pair.a))
        doomed = (await on_a.hello())["session_id"]
        await on_a.message("one")
        await on_a.turn()
        pair.a.stop(signal.SIGKILL)  # no goodbye, no window written

        await until_gone(redis, session_keys(prefix, doomed))
        assert await redis.pttl(session_keys(prefix, idle)[0]) > 0
        await on_b.message("still here")  # and the living session works on
        (*_, done) = await on_b.turn()
        assert done["content"] == HELLO
        await on_b.ws.close()


async def test_a_session_outlives_its_replica_killed_with_sigkill(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    """What A recorded before it died resumes on B exactly once: A writes a message only
    once the session state holds it, so everything the client got, and more, is there."""
    async with asyncio.timeout(4 * WITHIN):
        on_a = await SessionProbe.connect(http, Pair.url(pair.a))
        session_id = (await on_a.hello())["session_id"]
        await on_a.message("one")
        await on_a.turn()
        await on_a.ack()
        handled = on_a.handled
        await on_a.message("two", metadata={"mock_scenario": "medium"})
        await on_a.turn()  # read to its done, never acknowledged
        pair.a.stop(signal.SIGKILL)  # no goodbye: its socket just dies

        # The client had handled only the first turn when the replica went.
        on_b, ready = await resume(http, Pair.url(pair.b), on_a, session_id, handled=handled)
        assert ready["last_seq"] == 2
        rest = await frames_until(on_b, 1)
        assert "".join(frame.get("content", "") for frame in rest[:-1]) == MEDIUM
        assert (rest[-1]["type"], rest[-1]["content"]) == ("done", MEDIUM)
        await on_b.message("three")
        (*_, done) = await on_b.turn()
        assert done["content"] == HELLO
        assert_seqs_once(on_b)
        messages, _ = await archived(pair.database_url, session_id, 6)
        assert [m.content for m in messages] == ["one", HELLO, "two", MEDIUM, "three", HELLO]
        await on_b.ws.close()


@pytest.mark.parametrize("redis_delay", [0.0, 0.3], ids=["direct", "slow-redis-on-a"])
async def test_a_turn_running_on_a_killed_replica_ends_interrupted_once_on_the_other(
    http: aiohttp.ClientSession, tmp_path: Path, state_env: dict[str, str], redis_delay: float
) -> None:
    """The turn dies with its replica; the client resumed on B gets its one terminal
    frame there (interrupted, once the lease lapsed), and the session goes on.

    With A's Redis slow, a message A wrote before the session state held it would be
    numbered again by B (the client would see one seq twice): A writes only what is
    recorded."""
    with contextlib.ExitStack() as stack:
        a_env = {}
        if redis_delay:
            relay = stack.enter_context(SlowRelay(("127.0.0.1", 6379), delay=redis_delay))
            a_env = {"PORTICO_REDIS_URL": f"redis://127.0.0.1:{relay.port}/0"}
        async with replica_pair(tmp_path, state_env, a_env) as pair:
            await interrupted_on_the_other(http, pair)


async def interrupted_on_the_other(http: aiohttp.ClientSession, pair: Pair) -> None:
    async with asyncio.timeout(4 * WITHIN):
        on_a = await SessionProbe.connect(http, Pair.url(pair.a))
        session_id = (await on_a.hello())["session_id"]
        await on_a.message("long", metadata={"mock_scenario": "lingering"})
        first = await on_a.recv_numbered()  # the turn's first chunk, then 4 s of nothing
        assert first["type"] == "chunk"
        # Killed once the archive holds the running turn (it groups its writes for a few
        # milliseconds: a replica dying inside that window takes the message with it,
        # docs/replicas.md, "What a resume on another replica costs").
        await running_turn(pair.database_url, session_id)
        pair.a.stop(signal.SIGKILL)

        on_b, ready = await resume(http, Pair.url(pair.b), on_a, session_id)
        assert ready["last_seq"] == 1
        (ended,) = await frames_until(on_b, 1)
        assert (ended["type"], ended["turn_id"]) == ("error", first["turn_id"])
        assert ended["error"]["details"] == {"turn_state": "interrupted"}
        await on_b.message("after")
        (*_, done) = await on_b.turn()
        assert done["content"] == HELLO
        await on_b.ack()
        assert_seqs_once(on_b)
        messages, turns = await archived(pair.database_url, session_id, 3)
        assert [t.state.value for t in turns] == ["interrupted", "completed"]
        assert [(m.role, m.content) for m in messages][-2:] == [
            ("user", "after"),
            ("assistant", HELLO),
        ]
        # Exactly one terminal frame for the interrupted turn, on either replica.
        terminals = [f for f in on_b.received if f.get("turn_id") == first["turn_id"]]
        assert [f["type"] for f in terminals] == ["chunk", "error"]
        await on_b.ws.close()


async def test_a_half_open_connection_on_the_old_replica_is_fenced(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    """The client resumes on B while its connection to A still stands: A's next write
    for the session is refused by the session state, and A closes that socket 4409."""
    async with asyncio.timeout(4 * WITHIN):
        on_a = await SessionProbe.connect(http, Pair.url(pair.a))
        session_id = (await on_a.hello())["session_id"]
        await on_a.message("one")
        await on_a.turn()
        on_b, _ = await resume(http, Pair.url(pair.b), on_a, session_id)
        # The old connection sends on: its message is not taken, its socket is closed.
        await on_a.message("stale")
        assert (await on_a.closed())[0] == 4409
        await on_b.message("two", seq=2)
        (*_, done) = await on_b.turn()
        assert done["content"] == HELLO
        messages, _ = await archived(pair.database_url, session_id, 4)
        assert [m.content for m in messages] == ["one", HELLO, "two", HELLO]
        await on_b.ws.close()


async def test_the_window_of_a_dead_replicas_session_holds_on_the_other(
    http: aiohttp.ClientSession, tmp_path: Path, state_env: dict[str, str]
) -> None:
    """The window's deadline lives in the session state: with the replica whose timer
    would end the session dead, B still refuses a resume past it."""
    window = 1.0
    async with replica_pair(tmp_path, state_env, window=window) as pair:
        on_a = await SessionProbe.connect(http, Pair.url(pair.a))
        session_id = (await on_a.hello())["session_id"]
        await on_a.message("one")
        await on_a.turn()
        await on_a.ws.close()
        await asyncio.sleep(0.3)  # A writes the deadline when the connection closes
        pair.a.stop(signal.SIGKILL)
        await asyncio.sleep(window + 0.3)
        probe = await SessionProbe.connect(http, Pair.url(pair.b))
        answer = await probe.hello(session_id=session_id, last_seq=on_a.handled)
        assert (answer["type"], answer["error"]["code"]) == ("error", "RESUME_FAILED")
        assert (await probe.closed())[0] == 4404


ROUNDS = 6  # drops and resumes through the balancer


async def test_round_robin_resumes_land_on_every_replica_and_lose_nothing(
    http: aiohttp.ClientSession, tmp_path: Path, state_env: dict[str, str]
) -> None:
    """Three replicas behind HAProxy (round robin, no stickiness): each drop's resume
    lands on whichever replica is next, and the ledger stays exact."""
    require_haproxy()
    require_postgres()
    schema = await create_schema()
    group = Replicas(tmp_path, database_url=schema_url(schema), env=state_env)
    try:
        group.start()
        url = f"{group.ws_url}/v1/session"
        async with asyncio.timeout(8 * WITHIN):
            probe = await SessionProbe.connect(http, url)
            session_id = (await probe.hello())["session_id"]
            served: set[str] = set()
            for n in range(ROUNDS):
                await probe.message(f"round {n}", metadata={"mock_scenario": "medium"})
                for _ in range(3):
                    await probe.recv_numbered()
                await probe.ws.close()  # the rest of the reply waits in the session state
                probe, ready = await resume(http, url, probe, session_id)
                served.add(probe.ws._response.headers.get("X-Served-By", ""))
                assert ready["last_seq"] == n + 1
                (*_, done) = await frames_until(probe, 1)
                assert (done["type"], done["content"]) == ("done", MEDIUM)
                await probe.ack()
            assert served == {f"r{i}" for i in range(REPLICAS)}
            assert_seqs_once(probe)
            messages, turns = await archived(schema_url(schema), session_id, 2 * ROUNDS)
            expected = [
                (role, text)
                for n in range(ROUNDS)
                for role, text in (("user", f"round {n}"), ("assistant", MEDIUM))
            ]
            assert [(m.role, m.content) for m in messages] == expected
            assert [t.state.value for t in turns] == ["completed"] * ROUNDS
            await probe.ws.close()
    finally:
        group.stop()
        await drop_schemas([schema])


async def test_a_tool_result_sent_on_the_other_replica_reaches_the_turn_once(
    http: aiohttp.ClientSession, tmp_path: Path, state_env: dict[str, str]
) -> None:
    """The turn waits on A for a client tool's result; the client moved to B and
    answers there: the result is forwarded to A over the bus (`bus=redis`)."""
    async with (
        replica_pair(tmp_path, {**state_env, "PORTICO_BUS": "redis"}) as pair,
        asyncio.timeout(4 * WITHIN),
    ):
        on_a = await SessionProbe.connect(http, Pair.url(pair.a))
        ready = await on_a.hello(capabilities=["tools"])
        session_id = ready["session_id"]
        await on_a.message("where", metadata={"mock_scenario": "tool"})
        call = await on_a.recv_numbered()
        assert call["type"] == "tool_call", call
        call_id = call["tool_call"]["id"]
        await on_a.ws.close()
        on_b, _ = await resume(http, Pair.url(pair.b), on_a, session_id)
        await on_b.numbered("tool_result", call_id=call_id, result={"city": "Oslo"})
        (*_, done) = await frames_until(on_b, 1)
        assert done["type"] == "done", done
        assert done["content"] == 'status=completed result={"city":"Oslo"} error='
        await on_b.ack()
        # Once: a second result for the same call is refused, as on one process.
        refused_seq = await on_b.numbered("tool_result", call_id=call_id, result="again")
        refused = await on_b.recv_numbered()
        assert (refused["type"], refused.get("ref_seq")) == ("error", refused_seq), refused
        _, turns = await archived(pair.database_url, session_id, 2)
        assert [t.state.value for t in turns] == ["completed"]
        assert_seqs_once(on_b)
        assert [f["type"] for f in on_b.received if f["type"] == "done"] == ["done"]
        await on_b.ws.close()
