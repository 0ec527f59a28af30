"""Replicas bench: how long another replica takes to pick up a `/v1/session` from Redis.

The resume path a replica adds is `claim` (fence the old holder) plus `load` (the
snapshot with the resend backlog). With 1,000 unacknowledged messages buffered by
replica A, replica B (its own connection) claims and loads the session ROUNDS times;
the figure is the p50/p99 of that pair (target p99 <= 50 ms). Bounded: ROUNDS loads,
one session, keys under a fresh prefix deleted at the end.

    python bench/replicas.py [--rounds 200] [--buffered 1000] [--size 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from redis.asyncio import Redis

from portico.sessionstate.base import BufferLimits
from portico.sessionstate.redis import RedisSessionStates

REDIS_URL = "redis://127.0.0.1:6379/0"


async def measure(rounds: int, buffered: int, size: int) -> list[float]:
    prefix = f"portico-bench:{uuid.uuid4().hex[:12]}:"
    limits = BufferLimits(max_messages=buffered, max_bytes=buffered * size * 2)
    a_client, b_client = Redis.from_url(REDIS_URL), Redis.from_url(REDIS_URL)
    try:
        a = RedisSessionStates(a_client, limits, prefix=prefix)
        b = RedisSessionStates(b_client, limits, prefix=prefix)
        epoch = await a.create("ses_bench", capabilities=b"{}")
        payload = b"x" * size
        started = time.perf_counter()
        for seq in range(1, buffered + 1):
            await a.record_sent("ses_bench", epoch, seq, payload)
        per_send = (time.perf_counter() - started) / buffered
        print(f"record_sent (one script round trip per numbered message): {per_send * 1e6:.0f} us")
        samples = []
        for _ in range(rounds):
            started = time.perf_counter()
            await b.claim("ses_bench")
            snapshot = await b.load("ses_bench")
            samples.append(time.perf_counter() - started)
            assert snapshot is not None
            assert len(snapshot.unacknowledged) == buffered
        return samples
    finally:
        keys = [key async for key in a_client.scan_iter(match=prefix + "*")]
        if keys:
            await a_client.delete(*keys)
        await a_client.aclose()
        await b_client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--buffered", type=int, default=1000)
    parser.add_argument("--size", type=int, default=200)
    options = parser.parse_args()
    samples = sorted(asyncio.run(measure(options.rounds, options.buffered, options.size)))
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    print(
        f"resume on another replica, {options.buffered} buffered x {options.size} B: "
        f"p50 {statistics.median(samples) * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms "
        f"({options.rounds} rounds; target p99 <= 50 ms)"
    )


if __name__ == "__main__":
    main()
