"""Two engines, as two replicas would run them, sharing one archive, one bus and the
real Redis for their turn locks (127.0.0.1:6379): output of a turn reaches listeners
of the other engine in order and once; control sent to the other engine reaches the
turn; one turn per session across both.

In one process, so every step is observable; the same wiring across real processes is
tests/conformance/test_replicas_bus.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from portico.bus.memory_bus import InProcessBus
from portico.config import AgentSettings, load_settings
from portico.core.engine import Engine, UserMessage
from portico.core.events import TERMINAL_EVENTS, TurnChunk, TurnCompleted, TurnEvent, TurnToolCall
from portico.core.tools import ClientReply, ClientToolBroker
from portico.errors import (
    InvalidMessage,
    SessionExpired,
    StoreError,
    TurnInProgress,
    TurnReplicaGone,
)
from portico.replication.build import build_link
from portico.replication.link import BusLink
from portico.replication.turnlock import TurnLocks
from portico.runtime.base import Chunk, Done, ToolCall, TurnInput, TurnStream
from portico.store.memory import MemoryStore
from support.slowtcp import SlowRelay

REDIS_URL = "redis://127.0.0.1:6379/0"
WAIT = 5.0
LEASE = 3.0
FENCE_TTL = 600.0


class Gate:
    """Streams `count` chunks, then waits for `release` before it is done."""

    def __init__(self, count: int = 20) -> None:
        self.count = count
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.runs = 0

    async def run(self, turn: TurnInput) -> TurnStream:
        self.runs += 1
        self.started.set()
        for index in range(self.count):
            yield Chunk(f"c{index} ")
        await self.release.wait()
        yield Done()


class Tool:
    async def run(self, turn: TurnInput) -> TurnStream:
        reply = yield ToolCall(id=f"call-{uuid.uuid4().hex[:8]}", name="where", arguments={})
        yield Done(content=f"{reply.status if reply else '-'}:{reply.result if reply else ''}")


class Recorder:
    def __init__(self) -> None:
        self.events: list[TurnEvent] = []
        self.ended = asyncio.Event()
        self.got = asyncio.Event()

    def __call__(self, event: TurnEvent) -> None:
        self.events.append(event)
        self.got.set()
        if isinstance(event, TERMINAL_EVENTS):
            self.ended.set()

    async def terminal(self) -> TurnEvent:
        await asyncio.wait_for(self.ended.wait(), WAIT)
        return self.events[-1]

    async def first(self, kind: type[Any]) -> Any:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            for event in self.events:
                if isinstance(event, kind):
                    return event
            self.got.clear()
            await asyncio.wait_for(self.got.wait(), WAIT)
        raise AssertionError(f"no {kind.__name__} within {WAIT}s")


class Replica:
    def __init__(self, engine: Engine, tools: ClientToolBroker, link: BusLink) -> None:
        self.engine, self.tools, self.link = engine, tools, link


@pytest.fixture
async def redis() -> AsyncIterator[Any]:
    client = aioredis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        await client.ping()
    except Exception:
        pytest.fail("the replication tests need Redis at 127.0.0.1:6379")
    prefix = f"portico-test:{uuid.uuid4().hex[:12]}:"
    client.test_prefix = prefix
    yield client
    keys = [key async for key in client.scan_iter(match=prefix + "*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


class SlowBus(InProcessBus):
    """A bus with a round trip per publish, as Redis has: a backlog can form."""

    async def publish(self, topic: str, payload: bytes) -> str:
        return (await self.publish_batch([(topic, payload)]))[0]

    async def publish_batch(self, entries: Sequence[tuple[str, bytes]]) -> list[str]:
        await asyncio.sleep(0.01)  # what the link uses: one round trip per batch
        return await super().publish_batch(entries)


async def make_replicas(
    redis: Any,
    runtime: Any,
    bus: InProcessBus | None = None,
    *,
    lock_clients: dict[str, Any] | None = None,
) -> list[Replica]:
    """Replicas `rep-a` and `rep-b`; `lock_clients`: a replica's own Redis client for
    its turn locks (the others use `redis`)."""
    store, bus = MemoryStore(), bus or InProcessBus()
    replicas = []
    for name in ("rep-a", "rep-b"):
        tools = ClientToolBroker(store=store, ack_timeout=5, answer_timeout=10, clock=time.time)
        client = (lock_clients or {}).get(name, redis)
        locks = TurnLocks(
            client, prefix=redis.test_prefix, replica_id=name, lease=LEASE, fence_ttl=FENCE_TTL
        )
        link = BusLink(bus, locks, store, replica_id=name, lease=LEASE, control_timeout=1.0)
        link.bind_tools(tools)
        tools.relay = link
        engine = Engine(
            store=store,
            runtimes={"default": runtime},
            agents={"default": AgentSettings()},
            context_ttl=600,
            tools=tools,
            replica_id=name,
            link=link,
        )
        await engine.start()
        replicas.append(Replica(engine, tools, link))
    return replicas


@pytest.fixture
async def gate() -> Gate:
    return Gate()


async def stop_all(replicas: list[Replica]) -> None:
    for replica in replicas:
        await replica.engine.shutdown()


def message(session_id: str, content: str = "hi") -> UserMessage:
    return UserMessage(principal="alice", agent="default", session_id=session_id, content=content)


async def test_a_listener_on_one_replica_sees_a_turn_run_on_the_other_in_order_once(
    redis: Any, gate: Gate
) -> None:
    a, b = await make_replicas(redis, gate)
    try:
        watcher = Recorder()
        a.engine.attach("sess-1", watcher)
        a.engine.attach_owner("alice", owner_watcher := Recorder())
        await asyncio.sleep(0.05)  # the readers are up
        runner_side = Recorder()
        await b.engine.submit(message("sess-1"), runner_side)
        gate.release.set()
        await runner_side.terminal()
        assert isinstance(await watcher.terminal(), TurnCompleted)
        assert isinstance(await owner_watcher.terminal(), TurnCompleted)
        assert watcher.events == runner_side.events  # same events, same order, once each
        assert owner_watcher.events == runner_side.events
        texts = [e.text for e in watcher.events if isinstance(e, TurnChunk)]
        assert texts == [f"c{i} " for i in range(gate.count)]
        # And the other way round: nothing doubles on the replica running the turn.
        await asyncio.sleep(0.1)
        assert len(runner_side.events) == gate.count + 1
    finally:
        await stop_all([a, b])


async def test_a_takeovers_read_of_the_topic_waits_for_what_was_queued_not_for_quiet(
    redis: Any, gate: Gate
) -> None:
    """The replay of a session taken over mid-turn (server/session_replay.py) reads the
    topic once what the replica queued before it asked is out: on a busy replica the
    outbox is never empty, and a read waiting for that would time out every time."""
    a, b = await make_replicas(redis, gate, SlowBus())
    stop = asyncio.Event()

    async def other_sessions() -> None:  # keep b's outbox from ever emptying
        step = 0
        while not stop.is_set():
            step += 1
            b.link.published("sess-other", "bob", TurnChunk("sess-other", "t-x", "x", step=step))
            await asyncio.sleep(0.001)

    busy = asyncio.create_task(other_sessions())
    try:
        await b.engine.submit(message("sess-r"), Recorder())
        await asyncio.wait_for(gate.started.wait(), WAIT)
        await asyncio.sleep(0.05)  # the runtime's chunks are emitted, queued behind others
        async with asyncio.timeout(WAIT):
            newest_first = await b.link.recent_session_events("sess-r", 100)
        chunks = [e for e in reversed(newest_first) if isinstance(e, TurnChunk)]
        assert [c.text for c in chunks] == [f"c{i} " for i in range(gate.count)]
        assert [c.step for c in chunks] == list(range(1, gate.count + 1))
    finally:
        stop.set()
        await busy
        gate.release.set()
        await stop_all([a, b])


async def test_a_second_replica_cannot_start_a_turn_in_a_busy_session(
    redis: Any, gate: Gate
) -> None:
    a, b = await make_replicas(redis, gate)
    try:
        await a.engine.submit(message("sess-2"), Recorder())
        await asyncio.wait_for(gate.started.wait(), WAIT)
        with pytest.raises(TurnInProgress):
            await b.engine.submit(message("sess-2"))
        gate.release.set()
        await asyncio.wait_for(a.engine.wait_idle(WAIT), WAIT)
        await asyncio.sleep(0.1)  # the lock's release is a background write
        done = Recorder()
        await b.engine.submit(message("sess-2"), done)  # free again: B runs the next one
        assert isinstance(await done.terminal(), TurnCompleted)
        assert gate.runs == 2
    finally:
        await stop_all([a, b])


async def test_a_turn_end_relayed_to_the_other_replica_finds_the_session_free(
    redis: Any, gate: Gate
) -> None:
    """A client on A that reads the `done` of B's turn and sends its next message at once
    is not told the turn is still in progress: B frees the session's lock before the
    turn's end goes out. B's lock writes cross a slow link, so a release sent beside
    (not before) the end would still be on its way when A asks for the lock."""
    with SlowRelay(("127.0.0.1", 6379), delay=0.3) as relay:
        slow = aioredis.from_url(f"redis://127.0.0.1:{relay.port}/0", socket_timeout=5)
        a, b = await make_replicas(redis, gate, lock_clients={"rep-b": slow})
        try:
            watcher = Recorder()
            a.engine.attach("sess-free", watcher)
            await asyncio.sleep(0.05)  # the reader is up
            await b.engine.submit(message("sess-free"), Recorder())
            gate.release.set()
            assert isinstance(await watcher.terminal(), TurnCompleted)
            next_turn = Recorder()
            await a.engine.submit(message("sess-free", "next"), next_turn)
            assert isinstance(await next_turn.terminal(), TurnCompleted)
        finally:
            await stop_all([a, b])
            await slow.aclose()


async def test_racing_submits_on_two_replicas_run_one_turn(redis: Any, gate: Gate) -> None:
    a, b = await make_replicas(redis, gate)
    try:
        results = await asyncio.gather(
            a.engine.submit(message("sess-3")),
            b.engine.submit(message("sess-3")),
            return_exceptions=True,
        )
        refused = [r for r in results if isinstance(r, TurnInProgress)]
        assert len(refused) == 1, results
        gate.release.set()
    finally:
        await stop_all([a, b])


async def one_turn_then_free(replica: Replica, gate: Gate, session_id: str) -> None:
    """A turn of `session_id` run to its end on `replica`, its lock released: the
    replica now knows alice as the session's owner."""
    gate.release.set()
    done = Recorder()
    await replica.engine.submit(message(session_id), done)
    assert isinstance(await done.terminal(), TurnCompleted)
    await replica.link._flush(WAIT)  # the lock's release goes out with the publisher


def lock_key(redis: Any, session_id: str) -> str:
    return f"{redis.test_prefix}turnlock:{{{session_id}}}"


async def test_the_owners_next_turn_claims_its_lock_while_its_session_is_read(
    redis: Any, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn lock's round trip no longer waits for the session's read (a PostgreSQL
    round trip) when this replica knows the sender owns the session: the read below
    returns only once the lock is in Redis, which a claim made after it never is."""
    a, b = await make_replicas(redis, gate)
    try:
        await one_turn_then_free(a, gate, "sess-ahead")
        store, read = a.engine.store, a.engine.store.get_session

        async def read_once_locked(session_id: str) -> Any:
            async with asyncio.timeout(WAIT):
                while not await redis.exists(lock_key(redis, session_id)):  # noqa: ASYNC110 (Redis)
                    await asyncio.sleep(0.01)
            return await read(session_id)

        monkeypatch.setattr(store, "get_session", read_once_locked)
        done = Recorder()
        await a.engine.submit(message("sess-ahead", "again"), done)
        assert isinstance(await done.terminal(), TurnCompleted)
    finally:
        await stop_all([a, b])


async def test_another_principals_message_never_takes_the_sessions_lock(
    redis: Any, gate: Gate
) -> None:
    """A foreign sender is answered `SessionExpired` before any claim: the session's
    fencing counter (one grant, one step) does not move, so the lock was never its."""
    a, b = await make_replicas(redis, gate)
    try:
        await one_turn_then_free(a, gate, "sess-foreign")
        fence = f"{redis.test_prefix}turnfence:{{sess-foreign}}"
        before = await redis.get(fence)
        foreign = UserMessage(
            principal="mallory", agent="default", session_id="sess-foreign", content="x"
        )
        for _ in range(3):
            with pytest.raises(SessionExpired):
                await a.engine.submit(foreign)
        assert await redis.get(fence) == before
        assert not await redis.exists(lock_key(redis, "sess-foreign"))
    finally:
        await stop_all([a, b])


async def test_a_lock_claimed_ahead_of_a_failed_session_read_is_released(
    redis: Any, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner's claim went out beside the read; the read failed at once (the archive
    is down), before the claim's answer: the submit fails with the read's error once
    the claim answered, and the lock it was granted is released, so the session is
    free for another replica at once, not after the lease."""
    a, b = await make_replicas(redis, gate)
    try:
        await one_turn_then_free(a, gate, "sess-unread")
        store, read = a.engine.store, a.engine.store.get_session

        async def read_fails(session_id: str) -> Any:
            raise StoreError("archive read failed")

        monkeypatch.setattr(store, "get_session", read_fails)
        with pytest.raises(StoreError):
            await a.engine.submit(message("sess-unread", "again"))
        monkeypatch.setattr(store, "get_session", read)
        await a.link._flush(WAIT)
        done = Recorder()
        await b.engine.submit(message("sess-unread", "elsewhere"), done)
        assert isinstance(await done.terminal(), TurnCompleted)
    finally:
        await stop_all([a, b])


class StubbornBus(InProcessBus):
    """A bus whose topic reader misses the first cancellation and reads on."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = asyncio.Event()
        self.released = asyncio.Event()

    async def subscribe(self, topic: str, after: str = "") -> AsyncIterator[Any]:
        self.reading.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await self.released.wait()  # the cancellation is lost, as in the client
        yield  # never reached


async def test_a_replica_stops_even_when_a_reader_misses_its_cancellation(
    redis: Any,
) -> None:
    bus = StubbornBus()
    a, b = await make_replicas(redis, Gate(1), bus)
    try:
        a.engine.attach("sess-stubborn", Recorder())  # a reader for the session's topic
        async with asyncio.timeout(WAIT):
            await bus.reading.wait()
            await a.link.close()  # returns: the reader is left to the process's end
    finally:
        bus.released.set()
        await stop_all([a, b])


async def test_a_stop_sent_to_the_other_replica_stops_the_turn(redis: Any, gate: Gate) -> None:
    a, b = await make_replicas(redis, gate)
    try:
        running = Recorder()
        await a.engine.submit(message("sess-4"), running)
        await asyncio.wait_for(gate.started.wait(), WAIT)
        assert await b.engine.stop("sess-4") is True
        ended = await running.terminal()
        assert isinstance(ended, TurnCompleted)
        assert ended.cancelled
        assert await b.engine.stop("sess-4") is False  # nothing runs anywhere now
    finally:
        await stop_all([a, b])


async def test_a_tool_result_sent_to_the_other_replica_reaches_the_turn(redis: Any) -> None:
    a, b = await make_replicas(redis, Tool())
    try:
        watcher = Recorder()
        b.engine.attach("sess-5", watcher)
        await asyncio.sleep(0.05)
        running = Recorder()
        await a.engine.submit(message("sess-5"), running)
        call = await watcher.first(TurnToolCall)  # relayed to B's listener
        # Another principal's reply looks exactly like one for an unknown call.
        with pytest.raises(InvalidMessage):
            await b.tools.settle("mallory", call.call.id, ClientReply(kind="ack"))
        await b.tools.settle("alice", call.call.id, ClientReply(kind="ack"))
        await b.tools.settle("alice", call.call.id, ClientReply(kind="result", result="Oslo"))
        ended = await running.terminal()
        assert isinstance(ended, TurnCompleted)
        assert ended.content == "completed:Oslo"
        assert isinstance(await watcher.terminal(), TurnCompleted)
        with pytest.raises(InvalidMessage):  # ended: unknown everywhere
            await b.tools.settle("alice", call.call.id, ClientReply(kind="ack"))
    finally:
        await stop_all([a, b])


async def test_control_for_a_replica_that_is_gone_is_a_defined_error(redis: Any) -> None:
    a, b = await make_replicas(redis, Tool())
    try:
        watcher = Recorder()
        b.engine.attach("sess-6", watcher)
        await asyncio.sleep(0.05)
        await a.engine.submit(message("sess-6"), Recorder())
        call = await watcher.first(TurnToolCall)
        # A stops reading its inbox (as a replica that hangs or died before its lease
        # ran out): B's request is not answered in time.
        inbox = next(t for t in a.link._tasks if t.get_name() == "bus-inbox")
        inbox.cancel()
        with pytest.raises(TurnReplicaGone):
            await b.tools.settle("alice", call.call.id, ClientReply(kind="result", result="x"))
        # Its lease lapsed: no lock names it, the archive still has the turn running.
        await redis.delete(f"{redis.test_prefix}turnlock:{{sess-6}}")
        with pytest.raises(TurnReplicaGone):
            await b.tools.settle("alice", call.call.id, ClientReply(kind="result", result="x"))
    finally:
        await stop_all([a, b])


async def test_rpc_messages_waiting_on_one_replica_run_after_the_other_replicas_turn(
    redis: Any, gate: Gate
) -> None:
    a, b = await make_replicas(redis, gate)
    try:
        session = await a.engine.open_session(principal="alice", agent="default", session_id="s7")
        running = Recorder()
        await a.engine.submit(message("s7"), running)
        await asyncio.wait_for(gate.started.wait(), WAIT)
        # Two RPC sends land on B while A's turn runs: they wait, then merge (one turn).
        waiting = Recorder()
        b.engine.attach("s7", waiting)
        await b.engine.enqueue(session, message("s7", "first"))
        await b.engine.enqueue(session, message("s7", "second"))
        await asyncio.sleep(0.3)
        assert gate.runs == 1  # B did not start a turn beside A's
        gate.release.set()
        await running.terminal()
        async with asyncio.timeout(WAIT):
            while len([e for e in waiting.events if isinstance(e, TERMINAL_EVENTS)]) < 2:
                waiting.got.clear()
                await waiting.got.wait()
        assert gate.runs == 2  # the two waiting messages ran as one turn, on B
        turns = await a.engine.store.list_turns("s7")
        assert sorted(t.state.value for t in turns) == ["completed", "completed", "merged"]
        assert {t.replica for t in turns if t.state.value == "completed"} == {"rep-a", "rep-b"}
    finally:
        await stop_all([a, b])


async def test_an_rpc_message_whose_turn_takes_the_lock_counts_as_running(
    redis: Any, gate: Gate
) -> None:
    """The drain stops once no turn runs: an RPC message accepted while its turn waits
    for the lock (a round trip, slow here) must count, or a draining replica would stop
    and leave it pending (the rolling restart's unanswered RPC message)."""
    with SlowRelay(("127.0.0.1", 6379), delay=0.3) as relay:
        slow = aioredis.from_url(f"redis://127.0.0.1:{relay.port}/0", socket_timeout=5)
        a, b = await make_replicas(redis, gate, lock_clients={"rep-a": slow})
        try:
            session = await a.engine.open_session(
                principal="alice", agent="default", session_id="s-drain"
            )
            ended = Recorder()
            a.engine.attach(session.id, ended)
            gate.release.set()
            await a.engine.enqueue(session, message(session.id))
            assert a.engine.running_turns == 1  # its lock is on its way
            assert isinstance(await ended.terminal(), TurnCompleted)
            await asyncio.wait_for(a.engine.wait_idle(WAIT), WAIT)
            assert a.engine.running_turns == 0
        finally:
            await stop_all([a, b])
            await slow.aclose()


async def test_a_replica_shutting_down_sends_its_turns_terminal_events_before_it_goes(
    redis: Any, gate: Gate
) -> None:
    a, b = await make_replicas(redis, gate, SlowBus())
    try:
        watcher = Recorder()
        b.engine.attach("s8", watcher)
        await asyncio.sleep(0.05)
        await a.engine.submit(message("s8"), Recorder())
        await asyncio.wait_for(gate.started.wait(), WAIT)
        await a.engine.shutdown()  # interrupts the turn, then closes the link
        assert type(await watcher.terminal()) in TERMINAL_EVENTS
        # Its lock is released too: B may run the session's next turn at once.
        assert await b.link.claim("s8") is True
    finally:
        await b.engine.shutdown()


async def test_the_turn_lock_names_its_holder_with_an_increasing_token_and_lapses(
    redis: Any,
) -> None:
    a = TurnLocks(redis, prefix=redis.test_prefix, replica_id="rep-a", lease=0.3, fence_ttl=60)
    b = TurnLocks(redis, prefix=redis.test_prefix, replica_id="rep-b", lease=0.3, fence_ttl=60)
    assert await a.acquire("s9") is True
    assert await b.acquire("s9") is False
    first = await b.holder("s9")
    assert first is not None
    assert first.replica == "rep-a"
    await a.release("s9")
    assert await b.holder("s9") is None
    assert await b.acquire("s9") is True
    second = await a.holder("s9")
    assert second is not None
    assert (second.replica, second.fence > first.fence) == ("rep-b", True)
    assert await b.renew_all() == []  # still its own
    await asyncio.sleep(0.5)  # not renewed: the lease lapses, as when rep-b dies
    assert await a.acquire("s9") is True
    assert await b.renew_all() == ["s9"]  # rep-b finds it lost


async def test_a_renewal_arriving_after_the_release_does_not_take_the_lock_back(
    redis: Any,
) -> None:
    """A renewal sent before the turn's end and answered after its release found the
    lock gone and took it again: the session stayed locked for a lease, and a message
    sent to another replica got `TURN_IN_PROGRESS` (bench/replicas.py, first chunk)."""
    a = TurnLocks(redis, prefix=redis.test_prefix, replica_id="rep-a", lease=30, fence_ttl=90)
    b = TurnLocks(redis, prefix=redis.test_prefix, replica_id="rep-b", lease=30, fence_ttl=90)
    assert await a.acquire("s11") is True
    value = a._held["s11"]
    await a.release("s11")
    token = value.rpartition("|")[2]
    late = await a._renew(keys=a._keys("s11"), args=[value, 30_000, 90_000, token])
    assert late == 0
    assert await b.acquire("s11") is True


async def test_a_lock_released_while_the_renewals_run_is_neither_renewed_nor_lost(
    redis: Any,
) -> None:
    a = TurnLocks(redis, prefix=redis.test_prefix, replica_id="rep-a", lease=30, fence_ttl=90)
    b = TurnLocks(redis, prefix=redis.test_prefix, replica_id="rep-b", lease=30, fence_ttl=90)
    for session in ("s12", "s13", "s14"):
        assert await a.acquire(session) is True
    renew = a._renew

    async def turn_ends_meanwhile(**kwargs: Any) -> Any:
        if a.holds("s13"):
            await a.release("s13")  # the turn of s13 ends while s12 is renewed
        return await renew(**kwargs)

    a._renew = turn_ends_meanwhile
    assert await a.renew_all() == []
    assert await b.acquire("s13") is True
    assert await b.acquire("s12") is False  # the others are still held, and renewed


async def test_a_turn_on_the_other_replica_is_seen_as_running_elsewhere(
    redis: Any, gate: Gate
) -> None:
    """What a credential close on one replica waits for (docs/replicas.md)."""
    a, b = await make_replicas(redis, gate)
    try:
        a.engine.attach_owner("alice", owner_watcher := Recorder())
        await asyncio.sleep(0.05)  # the readers are up
        running = Recorder()
        await b.engine.submit(message("sess-elsewhere"), running)
        await asyncio.wait_for(gate.started.wait(), WAIT)
        assert await a.engine.runs_elsewhere(["sess-other", "sess-elsewhere"])
        assert not await b.engine.runs_elsewhere(["sess-elsewhere"])  # it runs here
        await owner_watcher.first(TurnChunk)  # A saw B's first chunk for alice
        assert await a.engine.runs_a_turn_elsewhere_for("alice")
        assert not await a.engine.runs_a_turn_elsewhere_for("bob")
        gate.release.set()
        await running.terminal()
        await b.link._flush(WAIT)  # the lock's release is a background write
        assert not await a.engine.runs_elsewhere(["sess-elsewhere"])
        assert not await a.engine.runs_a_turn_elsewhere_for("alice")
    finally:
        await stop_all([a, b])


async def until_gone(redis: Any, key: str) -> None:
    deadline = time.monotonic() + WAIT
    while await redis.exists(key):
        assert time.monotonic() < deadline, f"{key} still in Redis after {WAIT}s"
        await asyncio.sleep(0.05)


async def test_a_sessions_fence_counter_lives_while_its_lock_is_held_and_expires_when_idle(
    redis: Any, gate: Gate
) -> None:
    """`turn_fence_ttl` (docs/replicas.md): the counter is kept by every grant, renewal
    and release, so only an idle session's counter leaves Redis."""
    settings = load_settings(
        env={
            "PORTICO_BUS": "redis",
            "PORTICO_REDIS_KEY_PREFIX": redis.test_prefix,
            "PORTICO_REPLICA_LEASE": "0.3",
            "PORTICO_TURN_END_RETRY_WINDOW": "0.1",
            "PORTICO_TURN_FENCE_TTL": "0.7",
        }
    )
    settings.check_startable()
    store = MemoryStore()
    link = build_link(settings, store, "rep-a", InProcessBus())
    assert link is not None
    engine = Engine(
        store=store,
        runtimes={"default": gate},
        agents={"default": AgentSettings()},
        context_ttl=600,
        replica_id="rep-a",
        link=link,
        replica_lease=settings.replica_lease,
    )
    await engine.start()
    fence_key = f"{redis.test_prefix}turnfence:{{sess-fence}}"
    try:
        running = Recorder()
        await engine.submit(message("sess-fence"), running)
        await asyncio.wait_for(gate.started.wait(), WAIT)
        first = await link._locks.holder("sess-fence")
        assert first is not None
        # Held three expiries long: the renewals (every lease / 3) keep the counter.
        for _ in range(3):
            await asyncio.sleep(settings.turn_fence_ttl)
            assert await redis.exists(fence_key), "the counter expired under its holder"
        assert await link._locks.holder("sess-fence") == first
        gate.release.set()
        await running.terminal()
        await link._flush(WAIT)  # the lock's release is a background write
        await until_gone(redis, fence_key)
        # A grant after the counter restarted is still above every earlier token.
        assert await link.claim("sess-fence")
        again = await link._locks.holder("sess-fence")
        assert again is not None
        assert again.fence > first.fence
        link.release("sess-fence")
        await link._flush(WAIT)
    finally:
        await engine.shutdown()


async def test_a_lapsed_lock_is_not_taken_back_under_a_token_older_than_a_later_grant(
    redis: Any,
) -> None:
    """A renewal finding its lock gone takes it again only if no grant came since:
    otherwise the session's token would go backwards."""
    a = TurnLocks(redis, prefix=redis.test_prefix, replica_id="rep-a", lease=0.3, fence_ttl=60)
    b = TurnLocks(redis, prefix=redis.test_prefix, replica_id="rep-b", lease=0.3, fence_ttl=60)
    assert await a.acquire("s10") is True
    await asyncio.sleep(0.5)  # not renewed: the lease lapses, as when rep-a pauses
    assert await b.acquire("s10") is True
    await b.release("s10")
    assert await a.renew_all() == ["s10"]
    assert await b.holder("s10") is None
