"""Replicas bench (issue 16): three replicas behind HAProxy against one, on this machine.

Five parts, each bounded in time and count, printed in one run:

1. **stream**: the `stream` workload of bench/loadgen.py (`/ws`, N clients, a
   `stream50` turn after another) for `--seconds`, first against one replica directly,
   then against three replicas behind HAProxy (round robin, no stickiness; the same
   load generator, clients and window). All replicas run `bus=redis`, `session_state=
   redis`, `store=postgres` (a fresh schema), so both runs pay the same backends.
2. **first chunk**: bench/bus_relay.py's rounds on two of the replicas: a `/ws` client on
   each, one session, B runs the turn; the first chunk's p50/p99 on B (same replica)
   and on A (other replica), and their difference (target <= +1 ms at p99).
3. **session_resume**: a real `/v1/session` resume on another replica: bench/loadgen.py's
   `session_resume` workload with `--resume-url`. Per round a client on replica A sends a
   message whose reply is `--buffered` numbered messages (`long1000`), drops without
   reading or acknowledging, waits for the turn's end (A's turn counter), then reconnects
   to replica B with `hello` (session id, `last_seq` 0): reconnect -> `ready` and
   reconnect -> the last backlog message, p50/p99 over `--resume-rounds` rounds (one
   unmeasured first), no round starting after `--resume-seconds`.
4. **resume**: another replica's `claim_and_load` (one script; `claim` + `load` on code
   before it) of a `/v1/session` with `--buffered` unacknowledged 200-byte messages in
   Redis, `--rounds` times (target p99 <= 50 ms). The port only: no socket, no resend
   (those are part 3).
5. **bus_floor**: the first chunk's floor across replicas: an entry published in one
   process and read in another, `--rounds` times, one at a time, with a bare redis-py
   `XADD` -> blocking `XREAD`, and with the Redis bus itself (`publish_batch` to a
   session and an owner topic, as a turn's event, -> `subscribe`).

    python bench/replicas.py [--clients 50] [--seconds 3] [--rounds 200] [--buffered 1000]
                             [--resume-rounds 50] [--resume-seconds 180]
                             [--part stream --part first_chunk --part session_resume
                              --part resume --part bus_floor]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import asyncpg
from bus_relay import (
    DATABASE_URL,
    REDIS_URL,
    delete_prefixed,
    free_port,
    quantile,
    start,
    wait_ready,
)
from bus_relay import measure as first_chunk_rounds
from harness import PORTICO_BENCH_ENV, PORTICO_RESUME_ENV, Loadgen, stop_process
from loadgen import Recorded
from loadgen import parse_args as parse_loadgen_args
from loadgen import resume_samples as socket_resume_samples
from redis.asyncio import Redis

from portico.bus.redis_bus import RedisBus
from portico.sessionstate.base import BufferLimits
from portico.sessionstate.redis import RedisSessionStates

REPLICAS = 3
PARTS = ("stream", "first_chunk", "session_resume", "resume", "bus_floor")
HAPROXY_CONFIG = """\
global
    maxconn 4096
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
    timeout tunnel 1h
    option http-server-close
frontend portico
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /readyz
    default-server inter 300ms fall 1 rise 1
{servers}
"""


# -- 4. resume: claim + load on another replica ----------------------------------------


async def resume_samples(rounds: int, buffered: int, size: int) -> tuple[float, list[float]]:
    """Per numbered message recording cost (s), and the claim+load samples (s)."""
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
        samples = []
        # One step since branch `repfin` (one script round trip); older code (an A/B run
        # through PYTHONPATH) has the two calls.
        one_step = getattr(b, "claim_and_load", None)
        for _ in range(rounds):
            started = time.perf_counter()
            if one_step is not None:
                snapshot = await one_step("ses_bench")
            else:
                await b.claim("ses_bench")
                snapshot = await b.load("ses_bench")
            samples.append(time.perf_counter() - started)
            assert snapshot is not None
            assert len(snapshot.unacknowledged) == buffered
        return per_send, samples
    finally:
        await delete_prefixed(a_client, prefix)
        await a_client.aclose()
        await b_client.aclose()


def print_resume(per_send: float, samples: list[float], buffered: int, size: int) -> None:
    ms = [s * 1000 for s in samples]
    print(f"record_sent (one script round trip per numbered message): {per_send * 1e6:.0f} us")
    print(
        f"resume on another replica (claim and load), {buffered} buffered x {size} B: "
        f"p50 {statistics.median(ms):.2f} ms, p99 {quantile(ms, 0.99):.2f} ms "
        f"({len(ms)} rounds; target p99 <= 50 ms)"
    )


# -- 3. session_resume: a real resume on another replica ------------------------------


RECORD_POLL = 0.01  # seconds between reads of the dropped session's state in Redis


def backlog_recorded(prefix: str, backlog: int) -> Recorded:
    """On `session_state=redis` a detached session's numbered messages are recorded one
    script round trip each, after the engine ended the turn (the records queue): the
    resume waits until the last one is in Redis, so it finds all `backlog` of them."""

    async def recorded(session_id: str, within: float) -> bool:
        redis = Redis.from_url(REDIS_URL)
        deadline = time.perf_counter() + within
        try:
            while time.perf_counter() < deadline:
                next_seq = await redis.hget(f"{prefix}session:{session_id}", "next_seq")
                if next_seq is not None and int(next_seq) > backlog:
                    return True
                await asyncio.sleep(RECORD_POLL)
            return False
        finally:
            await redis.aclose()

    return recorded


async def session_resume_rounds(
    ports: list[int], prefix: str, options: argparse.Namespace
) -> dict[str, Any]:
    """loadgen's session_resume samples: the turn on ports[0], the resume on ports[1]."""
    turn, resume = (f"ws://127.0.0.1:{port}/v1/session" for port in ports)
    _, sampling = parse_loadgen_args(
        ["session_resume", "--url", turn, "--scenario", f"long{options.buffered}",
         "--backlog", str(options.buffered), "--samples", str(options.resume_rounds),
         "--warm", "1"]
    )  # fmt: skip
    recorded = backlog_recorded(prefix, options.buffered)
    return await socket_resume_samples(sampling, resume, recorded, options.resume_seconds)


def print_session_resume(result: dict[str, Any]) -> None:
    print(
        f"/v1/session resume on another replica, {result['backlog']} buffered: reconnect -> "
        f"ready p50 {result['ready_p50_ms']:.2f} ms, p99 {result['ready_p99_ms']:.2f} ms; "
        f"reconnect -> last message p50 {result['done_p50_ms']:.2f} ms, p99 "
        f"{result['done_p99_ms']:.2f} ms ({result['samples']} rounds, errors "
        f"{result['errors']}; target p99 <= 50 ms)"
    )


# -- 5. bus_floor: one entry from a process to another, through Redis --------------------

FLOOR_GAP = 0.01  # seconds between two publishes: one entry in flight at a time
FLOOR_TIMEOUT = 60.0  # seconds the reading process may take in all


def stamp() -> bytes:
    """The send time (perf_counter: CLOCK_MONOTONIC, one clock for every process here),
    padded to a chunk event's size."""
    return f"{time.perf_counter():.9f}".encode().ljust(200)


async def read_floor(key: str, count: int, bare: bool, ready: Any) -> list[float]:
    """Wake-up delays (ms) of `count` entries, from the stream's start."""
    samples: list[float] = []
    if bare:
        redis = Redis.from_url(REDIS_URL)
        last: str | bytes = "0-0"
        ready.set()
        while len(samples) < count:
            # RESP2's shape (redis-py's type is the union of RESP2's and RESP3's).
            reply = cast(
                list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]],
                await redis.xread({key: last}, block=1000) or [],
            )
            for _, entries in reply:
                now = time.perf_counter()
                for entry_id, fields in entries:
                    last = entry_id
                    samples.append((now - float(fields[b"p"])) * 1000)
        await redis.aclose()
        return samples
    bus = RedisBus(REDIS_URL, prefix=key)
    ready.set()
    async for entry in bus.subscribe("session", after="0-0"):
        samples.append((time.perf_counter() - float(entry.payload)) * 1000)
        if len(samples) == count:
            break
    await bus.close()
    return samples


def floor_reader(key: str, count: int, bare: bool, ready: Any, out: Any) -> None:
    import uvloop  # the servers' loop

    out.put(uvloop.run(read_floor(key, count, bare, ready)))


async def write_floor(key: str, count: int, bare: bool) -> None:
    redis, bus = Redis.from_url(REDIS_URL), RedisBus(REDIS_URL, prefix=key)
    try:
        for _ in range(count):
            await asyncio.sleep(FLOOR_GAP)
            if bare:
                await redis.xadd(key, {b"p": stamp()}, maxlen=10_000, approximate=True)
            else:
                payload = stamp()
                await bus.publish_batch([("session", payload), ("owner", payload)])
    finally:
        await delete_prefixed(redis, key)
        await redis.aclose()
        await bus.close()


async def floor_samples(count: int, bare: bool) -> list[float]:
    spawn = multiprocessing.get_context("spawn")
    ready, out = spawn.Event(), spawn.Queue()
    key = f"portico-bench:{uuid.uuid4().hex[:12]}:"
    reader = spawn.Process(target=floor_reader, args=(key, count, bare, ready, out))
    reader.start()
    try:
        if not await asyncio.to_thread(ready.wait, FLOOR_TIMEOUT):
            raise RuntimeError("the floor's reader did not start")
        await write_floor(key, count, bare)
        samples: list[float] = await asyncio.to_thread(out.get, True, FLOOR_TIMEOUT)
        return samples
    finally:
        reader.join(FLOOR_TIMEOUT)
        if reader.is_alive():
            reader.kill()


async def print_floor(rounds: int) -> None:
    for label, bare in (("bare redis-py XADD -> XREAD", True), ("RedisBus", False)):
        ms = await floor_samples(rounds, bare)
        print(
            f"bus floor, {label}, another process woken: p50 {statistics.median(ms):.3f} ms, "
            f"p99 {quantile(ms, 0.99):.3f} ms ({rounds} entries)"
        )


# -- 1. and 2.: replicas on PostgreSQL and Redis ----------------------------------------


def start_haproxy(root: Path, ports: list[int]) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
    port = free_port()
    servers = "\n".join(f"    server r{i} 127.0.0.1:{p} check" for i, p in enumerate(ports))
    config = root / "haproxy.cfg"
    config.write_text(HAPROXY_CONFIG.format(port=port, servers=servers))
    log = (root / "haproxy.log").open("wb")
    return subprocess.Popen([binary, "-db", "-f", str(config)], stdout=log, stderr=log), port


async def await_rotation(port: int, count: int) -> None:
    """Until the balancer answers from `count` replicas in a row (bounded)."""
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            answered = 0
            for _ in range(count):
                try:
                    async with http.get(f"http://127.0.0.1:{port}/readyz") as response:
                        answered += response.status == 200
                except aiohttp.ClientError:
                    pass
            if answered == count:
                return
            await asyncio.sleep(0.2)
    raise RuntimeError("the replicas did not come into rotation")


def stream_run(url: str, clients: int, seconds: float, max_turns: int) -> dict[str, Any]:
    args = ["--clients", str(clients), "--seconds", str(seconds), "--warmup", "0.5",
            "--max-turns", str(max_turns), "--client", "aiohttp"]  # fmt: skip
    loadgen = Loadgen("stream", url, args)
    try:
        return loadgen.result(timeout=seconds + 60)
    finally:
        loadgen.stop()


@contextlib.contextmanager
def logs_kept_on_failure() -> Iterator[Path]:
    """A folder for the replicas' logs and HAProxy's: removed after a clean run, kept
    (and named on stderr) when a part fails, so what the replicas said can be read."""
    root = Path(tempfile.mkdtemp(prefix="portico-replicas-"))
    try:
        yield root
    except BaseException:
        print(f"the replicas' logs are kept in {root}", file=sys.stderr)
        raise
    shutil.rmtree(root, ignore_errors=True)


async def with_replicas(options: argparse.Namespace, parts: set[str]) -> None:
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(DATABASE_URL)
    await conn.execute(f"CREATE SCHEMA {schema}")
    prefix = f"portico-bench:{uuid.uuid4().hex[:12]}:"
    extra = {**PORTICO_BENCH_ENV, **PORTICO_RESUME_ENV, "PORTICO_SESSION_STATE": "redis"}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        with logs_kept_on_failure() as root:
            started = [start(root, index, schema, prefix, extra) for index in range(REPLICAS)]
            processes = [process for process, _ in started]
            ports = [port for _, port in started]
            async with aiohttp.ClientSession() as http:
                for port in ports:
                    await wait_ready(http, port)
            if "stream" in parts:
                haproxy, front = start_haproxy(root, ports)
                processes.append(haproxy)
                await await_rotation(front, REPLICAS)
                one = await asyncio.to_thread(
                    stream_run, f"ws://127.0.0.1:{ports[0]}/ws", options.clients,
                    options.seconds, options.max_turns,
                )  # fmt: skip
                three = await asyncio.to_thread(
                    stream_run, f"ws://127.0.0.1:{front}/ws", options.clients,
                    options.seconds, options.max_turns,
                )  # fmt: skip
                for label, result in (("1 replica, direct", one), ("3 replicas, HAProxy", three)):
                    print(
                        f"stream, {options.clients} clients, {label}: "
                        f"{result['frames_per_s']:,.0f} frames/s, {result['turns_per_s']:,.0f} "
                        f"turns/s, errors {result['errors']}, connect errors "
                        f"{result['connect_errors']}"
                    )
                print(f"3 replicas / 1: {three['frames_per_s'] / one['frames_per_s']:.2f}")
            if "first_chunk" in parts:
                samples = await first_chunk_rounds(options.rounds, ports[:2])
                for label, key in (("same replica", "first_b"), ("other replica", "first_a")):
                    values = samples[key]
                    print(
                        f"first chunk, client on the {label}: p50 {statistics.median(values):.2f}"
                        f" ms, p99 {quantile(values, 0.99):.2f} ms"
                    )
                extra_ms = [
                    a - b for a, b in zip(samples["first_a"], samples["first_b"], strict=True)
                ]
                print(
                    f"added by another replica: p50 {statistics.median(extra_ms):.2f} ms, "
                    f"p99 {quantile(extra_ms, 0.99):.2f} ms ({options.rounds} rounds; "
                    "target p99 <= +1 ms)"
                )
            if "session_resume" in parts:
                result = await session_resume_rounds(ports[:2], prefix, options)
                print_session_resume(result)
    finally:
        for process in processes:
            stop_process(process)  # type: ignore[arg-type]
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await conn.close()
        redis = Redis.from_url(REDIS_URL)
        await delete_prefixed(redis, prefix)
        await redis.aclose()


async def main(options: argparse.Namespace) -> None:
    parts = set(options.part or PARTS)
    if parts & {"stream", "first_chunk", "session_resume"}:
        await with_replicas(options, parts)
    if "resume" in parts:
        per_send, samples = await resume_samples(options.rounds, options.buffered, options.size)
        print_resume(per_send, samples, options.buffered, options.size)
    if "bus_floor" in parts:
        await print_floor(options.rounds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--max-turns", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--buffered", type=int, default=1000)
    parser.add_argument("--size", type=int, default=200)
    parser.add_argument("--resume-rounds", type=int, default=50)
    parser.add_argument("--resume-seconds", type=float, default=180.0)
    parser.add_argument("--part", action="append", choices=PARTS)
    asyncio.run(main(parser.parse_args()))
