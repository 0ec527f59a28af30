"""`/ws` voice calls across two `portico serve` replicas on PostgreSQL and Redis (issue 16,
spec/replicas.md 1, spec/realtime-audio.md 6): a `?resume` that the balancer sends to
the other replica continues the call there (docs/replicas.md, "Voice calls"); the
same-principal rule and the window hold across replicas; a replica killed while its
call is parked leaves a prompt, defined answer."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from redis.asyncio import Redis

from support.postgres import create_schema, drop_schemas, require_postgres, schema_url
from support.redis import REDIS_URL, drop_keys
from support.replicas import free_port
from support.server import ServerProcess
from support.voicecall import (
    LOUD,
    WAIT,
    Caller,
    Dial,
    is_type,
    metric,
    texts,
    write_voice_config,
)

GRACE = 30.0  # seconds: the resume tests reconnect long before it
SHORT_GRACE = 0.5
REPLY = "Hi, how can I help?"


class Pair:
    """Two replicas on one fresh PostgreSQL schema and one Redis key prefix."""

    def __init__(self, root: Path, schema: str, grace: float) -> None:
        self.prefix = f"portico-test:{uuid.uuid4().hex[:12]}:"
        self.servers = [
            ServerProcess(
                root / f"rep-{index}",
                args=(
                    "--config",
                    str(write_voice_config(root / f"rep-{index}", realtime_grace_window=grace)),
                    "--store",
                    "postgres",
                ),
                port=free_port(),
                env={
                    "PORTICO_DATABASE_URL": schema_url(schema),
                    "PORTICO_REPLICA_ID": f"rep-{index}",
                    "PORTICO_BUS": "redis",
                    "PORTICO_REDIS_URL": REDIS_URL,
                    "PORTICO_REDIS_KEY_PREFIX": self.prefix,
                    # Longer than any wait of these tests: a resume that waited on a
                    # dead replica's answer would miss its deadline.
                    "PORTICO_BUS_CONTROL_TIMEOUT": "60",
                },
            )
            for index in range(2)
        ]

    def start(self) -> Pair:
        for server in self.servers:
            server.start()
        return self

    def stop(self) -> None:
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                server.stop()
        drop_keys(self.prefix)


@contextlib.contextmanager
def pair_of(root: Path, grace: float) -> Iterator[Pair]:
    require_postgres()
    schema = asyncio.run(create_schema())
    pair = Pair(root, schema, grace)
    try:
        yield pair.start()
    finally:
        pair.stop()
        asyncio.run(drop_schemas([schema]))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with pair_of(tmp_path_factory.mktemp("replicas-voice"), GRACE) as found:
        yield found


@pytest.fixture
def short_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Its own replicas: a test kills one, or waits out the short window."""
    with pair_of(tmp_path_factory.mktemp("replicas-voice-short"), SHORT_GRACE) as found:
        yield found


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def calling(dial: Dial, token: str) -> Caller:
    """A caller whose call runs (its `session_config` came)."""
    caller = await dial("?binary=true", token=token)
    await caller.speak(LOUD, first=True)
    await caller.until(is_type("session_config"))
    return caller


async def continues(caller: Caller, sequence: int) -> None:
    """The call answers: the scripted agent hears three loud frames and replies."""
    assert caller.connected_frame["connected"]["resumed"] is True
    await caller.until(is_type("session_config"))
    caller.sequence = sequence
    await caller.speak(LOUD, LOUD, LOUD)
    frames = texts(await caller.until(is_type("done")))
    assert frames[-1]["content"] == REPLY, frames
    assert {"type": "chunk", "content": "hello there", "role": "user",
            "session_id": caller.session_id} in frames  # fmt: skip


async def until_metric(
    http: aiohttp.ClientSession, server: ServerProcess, name: str, wanted: float
) -> None:
    deadline = time.monotonic() + WAIT
    while await metric(http, server, name) != wanted:
        assert time.monotonic() < deadline, f"{name} never became {wanted}"
        await asyncio.sleep(0.05)


async def test_a_dropped_call_resumed_on_the_other_replica_continues_there(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    a, b = pair.servers
    on_a, on_b = Dial(http, a), Dial(http, b)
    token = on_a.user()
    caller = await calling(on_a, token)
    await caller.ws.close()  # dropped without hangup: parked on A
    await until_metric(http, a, "portico_audio_sessions_parked", 1)
    again = await on_b(f"?binary=true&resume={caller.session_id}", token=token)
    assert again.session_id == caller.session_id
    await continues(again, caller.sequence)
    # A let go of its call: nothing of it is left there.
    await until_metric(http, a, "portico_audio_sessions_open", 0)
    await again.send({"type": "hangup"})
    await until_metric(http, b, "portico_audio_sessions_open", 0)


async def test_a_resume_on_the_other_replica_takes_over_a_connection_still_open(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    a, b = pair.servers
    on_a, on_b = Dial(http, a), Dial(http, b)
    token = on_a.user()
    first = await calling(on_a, token)
    # The client reconnected (to B) before A saw its old socket go.
    second = await on_b(f"?binary=true&resume={first.session_id}", token=token)
    (moved,) = texts(await first.until(is_type("error")))
    assert moved["error"] == {
        "code": "DUPLEX_ERROR",
        "message": "the call was resumed on another connection",
    }
    await continues(second, first.sequence)
    await first.speak(LOUD)  # the old connection's frames go nowhere now
    await first.silent()
    await second.send({"type": "hangup"})


async def test_another_principal_cannot_reclaim_a_call_parked_on_the_other_replica(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    a, b = pair.servers
    on_a, on_b = Dial(http, a), Dial(http, b)
    alice, bob = on_a.user(), on_a.user()
    caller = await calling(on_a, alice)
    await caller.ws.close()
    stranger = await on_b(f"?binary=true&resume={caller.session_id}", token=bob)
    assert stranger.connected_frame["connected"]["resumed"] is False
    assert stranger.session_id != caller.session_id  # a fresh session
    (refused,) = texts(await stranger.until(is_type("error")))
    assert refused["error"]["code"] == "SESSION_EXPIRED"
    assert refused["session_id"] == caller.session_id
    # Left parked for its owner, who may come back on either replica.
    owner = await on_b(f"?binary=true&resume={caller.session_id}", token=alice)
    await continues(owner, caller.sequence)
    await owner.send({"type": "hangup"})


async def test_a_call_past_its_window_is_not_resumed_on_the_other_replica(
    http: aiohttp.ClientSession, short_pair: Pair
) -> None:
    a, b = short_pair.servers
    on_a, on_b = Dial(http, a), Dial(http, b)
    token = on_a.user()
    caller = await calling(on_a, token)
    await caller.ws.close()
    await until_metric(http, a, 'portico_audio_sessions_unparked_total{outcome="ended"}', 1)
    again = await on_b(f"?binary=true&resume={caller.session_id}", token=token)
    assert again.connected_frame["connected"]["resumed"] is False
    (refused,) = texts(await again.until(is_type("error")))
    assert refused["error"]["code"] == "SESSION_EXPIRED"


async def test_a_call_parked_on_a_killed_replica_continues_at_once_on_the_other(
    http: aiohttp.ClientSession, short_pair: Pair, tmp_path: Path
) -> None:
    a, b = short_pair.servers
    on_a, on_b = Dial(http, a), Dial(http, b)
    token = on_a.user()
    caller = await calling(on_a, token)
    await caller.ws.close()
    await until_metric(http, a, "portico_audio_sessions_parked", 1)
    a.stop(signal.SIGKILL)
    # B does not wait on the dead replica: the call goes on there, a new runtime call
    # of the same session.
    async with asyncio.timeout(WAIT):
        again = await on_b(f"?binary=true&resume={caller.session_id}", token=token)
    await continues(again, caller.sequence)
    await again.send({"type": "hangup"})


async def test_a_live_call_of_a_killed_replica_continues_on_the_other(
    http: aiohttp.ClientSession, short_pair: Pair
) -> None:
    """Killed mid-call (never parked): its record lives out the lease, so the caller
    whose socket died with it continues on B."""
    a, b = short_pair.servers
    on_a, on_b = Dial(http, a), Dial(http, b)
    token = on_a.user()
    caller = await calling(on_a, token)
    a.stop(signal.SIGKILL)
    async with asyncio.timeout(WAIT):
        again = await on_b(f"?binary=true&resume={caller.session_id}", token=token)
    await continues(again, caller.sequence)
    await again.send({"type": "hangup"})


async def test_a_call_of_a_killed_replica_is_forgotten_when_its_window_ends(
    http: aiohttp.ClientSession, short_pair: Pair
) -> None:
    a, b = short_pair.servers
    on_a, on_b = Dial(http, a), Dial(http, b)
    token = on_a.user()
    caller = await calling(on_a, token)
    await caller.ws.close()
    await until_metric(http, a, "portico_audio_sessions_parked", 1)
    a.stop(signal.SIGKILL)
    # Nobody ends the window but Redis itself.
    key = f"{short_pair.prefix}call:{caller.session_id}"
    redis = Redis.from_url(REDIS_URL)
    try:
        deadline = time.monotonic() + WAIT
        while await redis.exists(key):
            assert time.monotonic() < deadline, "the dead replica's record never lapsed"
            await asyncio.sleep(0.05)
    finally:
        await redis.aclose()
    again = await on_b(f"?binary=true&resume={caller.session_id}", token=token)
    assert again.connected_frame["connected"]["resumed"] is False


async def test_a_call_of_a_stopped_replica_continues_on_the_other(
    http: aiohttp.ClientSession, pair: Pair
) -> None:
    """Last in the module: it stops replica A (and starts it again after)."""
    a, b = pair.servers
    on_a, on_b = Dial(http, a), Dial(http, b)
    token = on_a.user()
    caller = await calling(on_a, token)
    try:
        a.stop()  # SIGTERM: drain, calls hung up, their records left parked
        again = await on_b(f"?binary=true&resume={caller.session_id}", token=token)
        await continues(again, caller.sequence)
        await again.send({"type": "hangup"})
    finally:
        a.start()
