"""The call directory's contract: the in-process and Redis backends pass one suite.

What it pins is the one gate of a `/ws` `?resume` across replicas (docs/replicas.md,
"Voice calls"): the owner claims a live call, or a parked one inside its window, once;
another principal's claim leaves it; a park or a drop of an older holding changes
nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from portico.calls.directory import CallDirectory, CallRecord, InProcessCallDirectory
from portico.calls.redis_directory import RedisCallDirectory
from portico.runtime.duplex.base import AudioFormat
from support.redis import redis_client, run_prefix

SID = "ses_call_contract"
NOW = 1_900_000_000.0
LIVE_TTL = 30.0


def record(token: str = "call_1", *, replica: str = "rep-a", owner: str = "alice") -> CallRecord:
    return CallRecord(
        session_id=SID,
        owner=owner,
        agent="voice",
        replica=replica,
        token=token,
        format=AudioFormat(codec="pcm16", sample_rate=24000, channels=2),
    )


@pytest.fixture(params=["memory", "redis"])
async def directory(request: pytest.FixtureRequest) -> AsyncIterator[CallDirectory]:
    if request.param == "memory":
        yield InProcessCallDirectory()
        return
    prefix = run_prefix()
    async with redis_client(prefix) as client:
        found = RedisCallDirectory(client, prefix=prefix, live_ttl=LIVE_TTL)
        yield found
        found._live.clear()  # the client is closed by redis_client


async def test_the_owner_claims_a_live_call_once(directory: CallDirectory) -> None:
    await directory.register(record())
    assert await directory.claim(SID, "alice", NOW) == record()
    assert await directory.claim(SID, "alice", NOW) is None


async def test_another_principals_claim_leaves_the_call_for_its_owner(
    directory: CallDirectory,
) -> None:
    await directory.register(record())
    await directory.park(SID, "call_1", NOW + 15)
    assert await directory.claim(SID, "bob", NOW) is None
    claimed = await directory.claim(SID, "alice", NOW)
    assert claimed is not None
    assert (claimed.replica, claimed.until, claimed.format.sample_rate) == (
        "rep-a",
        NOW + 15,
        24000,
    )


async def test_a_parked_call_is_claimable_until_its_window_ends(directory: CallDirectory) -> None:
    await directory.register(record())
    await directory.park(SID, "call_1", NOW + 15)
    assert await directory.claim(SID, "alice", NOW + 15) is None  # the window's end is out
    assert await directory.claim(SID, "alice", NOW + 14.5) is not None


async def test_an_unknown_session_has_nothing_to_claim(directory: CallDirectory) -> None:
    assert await directory.claim("ses_nobody", "alice", NOW) is None


async def test_an_older_holdings_park_and_drop_change_nothing(directory: CallDirectory) -> None:
    await directory.register(record("call_1"))
    await directory.register(record("call_2", replica="rep-b"))  # taken over on B
    await directory.park(SID, "call_1", NOW - 1)  # A's late park: would end the window
    await directory.drop(SID, "call_1")  # A's late drop
    claimed = await directory.claim(SID, "alice", NOW)
    assert claimed is not None
    assert (claimed.token, claimed.until) == ("call_2", None)


async def test_a_drop_of_the_current_holding_removes_the_call(directory: CallDirectory) -> None:
    await directory.register(record())
    await directory.drop(SID, "call_1")
    assert await directory.claim(SID, "alice", NOW) is None


async def test_racing_claims_get_the_call_once(directory: CallDirectory) -> None:
    await directory.register(record())
    got = await asyncio.gather(*(directory.claim(SID, "alice", NOW) for _ in range(8)))
    assert sum(g is not None for g in got) == 1


# -- Redis only ---------------------------------------------------------------------------


@pytest.fixture
async def redis_pair() -> AsyncIterator[tuple[RedisCallDirectory, RedisCallDirectory, str]]:
    """Two replicas' views of one Redis, each with its own connection."""
    prefix = run_prefix()
    async with redis_client(prefix) as a, redis_client(prefix) as b:
        pair = (
            RedisCallDirectory(a, prefix=prefix, live_ttl=LIVE_TTL),
            RedisCallDirectory(b, prefix=prefix, live_ttl=LIVE_TTL),
        )
        yield (*pair, prefix)
        for one in pair:
            if one._renewal is not None:
                one._renewal.cancel()


async def test_a_call_registered_on_one_replica_is_claimed_on_another(
    redis_pair: tuple[RedisCallDirectory, RedisCallDirectory, str],
) -> None:
    a, b, _ = redis_pair
    await a.register(record())
    await a.park(SID, "call_1", NOW + 15)
    assert await b.claim(SID, "bob", NOW) is None
    claimed = await b.claim(SID, "alice", NOW)
    assert claimed is not None
    assert claimed.replica == "rep-a"
    assert await a.claim(SID, "alice", NOW) is None


async def test_redis_forgets_a_dead_replicas_records_by_itself(
    redis_pair: tuple[RedisCallDirectory, RedisCallDirectory, str],
) -> None:
    a, _, prefix = redis_pair
    client = a._redis
    await a.register(record())
    live_ttl = await client.pttl(f"{prefix}call:{SID}")
    assert 0 < live_ttl <= LIVE_TTL * 1000  # a live record lapses unless renewed
    await client.pexpire(f"{prefix}call:{SID}", 1000)
    await a._renew_all()  # its replica renews it while the call lives
    assert await client.pttl(f"{prefix}call:{SID}") > 1000
    until = time.time() + 15
    await a.park(SID, "call_1", until)
    parked_ttl = await client.pttl(f"{prefix}call:{SID}")
    assert 0 < parked_ttl <= 15_001  # a parked one at its window's end (ms, rounded up)
    await a._renew_all()  # a parked record is not renewed
    assert await client.pttl(f"{prefix}call:{SID}") <= parked_ttl
