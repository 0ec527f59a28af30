"""Bus relay bench: what a turn's output costs when its client sits on another replica.

Two `portico serve` replicas (bus=redis, store=postgres on a fresh schema), a `/ws`
client on each, attached to one session. The client on B sends; B runs the turn; the
client on A gets it over Redis. Per round (ROUNDS, bounded) it records the first
chunk's arrival after the send on B (same replica) and on A (across the bus), and the
`stream50` turn's end on both. Figures: p50/p99 of each and the difference.

    python bench/bus_relay.py [--rounds 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import asyncpg
from redis.asyncio import Redis

DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_URL = "redis://127.0.0.1:6379/0"
SCRIPT = Path(__file__).resolve().parent / "script.yaml"
START_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(
    root: Path, index: int, schema: str, prefix: str, extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """Replica `index` on `schema` and the local Redis under `prefix`; `extra`: more
    settings (environment)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PORTICO_")}
    env.update(
        PORTICO_DATABASE_URL=f"{DATABASE_URL}?search_path={schema}",
        PORTICO_REPLICA_ID=f"bench-{index}",
        PORTICO_BUS="redis",
        PORTICO_REDIS_KEY_PREFIX=prefix,
        PORTICO_LOG_LEVEL="WARNING",
        **(extra or {}),
    )
    command = [sys.executable, "-m", "portico", "serve", "--host", "127.0.0.1", "--port",
               str(port), "--data-dir", str(root / f"r{index}"), "--store", "postgres",
               "--runtime", "scripted", "--script", str(SCRIPT)]  # fmt: skip
    log = (root / f"r{index}.log").open("wb")
    return subprocess.Popen(command, env=env, stdout=log, stderr=log), port


async def wait_ready(http: aiohttp.ClientSession, port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        try:
            async with http.get(f"http://127.0.0.1:{port}/healthz") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"replica on {port} did not start")


async def frames_until_done(
    ws: aiohttp.ClientWebSocketResponse, sent: float
) -> tuple[float, float]:
    first = 0.0
    async with asyncio.timeout(10):
        while True:
            frame = json.loads((await ws.receive()).data)
            now = time.perf_counter()
            if frame["type"] == "chunk" and not first:
                first = now - sent
            if frame["type"] in ("done", "error"):
                return first, now - sent


async def measure(rounds: int, ports: list[int]) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {k: [] for k in ("first_b", "first_a", "end_b", "end_a")}
    async with aiohttp.ClientSession() as http:
        for port in ports:
            await wait_ready(http, port)
        watcher = await http.ws_connect(f"ws://127.0.0.1:{ports[0]}/ws")
        session_id = json.loads((await watcher.receive()).data)["session_id"]
        await watcher.send_str(json.dumps({"type": "message", "content": "hi"}))
        await frames_until_done(watcher, time.perf_counter())
        runner = await http.ws_connect(f"ws://127.0.0.1:{ports[1]}/ws")
        await runner.receive()  # connected
        meta = {"metadata": {"mock_scenario": "stream50"}}
        for _ in range(rounds):
            frame = {"type": "message", "session_id": session_id, "content": "x", **meta}
            sent = time.perf_counter()
            await runner.send_str(json.dumps(frame))
            (first_b, end_b), (first_a, end_a) = await asyncio.gather(
                frames_until_done(runner, sent), frames_until_done(watcher, sent)
            )
            for key, value in zip(samples, (first_b, first_a, end_b, end_a), strict=True):
                samples[key].append(value * 1000)
            await asyncio.sleep(0.05)  # the session's lock is released after the end
        await runner.close()
        await watcher.close()
    return samples


async def delete_prefixed(redis: Redis, prefix: str) -> None:
    """The bench's keys, from the shared Redis (never flushed)."""
    keys = [key async for key in redis.scan_iter(match=prefix + "*")]
    if keys:
        await redis.delete(*keys)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(rounds: int) -> None:
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(DATABASE_URL)
    await conn.execute(f"CREATE SCHEMA {schema}")
    prefix = f"portico-bench:{uuid.uuid4().hex[:12]}:"
    processes = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            started = [start(Path(tmp), index, schema, prefix) for index in range(2)]
            processes = [process for process, _ in started]
            samples = await measure(rounds, [port for _, port in started])
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=20)
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await conn.close()
        redis = Redis.from_url(REDIS_URL)
        await delete_prefixed(redis, prefix)  # the replicas' streams and turn fences
        await redis.aclose()
    for label, key in (
        ("first chunk, client on the turn's replica", "first_b"),
        ("first chunk, client on the other replica", "first_a"),
        ("turn end (51 frames), turn's replica", "end_b"),
        ("turn end (51 frames), other replica", "end_a"),
    ):
        values = samples[key]
        print(
            f"{label}: p50 {statistics.median(values):.2f} ms  p99 {quantile(values, 0.99):.2f} ms"
        )
    extra = [a - b for a, b in zip(samples["first_a"], samples["first_b"], strict=True)]
    print(f"added by the bus to the first chunk: p50 {statistics.median(extra):.2f} ms "
          f"p99 {quantile(extra, 0.99):.2f} ms ({rounds} rounds)")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    asyncio.run(main(parser.parse_args().rounds))
