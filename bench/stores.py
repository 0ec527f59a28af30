"""The `stream` workload on Portico with each archive backend, in one run; prints markdown.

    python bench/stores.py                     # sqlite and postgres, 3 repeats
    python bench/stores.py --quick             # 1 repeat, short windows
    python bench/stores.py --stores sqlite,postgres,memory --clients 50
    python bench/stores.py --variant base=/tmp/base   # + postgres@base, from that checkout

One Portico per backend (`--store`), started together and interleaved in every repeat so
background noise hits them alike; each gets bench/run.py's `stream` workload (/ws, 1
client process). The `postgres` one archives into a fresh schema of `--database-url`
(default: the local test server), dropped at the end.

Target (issue 17; a figure, not a test): `store: postgres` at least 0.5x SQLite's turns/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from common import raise_fd_limit
from harness import Server, stop_all
from run import QUICK, Plan, background_cpu, log, measure_latency, measure_stream

DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
TARGET = 0.5  # postgres / sqlite turns per second
Samples = dict[str, list[dict[str, float]]]


async def execute(url: str, sql: str) -> None:
    import asyncpg  # only with a postgres store (the `postgres` extra)

    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def with_search_path(url: str, schema: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}search_path={schema}"


def run(
    plan: Plan,
    stores: Sequence[str],
    url: str,
    workdir: Path,
    variants: dict[str, Path] | None = None,
) -> Samples:
    """`variants`: also run `postgres@NAME`, the postgres store of the Portico checkout
    at each path (an A/B of a change in one run; each gets a schema of its own)."""
    variants = variants or {}
    schemas: dict[str, str] = {}
    servers: dict[str, Server] = {}
    names = [*stores, *(f"postgres@{name}" for name in variants)]
    for name in names:
        store, _, variant = name.partition("@")
        env = {}
        if store == "postgres":
            schemas[name] = f"bench_{uuid.uuid4().hex[:12]}"
            env["PORTICO_DATABASE_URL"] = with_search_path(url, schemas[name])
        if variant:
            env["PYTHONPATH"] = str(variants[variant] / "src")
        servers[name] = Server(
            "portico", workdir / name.replace("@", "-"), plan.log_level, store=store, env=env
        )
    samples: Samples = {name: [] for name in names}
    for schema in schemas.values():
        asyncio.run(execute(url, f"CREATE SCHEMA {schema}"))
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.await_ready()
        for rep in range(plan.repeat):
            for store, server in servers.items():
                sample = measure_stream(server, plan, 1)
                # The turn's end waits for its archive write: send -> done at the rate.
                latency = measure_latency(server, plan, plan.rates[0])
                sample.update({f"latency_{k}": v for k, v in latency.items()})
                samples[store].append(sample)
                log(
                    f"stream rep {rep + 1} {store:13}: {sample['turns_per_s']:7.0f} turns/s, "
                    f"server CPU {sample['server_cpu']:.0f}%, other {sample['other_cpu']:.0f}%; "
                    f"done p50 {latency['done_p50_ms']:.2f} ms p99 {latency['done_p99_ms']:.2f} ms"
                )
    finally:
        stop_all(list(servers.values()))
        for schema in schemas.values():
            asyncio.run(execute(url, f"DROP SCHEMA {schema} CASCADE"))
    return samples


def _median(values: Sequence[float], digits: int = 0) -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:,.{digits}f} ({low:,.{digits}f}–{high:,.{digits}f})"


def report(plan: Plan, samples: Samples, started: float, background: float) -> str:
    base = statistics.median(s["turns_per_s"] for s in samples[next(iter(samples))])
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(started))}, "
        f"`python bench/stores.py`: stream, {plan.clients} clients, 1 client process, "
        f"{plan.warmup:g} s warm-up, {plan.seconds:g} s window, median (min–max) of "
        f"{plan.repeat}; then latency at {plan.rates[0]:g} msg/s over {plan.pool} connections "
        f"({plan.latency_seconds:g} s), as bench/run.py's; other processes (the PostgreSQL "
        f"server among them) used {background:.0f}% of a core before the run.",
        "",
        f"| store | turns/s | frames/s | server CPU, % | other CPU, % | ÷ {next(iter(samples))} "
        "| send → done p50, ms | send → done p99, ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for store, rows in samples.items():
        turns = [s["turns_per_s"] for s in rows]
        lines.append(
            f"| {store} | {_median(turns)} | {_median([s['frames_per_s'] for s in rows])} | "
            f"{_median([s['server_cpu'] for s in rows])} | "
            f"{_median([s['other_cpu'] for s in rows])} | {statistics.median(turns) / base:.2f} | "
            f"{_median([s['latency_done_p50_ms'] for s in rows], 2)} | "
            f"{_median([s['latency_done_p99_ms'] for s in rows], 2)} |"
        )
    errors = sum(s["errors"] + s["latency_errors"] for rows in samples.values() for s in rows)
    lines += ["", f"Errors: {errors:.0f}. Target: postgres ≥ {TARGET}× sqlite."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, short windows")
    parser.add_argument("--stores", default="sqlite,postgres", help="comma-separated backends")
    parser.add_argument("--repeat", type=int, help="measurements per figure (default 3)")
    parser.add_argument("--clients", type=int, help="concurrent clients (default 100)")
    parser.add_argument("--seconds", type=float, help="window, seconds")
    parser.add_argument("--database-url", default=DATABASE_URL)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also run postgres@NAME from the Portico checkout at DIR (A/B); repeatable",
    )
    args = parser.parse_args(argv)
    plan = replace(QUICK, repeat=1) if args.quick else Plan()
    for field in ("repeat", "clients", "seconds"):
        if getattr(args, field) is not None:
            plan = replace(plan, **{field: getattr(args, field)})
    raise_fd_limit()
    started = time.time()
    background = background_cpu()
    with tempfile.TemporaryDirectory(prefix="portico-stores-") as workdir:
        variants = {name: Path(path) for name, _, path in (v.partition("=") for v in args.variant)}
        samples = run(plan, args.stores.split(","), args.database_url, Path(workdir), variants)
    print(report(plan, samples, started, background))
    return 0


if __name__ == "__main__":
    sys.exit(main())
