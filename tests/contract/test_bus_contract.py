"""One contract for every Bus: the in-process default and Redis (127.0.0.1:6379).

Each Redis test uses its own key prefix and deletes only its keys.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from portico.bus.memory_bus import InProcessBus
from portico.bus.port import Bus, Entry
from support.private_redis import PrivateRedis

REDIS_URL = "redis://127.0.0.1:6379/0"
DEADLINE = 10.0


def _redis_up() -> bool:
    try:
        import redis

        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except Exception:
        return False


@pytest.fixture(params=["memory", "redis"])
async def bus(request: pytest.FixtureRequest) -> AsyncIterator[Bus]:
    if request.param == "memory":
        memory = InProcessBus()
        yield memory
        await memory.close()
        return
    if not _redis_up():
        pytest.skip("Redis is not running at 127.0.0.1:6379")
    from portico.bus.redis_bus import RedisBus

    prefix = f"test-bus-{uuid.uuid4().hex}:"
    redis_bus = RedisBus(REDIS_URL, prefix=prefix, block=0.1)
    yield redis_bus
    await redis_bus.close()
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)


async def _take(entries: AsyncIterator[Entry], count: int) -> list[Entry]:
    async def take() -> list[Entry]:
        return [await anext(entries) for _ in range(count)]

    return await asyncio.wait_for(take(), DEADLINE)


async def test_each_subscriber_gets_every_entry_in_order_once(bus: Bus) -> None:
    first = bus.subscribe("session:a", after="0")
    second = bus.subscribe("session:a", after="0")
    for n in range(50):
        await bus.publish("session:a", f"chunk {n}".encode())
    for subscriber in (first, second):
        got = await _take(subscriber, 50)
        assert [entry.payload for entry in got] == [f"chunk {n}".encode() for n in range(50)]
        # Exactly once: nothing more arrives until something is published.
        pending = asyncio.ensure_future(anext(subscriber))
        await bus.publish("session:a", b"next")
        assert (await asyncio.wait_for(pending, DEADLINE)).payload == b"next"


async def test_a_topic_does_not_leak_into_another(bus: Bus) -> None:
    other = bus.subscribe("session:b", after="0")
    await bus.publish("session:a", b"for a")
    await bus.publish("session:b", b"for b")
    assert [entry.payload for entry in await _take(other, 1)] == [b"for b"]


async def test_a_subscriber_resumes_after_its_last_position(bus: Bus) -> None:
    positions = [await bus.publish("user:u", f"{n}".encode()) for n in range(5)]
    resumed = bus.subscribe("user:u", after=positions[2])
    assert [entry.payload for entry in await _take(resumed, 2)] == [b"3", b"4"]


async def test_a_batch_is_published_in_order_across_its_topics(bus: Bus) -> None:
    session = bus.subscribe("session:c", after="0")
    owner = bus.subscribe("owner:c", after="0")
    batch = [(topic, f"{n}".encode()) for n in range(20) for topic in ("session:c", "owner:c")]
    positions = await bus.publish_batch(batch)
    assert len(positions) == len(batch)
    expected = [f"{n}".encode() for n in range(20)]
    for subscriber in (session, owner):
        got = await _take(subscriber, 20)
        assert [entry.payload for entry in got] == expected
    # The positions are the entries' own: a reader resumes after any of them.
    resumed = bus.subscribe("session:c", after=positions[-4])  # entry 18 of session:c
    assert [entry.payload for entry in await _take(resumed, 1)] == [b"19"]


async def test_a_new_subscriber_without_position_sees_only_new_entries(bus: Bus) -> None:
    await bus.publish("user:u", b"old")
    live = bus.subscribe("user:u")
    pending = asyncio.ensure_future(anext(live))
    # The reader takes its position when it starts, which a publish may overtake (the
    # Redis bus publishes on a connection of its own): sent until one is read.
    async with asyncio.timeout(DEADLINE):
        while not pending.done():
            await bus.publish("user:u", b"new")
            await asyncio.wait({pending}, timeout=0.05)
    assert pending.result().payload == b"new"


async def test_the_last_position_is_where_a_reader_of_only_new_entries_starts(
    bus: Bus,
) -> None:
    empty = await bus.last_position("user:fresh")
    await bus.publish("user:fresh", b"first")  # a topic that was empty: from its start
    assert [e.payload for e in await _take(bus.subscribe("user:fresh", after=empty), 1)] == [
        b"first"
    ]
    last = await bus.last_position("user:fresh")
    assert last == (await bus.recent("user:fresh", 1))[0].position
    await bus.publish("user:fresh", b"second")
    assert [e.payload for e in await _take(bus.subscribe("user:fresh", after=last), 1)] == [
        b"second"
    ]


async def test_recent_entries_come_newest_first_and_bounded(bus: Bus) -> None:
    assert await bus.recent("session:r", 5) == []
    positions = [await bus.publish("session:r", f"{n}".encode()) for n in range(6)]
    await bus.publish("session:other", b"elsewhere")
    newest = await bus.recent("session:r", 4)
    assert [e.payload for e in newest] == [b"5", b"4", b"3", b"2"]
    assert [e.position for e in newest] == positions[:1:-1]
    assert [e.payload for e in await bus.recent("session:r", 100)] == [
        f"{n}".encode() for n in reversed(range(6))
    ]
    assert await bus.recent("session:r", 0) == []


async def test_control_reaches_only_its_replica_once(bus: Bus) -> None:
    inbox_a = bus.inbox("replica-a")
    inbox_b = bus.inbox("replica-b")
    take_a = asyncio.ensure_future(anext(inbox_a))
    take_b = asyncio.ensure_future(anext(inbox_b))
    await asyncio.sleep(0)
    await bus.send("replica-a", b"stop turn 1")
    await bus.send("replica-b", b"tool result 7")
    assert await asyncio.wait_for(take_a, DEADLINE) == b"stop turn 1"
    assert await asyncio.wait_for(take_b, DEADLINE) == b"tool result 7"
    again = asyncio.ensure_future(anext(inbox_a))
    await bus.send("replica-a", b"interrupt")
    assert await asyncio.wait_for(again, DEADLINE) == b"interrupt"


async def test_unsubscribing_stops_delivery(bus: Bus) -> None:
    subscriber = bus.subscribe("session:c", after="0")
    await bus.publish("session:c", b"one")
    assert (await _take(subscriber, 1))[0].payload == b"one"
    await subscriber.aclose()  # type: ignore[attr-defined]
    await bus.publish("session:c", b"two")
    with pytest.raises(StopAsyncIteration):
        await anext(subscriber)


async def test_redis_restart_mid_stream_loses_nothing_after_it(tmp_path: Path) -> None:
    """A reader and an inbox survive their Redis going away and coming back empty (a
    restart without persistence): each reconnects and gets what is sent after it. The
    Redis is the test's own (tests/support/private_redis.py), never the shared one."""
    from portico.bus.redis_bus import RedisBus

    with PrivateRedis(tmp_path / "redis") as server:
        bus = RedisBus(server.url, prefix="test-bus:", block=0.1)
        try:
            reader = bus.subscribe("session:r", after="0")
            inbox = bus.inbox("replica-r")
            await bus.publish("session:r", b"before")
            assert (await _take(reader, 1))[0].payload == b"before"
            pending = asyncio.ensure_future(anext(reader))
            control = asyncio.ensure_future(anext(inbox))
            await asyncio.sleep(0.2)  # both blocked in their reads
            await asyncio.to_thread(server.restart, 0.5)
            await _publish_once_back(bus, "session:r", b"after")
            assert (await asyncio.wait_for(pending, DEADLINE)).payload == b"after"
            await _send_until_taken(bus, "replica-r", control)
            assert control.result() == b"stop"
        finally:
            await bus.close()


async def _publish_once_back(bus: Bus, topic: str, payload: bytes) -> None:
    """Publish as soon as the restarted Redis takes writes (its client reconnects)."""
    async with asyncio.timeout(DEADLINE):
        while True:
            try:
                await bus.publish(topic, payload)
                return
            except RedisConnectionError:
                await asyncio.sleep(0.05)


async def _send_until_taken(bus: Bus, replica: str, taken: asyncio.Future[bytes]) -> None:
    """Control sent to an inbox whose group the restart lost: the inbox recreates its
    group after a failed read, so a message sent before that is not its to read (an
    entry older than the group's start); the sender's answer deadline covers that."""
    async with asyncio.timeout(DEADLINE):
        while not taken.done():
            await bus.send(replica, b"stop")
            await asyncio.wait({taken}, timeout=0.5)


async def test_a_redis_publish_is_written_before_the_loop_turns() -> None:
    """`publish_batch` puts its entries on the socket in the step that calls it: the
    first chunk of a turn leaves before the rest of the turn's burst runs. (redis-py's
    socket timeout wrote it from a task of its own on Python 3.11, a step later.)"""
    if not _redis_up():
        pytest.skip("Redis is not running at 127.0.0.1:6379")
    import redis

    from portico.bus.redis_bus import RedisBus

    prefix = f"test-bus-{uuid.uuid4().hex}:"
    bus = RedisBus(REDIS_URL, prefix=prefix, block=0.1)
    blocking = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        await bus.publish("session:w", b"warm")  # connected
        publishing = asyncio.ensure_future(bus.publish("session:w", b"first"))
        await asyncio.sleep(0)  # one step: the publish runs until it awaits its reply
        # The loop is held here: only bytes already written can have reached Redis.
        assert blocking.xlen(f"{prefix}topic:session:w") == 2
        await publishing
    finally:
        blocking.delete(f"{prefix}topic:session:w")
        blocking.close()
        await bus.close()


async def test_a_working_bus_is_ready(bus: Bus) -> None:
    health = await bus.health(DEADLINE)
    assert health.ready, health.reason


async def test_a_redis_bus_that_cannot_be_reached_is_not_ready_and_says_why() -> None:
    from portico.bus.redis_bus import RedisBus
    from support.replicas import free_port

    unreachable = RedisBus(f"redis://127.0.0.1:{free_port()}/0")
    try:
        health = await unreachable.health(DEADLINE)
    finally:
        await unreachable.close()
    assert not health.ready
    assert "ConnectionError" in health.reason, health.reason


async def test_redis_topics_expire_after_their_last_entry() -> None:
    if not _redis_up():
        pytest.skip("Redis is not running at 127.0.0.1:6379")
    import redis.asyncio as aioredis

    from portico.bus.redis_bus import RedisBus

    prefix = f"test-bus-{uuid.uuid4().hex}:"
    bus = RedisBus(REDIS_URL, prefix=prefix, block=0.1, topic_ttl=60)
    client = aioredis.from_url(REDIS_URL)
    try:
        await bus.publish_batch([("session:t", b"x"), ("session:t", b"y")])
        ttl = await client.ttl(f"{prefix}topic:session:t")
        assert 0 < ttl <= 60
    finally:
        await bus.close()
        await client.delete(f"{prefix}topic:session:t")
        await client.aclose()


async def test_a_stopped_replicas_inbox_expires_and_a_living_ones_does_not() -> None:
    """Redis backend: an inbox lives while its replica reads it. `inbox_ttl` is short
    here; messages still sent to the stopped replica do not keep its inbox."""
    if not _redis_up():
        pytest.skip("Redis is not running at 127.0.0.1:6379")
    import redis.asyncio as aioredis

    from portico.bus.redis_bus import RedisBus

    prefix = f"test-bus-{uuid.uuid4().hex}:"
    bus = RedisBus(REDIS_URL, prefix=prefix, block=0.1, inbox_ttl=1.0)
    client = aioredis.from_url(REDIS_URL)
    alive, gone = bus.inbox("replica-alive"), bus.inbox("replica-gone")
    try:
        for name, inbox in (("replica-alive", alive), ("replica-gone", gone)):
            taken = asyncio.ensure_future(anext(inbox))
            await bus.send(name, b"hello")
            assert await asyncio.wait_for(taken, DEADLINE) == b"hello"
        reading = asyncio.ensure_future(anext(alive))  # the living replica reads on
        await gone.aclose()  # type: ignore[attr-defined]  # the other one stopped
        gone_key = f"{prefix}inbox:replica-gone"
        async with asyncio.timeout(DEADLINE):
            while await client.exists(gone_key):
                await bus.send("replica-gone", b"for nobody")  # a sender does not renew
                await asyncio.sleep(0.2)
        assert await client.pttl(f"{prefix}inbox:replica-alive") > 0
        await bus.send("replica-alive", b"still here")
        assert await asyncio.wait_for(reading, DEADLINE) == b"still here"
    finally:
        await bus.close()
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
