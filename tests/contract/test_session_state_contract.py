"""The session state port's contract: the in-process and Redis backends pass one suite.

What it pins is the exactly-once ledger of docs/replicas.md ("Session state"): a
message recorded as sent survives until acknowledged, a client seq is handled once
across every holder, and a newer claim fences the older one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

import support.fuzzing  # noqa: F401  (Hypothesis settings, see the module)
from portico.errors import BufferOverflow, ProtocolViolation, ResumeFailed, SessionMoved
from portico.sessionstate.base import (
    ENDED_TURNS_KEPT,
    NO_MARK,
    BufferLimits,
    SessionHeader,
    SessionStates,
    TurnMark,
)
from portico.sessionstate.memory import InProcessSessionStates
from portico.sessionstate.redis import EXPIRY_GRACE_MS, RedisSessionStates
from support.redis import REDIS_URL, redis_client, run_prefix, session_keys, until_gone

LIMITS = BufferLimits(max_messages=4, max_bytes=64)
SID = "ses_contract"


@pytest.fixture(params=["memory", "redis"])
async def states(request: pytest.FixtureRequest) -> AsyncIterator[SessionStates]:
    if request.param == "memory":
        yield InProcessSessionStates(LIMITS)
        return
    prefix = run_prefix()
    async with redis_client(prefix) as client:
        states = RedisSessionStates(client, LIMITS, prefix=prefix)
        yield states
        await states.close()  # its renewal task


@pytest.fixture
async def redis_pair() -> AsyncIterator[tuple[RedisSessionStates, RedisSessionStates]]:
    """Two replicas' views of one Redis, each with its own connection."""
    prefix = run_prefix()
    async with redis_client(prefix) as a, redis_client(prefix) as b:
        yield (
            RedisSessionStates(a, LIMITS, prefix=prefix),
            RedisSessionStates(b, LIMITS, prefix=prefix),
        )


async def test_a_new_session_starts_empty_at_epoch_one(states: SessionStates) -> None:
    assert await states.create(SID, capabilities=b'{"media":true}') == 1
    snap = await states.load(SID)
    assert snap is not None
    assert (snap.epoch, snap.next_seq, snap.handled, snap.peer_acked) == (1, 1, 0, 0)
    assert snap.unacknowledged == ()
    assert snap.capabilities == b'{"media":true}'
    assert snap.window_deadline is None


async def test_an_unknown_session_loads_as_none_and_cannot_be_claimed(
    states: SessionStates,
) -> None:
    assert await states.load("ses_nobody") is None
    with pytest.raises(ResumeFailed):
        await states.claim("ses_nobody")


async def test_sent_messages_stay_until_a_cumulative_ack(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    for seq in (1, 2, 3):
        await states.record_sent(SID, epoch, seq, b"m%d" % seq)
    await states.record_ack(SID, epoch, 2)
    await states.record_ack(SID, epoch, 1)  # a regressing ack changes nothing
    snap = await states.load(SID)
    assert snap is not None
    assert snap.unacknowledged == ((3, b"m3"),)
    assert (snap.next_seq, snap.peer_acked) == (4, 2)


async def test_an_ack_beyond_what_was_sent_is_a_violation(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    await states.record_sent(SID, epoch, 1, b"m1")
    with pytest.raises(ProtocolViolation):
        await states.record_ack(SID, epoch, 2)


async def test_a_sent_seq_out_of_order_is_refused(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    with pytest.raises(ProtocolViolation):
        await states.record_sent(SID, epoch, 2, b"m2")


async def test_the_buffer_is_bounded_by_messages(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    for seq in range(1, LIMITS.max_messages + 1):
        await states.record_sent(SID, epoch, seq, b"x")
    with pytest.raises(BufferOverflow):
        await states.record_sent(SID, epoch, LIMITS.max_messages + 1, b"x")
    await states.record_ack(SID, epoch, 1)  # an ack frees room
    await states.record_sent(SID, epoch, LIMITS.max_messages + 1, b"x")


async def test_the_buffer_is_bounded_by_bytes(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    await states.record_sent(SID, epoch, 1, b"a" * 40)
    with pytest.raises(BufferOverflow):
        await states.record_sent(SID, epoch, 2, b"b" * 25)
    await states.record_ack(SID, epoch, 1)
    await states.record_sent(SID, epoch, 2, b"b" * 25)
    snap = await states.load(SID)
    assert snap is not None
    assert snap.unacknowledged == ((2, b"b" * 25),)


async def test_a_client_seq_is_handled_once_and_in_order(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    assert await states.record_handled(SID, epoch, 1) is True
    assert await states.record_handled(SID, epoch, 1) is False
    with pytest.raises(ProtocolViolation):
        await states.record_handled(SID, epoch, 3)
    assert await states.record_handled(SID, epoch, 2) is True
    snap = await states.load(SID)
    assert snap is not None
    assert snap.handled == 2


async def test_a_claim_fences_every_write_of_the_older_epoch(states: SessionStates) -> None:
    old = await states.create(SID, capabilities=b"")
    await states.record_sent(SID, old, 1, b"m1")
    new = await states.claim(SID)
    assert new > old
    writes: list[Callable[[], object]] = [
        lambda: states.record_sent(SID, old, 2, b"m2"),
        lambda: states.record_ack(SID, old, 1),
        lambda: states.record_handled(SID, old, 1),
        lambda: states.set_window(SID, old, 10.0),
    ]
    for write in writes:
        with pytest.raises(SessionMoved):
            await write()  # type: ignore[misc]
    snap = await states.load(SID)
    assert snap is not None
    assert (snap.epoch, snap.next_seq, snap.handled, snap.peer_acked) == (new, 2, 0, 0)
    assert snap.unacknowledged == ((1, b"m1"),)


async def test_the_window_deadline_is_kept_and_cleared(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    deadline = time.time() + 1234.5  # a deadline long past is forgotten (Redis: expired)
    await states.set_window(SID, epoch, deadline)
    snap = await states.load(SID)
    assert snap is not None
    assert snap.window_deadline == deadline
    await states.set_window(SID, epoch, None)
    snap = await states.load(SID)
    assert snap is not None
    assert snap.window_deadline is None


async def test_the_header_has_the_sessions_fields_and_none_of_its_buffer(
    states: SessionStates,
) -> None:
    """What a resume checks ownership with before it claims (docs/replicas.md)."""
    assert await states.header("ses_nobody") is None
    epoch = await states.create(SID, capabilities=b'{"owner":"alice"}')
    for seq in (1, 2, 3):
        await states.record_sent(SID, epoch, seq, b"m%d" % seq)
    deadline = time.time() + 1234.5
    await states.set_window(SID, epoch, deadline)
    assert await states.header(SID) == SessionHeader(
        epoch=epoch, capabilities=b'{"owner":"alice"}', window_deadline=deadline
    )
    claimed = await states.claim(SID)
    assert await states.header(SID) == SessionHeader(
        epoch=claimed, capabilities=b'{"owner":"alice"}', window_deadline=None
    )
    await states.remove(SID)
    assert await states.header(SID) is None


async def test_a_removed_session_is_gone(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    await states.record_sent(SID, epoch, 1, b"m1")
    await states.remove(SID)
    assert await states.load(SID) is None


async def test_claim_and_load_is_a_claim_then_its_snapshot_in_one_step(
    states: SessionStates,
) -> None:
    """A resume on another replica: the new epoch, the backlog, the positions, the
    ended turns and no window, as `claim` then `load` give them; the older epoch is
    fenced; the session's expiry is held again (Redis: its keys' TTLs)."""
    epoch = await states.create(SID, capabilities=b"caps")
    await states.record_sent(SID, epoch, 1, b"m1")
    await states.record_sent(SID, epoch, 2, b"m2", TurnMark("turn_1"))
    await states.record_ack(SID, epoch, 1)
    assert await states.record_handled(SID, epoch, 1)
    await states.set_window(SID, epoch, time.time() + 60)
    snap = await states.claim_and_load(SID)
    assert snap == await states.load(SID)
    assert snap.epoch == epoch + 1
    assert (snap.next_seq, snap.handled, snap.peer_acked) == (3, 1, 1)
    assert snap.unacknowledged == ((2, b"m2"),)
    assert (snap.capabilities, snap.window_deadline, snap.ended_turns) == (
        b"caps",
        None,
        ("turn_1",),
    )
    with pytest.raises(SessionMoved):
        await states.record_sent(SID, epoch, 3, b"m3")
    await states.record_sent(SID, snap.epoch, 3, b"m3")
    with pytest.raises(ResumeFailed):
        await states.claim_and_load("ses_nobody")


async def test_claim_and_load_holds_the_session_again_in_redis() -> None:
    """A windowed session's keys expire with the window; claimed and loaded, they
    take the held expiry (resume window + grace), as after `claim`."""
    prefix = run_prefix()
    async with redis_client(prefix) as a_client, redis_client(prefix) as b_client:
        a = RedisSessionStates(a_client, LIMITS, prefix=prefix)
        b = RedisSessionStates(b_client, LIMITS, prefix=prefix)
        epoch = await a.create(SID, capabilities=b"")
        await a.record_sent(SID, epoch, 1, b"m1", TurnMark("turn_1"))
        await a.set_window(SID, epoch, time.time() + 1)  # keys expire in 1 + 60 s
        await b.claim_and_load(SID)  # held: 30 + 60 s
        ttls = [await a_client.pttl(key) for key in session_keys(prefix, SID)]
        await a.close()
        await b.close()
    assert all(ttl > 75_000 for ttl in ttls), ttls  # the held expiry, not the window's


async def test_a_claim_clears_the_window_deadline(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    await states.set_window(SID, epoch, time.time() + 1234.5)
    await states.claim(SID)
    snap = await states.load(SID)
    assert snap is not None
    assert snap.window_deadline is None


async def test_a_ledger_created_over_another_fences_the_old_numbering(
    states: SessionStates,
) -> None:
    """A continued conversation starts a new numbering under the same id: whoever
    held the old one must not write into the new one."""
    old = await states.create(SID, capabilities=b"")
    await states.record_sent(SID, old, 1, b"m1")
    new = await states.create(SID, capabilities=b"again")
    assert new > old
    with pytest.raises(SessionMoved):
        await states.record_sent(SID, old, 1, b"stale")
    snap = await states.load(SID)
    assert snap is not None
    assert (snap.epoch, snap.next_seq, snap.unacknowledged) == (new, 1, ())


async def test_handled_and_new_capabilities_are_one_step(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"before")
    assert await states.record_handled(SID, epoch, 1, capabilities=b"after")
    # A duplicate changes nothing, capabilities included.
    assert not await states.record_handled(SID, epoch, 1, capabilities=b"again")
    new = await states.claim(SID)
    with pytest.raises(SessionMoved):
        await states.record_handled(SID, epoch, 2, capabilities=b"stale")
    snap = await states.load(SID)
    assert snap is not None
    assert (snap.handled, snap.capabilities, snap.epoch) == (1, b"after", new)


async def test_a_fenced_remove_spares_a_newer_holder(states: SessionStates) -> None:
    old = await states.create(SID, capabilities=b"")
    new = await states.claim(SID)
    await states.remove(SID, old)  # the old holder's window passed: not its session now
    assert await states.load(SID) is not None
    await states.remove(SID, new)
    assert await states.load(SID) is None
    await states.remove(SID, new)  # already gone: nothing to do


async def test_the_latest_ended_turns_are_kept_newest_first(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    await states.record_sent(SID, epoch, 1, b"c")
    await states.record_sent(SID, epoch, 2, b"d", TurnMark("t1"))
    await states.record_sent(SID, epoch, 3, b"d", TurnMark("t2"))
    snap = await states.load(SID)
    assert snap is not None
    assert snap.ended_turns == ("t2", "t1")


async def test_only_the_latest_ended_turns_are_kept(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    for seq in range(1, ENDED_TURNS_KEPT + 3):
        await states.record_sent(SID, epoch, seq, b"d", TurnMark(f"t{seq}"))
        await states.record_ack(SID, epoch, seq)
    snap = await states.load(SID)
    assert snap is not None
    assert len(snap.ended_turns) == ENDED_TURNS_KEPT
    assert snap.ended_turns[0] == f"t{ENDED_TURNS_KEPT + 2}"


async def test_the_latest_turn_step_is_kept_with_its_message(states: SessionStates) -> None:
    epoch = await states.create(SID, capabilities=b"")
    snap = await states.load(SID)
    assert snap is not None
    assert snap.last_step == ("", 0)
    # Turn ids may hold spaces: the Redis port splits at the last one.
    await states.record_sent(SID, epoch, 1, b"c", TurnMark(step=("turn_a b", 3)))
    await states.record_sent(SID, epoch, 2, b"x")  # no turn event: the step stays
    snap = await states.claim_and_load(SID)
    assert snap.last_step == ("turn_a b", 3)
    await states.record_sent(SID, snap.epoch, 3, b"d", TurnMark("t1", ("t1", 9)))
    snap = await states.load(SID)
    assert snap is not None
    assert snap.last_step == ("t1", 9)


async def test_a_fenced_message_leaves_the_step_as_it_was(states: SessionStates) -> None:
    old = await states.create(SID, capabilities=b"")
    await states.record_sent(SID, old, 1, b"c", TurnMark(step=("t1", 1)))
    await states.claim(SID)
    with pytest.raises(SessionMoved):
        await states.record_sent(SID, old, 2, b"c", TurnMark(step=("t1", 2)))
    snap = await states.load(SID)
    assert snap is not None
    assert snap.last_step == ("t1", 1)


async def test_another_replica_resumes_with_the_backlog_and_fences_the_first(
    redis_pair: tuple[RedisSessionStates, RedisSessionStates],
) -> None:
    a, b = redis_pair
    epoch_a = await a.create(SID, capabilities=b"caps")
    await a.record_sent(SID, epoch_a, 1, b"m1")
    await a.record_sent(SID, epoch_a, 2, b"m2")
    assert await a.record_handled(SID, epoch_a, 1)
    epoch_b = await b.claim(SID)  # the client reconnects through the balancer to b
    snap = await b.load(SID)
    assert snap is not None
    assert snap.unacknowledged == ((1, b"m1"), (2, b"m2"))
    assert snap.handled == 1  # b will not apply client message 1 again
    assert await b.record_handled(SID, epoch_b, 1) is False
    with pytest.raises(SessionMoved):
        await a.record_sent(SID, epoch_a, 3, b"m3")  # a's socket, still alive, stops
    await b.record_sent(SID, epoch_b, 3, b"m3")


async def test_redis_forgets_a_session_whose_window_passed_long_ago() -> None:
    """No replica may be left to remove it: Redis expires it after the window's grace."""
    prefix = run_prefix()
    async with redis_client(prefix) as client:
        states = RedisSessionStates(client, LIMITS, prefix=prefix)
        epoch = await states.create(SID, capabilities=b"")
        await states.record_sent(SID, epoch, 1, b"m1")
        await states.record_ack(SID, epoch, 1)  # the buffer is empty: no list key
        await states.set_window(SID, epoch, time.time() + 30)
        await states.record_sent(SID, epoch, 2, b"m2", TurnMark("t2"))
        assert len(await client.keys(prefix + "*")) == 3
        # Every key of the session expires with it, those written in the window too.
        for key in await client.keys(prefix + "*"):
            assert await client.pttl(key) > 0, key
        await states.claim(SID)  # resumed: held again, no deadline, the holder's expiry
        for key in await client.keys(prefix + "*"):
            assert 0 < await client.pttl(key) <= (30 + EXPIRY_GRACE_MS / 1000) * 1000, key
        epoch = (await states.load(SID)).epoch  # type: ignore[union-attr]
        await states.set_window(SID, epoch, time.time() - 2 * EXPIRY_GRACE_MS / 1000)
        assert await states.load(SID) is None
        assert await client.keys(prefix + "*") == []


async def test_a_held_session_lives_with_its_holder_and_leaves_after_a_dead_one() -> None:
    """A replica killed while it holds a session never writes the window: its keys expire
    `resume_window + session_expiry_grace` after its last renewal. A living holder's idle
    session is renewed, and a resume elsewhere before the expiry keeps the session."""
    prefix = run_prefix()
    short = {"prefix": prefix, "resume_window": 0.2, "expiry_grace": 0.3}
    async with redis_client(prefix) as client:
        living = RedisSessionStates(client, LIMITS, **short)  # type: ignore[arg-type]
        # The dead replica's own connection: closing it stops its renewals, as a kill.
        dead_client = Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=5)
        dead = RedisSessionStates(dead_client, LIMITS, **short)  # type: ignore[arg-type]
        try:
            await living.create("ses_idle", capabilities=b"")  # first: the oldest write
            # Resumed here in one step (`claim_and_load`) before the dead one's last
            # write: as `ses_idle`, only the living replica's renewals keep it.
            epoch = await dead.create("ses_loaded", capabilities=b"")
            await dead.record_sent("ses_loaded", epoch, 1, b"m1")
            assert (await living.claim_and_load("ses_loaded")).unacknowledged == ((1, b"m1"),)
            for sid in ("ses_dead", "ses_moved"):
                epoch = await dead.create(sid, capabilities=b"")
                await dead.record_sent(sid, epoch, 1, b"m1", TurnMark("t1"))
            await dead.close()  # no window written, no renewal
            await living.claim("ses_moved")  # the client resumed on the living replica
            await until_gone(client, session_keys(prefix, "ses_dead"))
            # Idle since before the dead session's last write: only renewals kept it.
            assert await client.pttl(f"{prefix}session:ses_idle") > 0
            moved = await living.load("ses_moved")
            assert moved is not None
            assert moved.unacknowledged == ((1, b"m1"),)
            for key in session_keys(prefix, "ses_moved"):
                assert await client.pttl(key) > 0, key
            assert await client.pttl(f"{prefix}session:ses_loaded") > 0
        finally:
            await living.close()


# -- the two backends agree on any sequence of operations ------------------------------

Op = tuple[str, int]
ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["sent", "ack", "handled", "claim", "claim_and_load"]),
        st.integers(0, 7),
    ),
    max_size=30,
)


async def _replay(states: SessionStates, ops: list[Op]) -> list[object]:
    """Each op's outcome (its value or its error's type), then the final snapshot."""
    epoch = await states.create(SID, capabilities=b"")
    next_seq = 1
    outcomes: list[object] = []
    for name, value in ops:
        try:
            if name == "sent":  # the next seq, or a wrong one when value is 0
                seq = next_seq if value else next_seq + 1
                mark = TurnMark(step=("t", value)) if value % 2 else NO_MARK
                await states.record_sent(SID, epoch, seq, b"p" * (value * 8), mark)
                next_seq += 1
                outcomes.append(None)
            elif name == "ack":
                outcomes.append(await states.record_ack(SID, epoch, value))
            elif name == "handled":
                outcomes.append(await states.record_handled(SID, epoch, value))
            elif name == "claim":
                epoch = await states.claim(SID)
                outcomes.append(epoch)
            else:
                snapshot = await states.claim_and_load(SID)
                epoch = snapshot.epoch
                outcomes.append(snapshot)
        except (BufferOverflow, ProtocolViolation) as error:
            outcomes.append(type(error))
    outcomes.append(await states.load(SID))
    return outcomes


@settings(max_examples=60, deadline=None)
@given(ops=ops_strategy)
def test_memory_and_redis_agree_on_every_sequence(ops: list[Op]) -> None:
    async def both() -> tuple[list[object], list[object]]:
        prefix = run_prefix()
        async with redis_client(prefix) as client:
            in_redis = await _replay(RedisSessionStates(client, LIMITS, prefix=prefix), ops)
        return await _replay(InProcessSessionStates(LIMITS), ops), in_redis

    in_memory, in_redis = asyncio.run(both())
    assert in_memory == in_redis


async def test_a_working_ledger_store_is_ready(states: SessionStates) -> None:
    health = await states.health(5.0)
    assert health.ready, health.reason


async def test_a_redis_ledger_that_cannot_be_reached_is_not_ready_and_says_why() -> None:
    from redis.asyncio import Redis

    from support.replicas import free_port

    client = Redis.from_url(f"redis://127.0.0.1:{free_port()}/0")
    try:
        health = await RedisSessionStates(client, LIMITS).health(5.0)
    finally:
        await client.aclose()
    assert not health.ready
    assert "ConnectionError" in health.reason, health.reason
