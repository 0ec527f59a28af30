"""What an idle `/ws` connection holds in the Portico process: tracemalloc and object counts.

    python bench/profile_idle.py [--count 2000] [--top 25] [--frames 1]

Runs Portico in this process (as bench/run.py configures it: scripted runtime, SQLite,
the bench's limits lifted) with tracemalloc on, opens `--count` idle connections from a
bench/loadgen.py `idle` process, and prints, per connection: the Python memory held
(tracemalloc snapshot difference, by allocating line), the objects held (by type, from
the garbage collector) and the RSS growth (tracemalloc's own bookkeeping included, so
higher than bench/run.py's figure: compare runs of this script with each other).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import uvloop
from common import raise_fd_limit
from harness import PORTICO_BENCH_ENV, SCRIPT, Loadgen, rss_kib

RESULT_SLACK = 90.0  # seconds a load generator may take to open its connections
SETTLE = 0.5  # seconds for the server to finish the handshakes it saw


Snapshot = tuple[tracemalloc.Snapshot, Counter[str], int]


def type_counts() -> Counter[str]:
    gc.collect()
    counts: Counter[str] = Counter()
    for obj in gc.get_objects():
        name = type(obj).__qualname__
        if name == "coroutine":
            name = f"coroutine {obj.__qualname__}"
        elif isinstance(obj, asyncio.Task):
            name = f"Task {obj.get_coro().__qualname__}"  # type: ignore[union-attr]
        counts[name] += 1
    return counts


def snapshot(frames: int) -> Snapshot:
    gc.collect()
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    return snap, type_counts(), rss_kib(os.getpid())


Ready = Future[tuple[str, asyncio.AbstractEventLoop, asyncio.Event]]


def run_baseline(ready: Ready) -> None:
    """The bare aiohttp server of bench/baseline.py, for a side-by-side profile."""
    import baseline

    async def main() -> None:
        loop, stop = asyncio.get_running_loop(), asyncio.Event()
        url = "ws://127.0.0.1:{}/ws"
        baseline.announce = lambda port: ready.set_result((url.format(port), loop, stop))
        await baseline.serve_aiohttp(0, stop)

    uvloop.run(main())


def run_server(ready: Ready) -> None:
    from portico.config import load_settings
    from portico.server.app import serve

    os.environ.update(PORTICO_BENCH_ENV)
    data = tempfile.mkdtemp(prefix="portico-idle-")
    flags = {
        "host": "127.0.0.1",
        "port": 0,
        "runtime": "scripted",
        "script": str(SCRIPT),
        "store": "sqlite",
        "data_dir": data,
        "log_level": "WARNING",
    }
    settings = load_settings(flags=flags)

    async def main() -> None:
        loop, stop = asyncio.get_running_loop(), asyncio.Event()

        def on_ready(line: str) -> None:
            url = line.split("ws://", 1)[1].rstrip(")")
            ready.set_result(("ws://" + url, loop, stop))

        task = asyncio.create_task(serve(settings, on_ready=on_ready))
        await stop.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    uvloop.run(main())


def in_loop(loop: asyncio.AbstractEventLoop, frames: int) -> Snapshot:
    """Take the snapshot on the server's loop, so no handler runs meanwhile."""

    async def take() -> Snapshot:
        return snapshot(frames)

    return asyncio.run_coroutine_threadsafe(take(), loop).result(60)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--frames", type=int, default=1, help="traceback depth grouped by")
    parser.add_argument("--server", choices=("portico", "aiohttp"), default="portico")
    args = parser.parse_args(argv)
    raise_fd_limit()
    tracemalloc.start(args.frames)
    ready: Ready = Future()
    target = run_server if args.server == "portico" else run_baseline
    server = threading.Thread(target=target, args=(ready,), daemon=True)
    server.start()
    url, loop, stop = ready.result(300)
    gen = Loadgen("idle", url, ["--count", str(args.count), "--warm", "50"])
    try:
        gen.next_event(RESULT_SLACK)  # warmed
        time.sleep(SETTLE)
        before, types_before, rss_before = in_loop(loop, args.frames)
        gen.tell()
        opened = int(gen.next_event(RESULT_SLACK)["opened"])
        time.sleep(SETTLE)
        after, types_after, rss_after = in_loop(loop, args.frames)
        gen.tell()
        gen.result(RESULT_SLACK)
    finally:
        gen.stop()
        loop.call_soon_threadsafe(stop.set)
        server.join(10)
    n = max(1, opened)
    stats = after.compare_to(before, "traceback" if args.frames > 1 else "lineno")
    total = sum(s.size_diff for s in stats)
    print(
        f"{opened} idle connections; RSS +{(rss_after - rss_before) / n:.2f} KiB each "
        f"(tracemalloc included); Python allocations +{total / n:.0f} B each"
    )
    print(f"\n## Python memory per connection, top {args.top} allocating sites\n")
    print("| bytes/conn | blocks/conn | site |")
    print("|---:|---:|---|")
    for stat in stats[: args.top]:
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in stat.traceback)
        print(f"| {stat.size_diff / n:.0f} | {stat.count_diff / n:.2f} | {where} |")
    print(f"\n## Objects per connection (garbage-collected types), top {args.top}\n")
    print("| objects/conn | type |")
    print("|---:|---|")
    diff = Counter({k: types_after[k] - types_before.get(k, 0) for k in types_after})
    for name, count in diff.most_common(args.top):
        if count / n < 0.01:
            break
        print(f"| {count / n:.2f} | {name} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
