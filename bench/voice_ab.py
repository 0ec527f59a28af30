"""Voice A/B: two variants of Portico, or of the load generator, interleaved on one machine.

    python bench/voice_ab.py --old-src /tmp/old/src [--callers 100,250] [--repeat 5]
                             [--steps 250,375,500,625,750]
    python bench/voice_ab.py --old-bench /tmp/old/bench --server picows   # the client A/B

`--old-src`: an older Portico's `src` (its server runs with it first on PYTHONPATH), the
new one this tree's. `--old-bench`: an older bench/ whose loadgen.py the old variant's
callers run, against one server (`--server`) both variants share. Each repeat measures
both variants at each of `--callers` (bench/run.py's voice measurement, the variants'
order alternating by repeat); then both are stepped up through `--steps`, alternately,
each until its first step that does not hold (run.py's rule). Prints each measurement as
it goes, then per variant and caller count the median (min-max) of server CPU per relayed
frame, echo p50 and p99, client CPU per call and the load average; the largest step each
held. Machines shared with other work: read the spreads and the load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import harness
from common import raise_fd_limit
from harness import Server, stop_all, voice_config
from run import Plan, Sample, log_voice, measure_voice, voice_holds

FIGURES = (
    ("cpu_us_per_frame", "server CPU per relayed frame, µs"),
    ("server_cpu", "server CPU, % of a core"),
    ("echo_p50_ms", "echo p50, ms"),
    ("echo_p99_ms", "echo p99, ms"),
    ("client_cpu_per_call", "client CPU per call, % of a core"),
    ("lag_p99_ms", "client send lag p99, ms"),
    ("load_1m", "load average (1 min)"),
)


@contextmanager
def loadgen_from(bench: Path | None) -> Iterator[None]:
    """Load generators started inside run `bench`/loadgen.py (None: this tree's)."""
    if bench is None:
        yield
        return
    saved = harness.LOADGEN
    harness.LOADGEN = bench / "loadgen.py"
    try:
        yield
    finally:
        harness.LOADGEN = saved


def cell(values: Sequence[float]) -> str:
    if not values:
        return "—"
    median = statistics.median(values)
    return f"{median:.2f} ({min(values):.2f}–{max(values):.2f})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    variant = parser.add_mutually_exclusive_group(required=True)
    variant.add_argument("--old-src", type=Path, help="the old Portico's src directory")
    variant.add_argument("--old-bench", type=Path, help="the old bench/ (its loadgen.py)")
    parser.add_argument("--server", default="portico", help="--old-bench: the shared server")
    parser.add_argument("--callers", default="100,250")
    parser.add_argument("--steps", default="", help="callers stepped up, comma-separated")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="each window")
    args = parser.parse_args(argv)
    plan = replace(Plan(), voice_seconds=args.seconds)
    callers = [int(n) for n in args.callers.split(",") if n]
    steps = [int(n) for n in args.steps.split(",") if n]
    raise_fd_limit()
    results: dict[tuple[str, int], list[Sample]] = defaultdict(list)
    held: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="portico-voice-ab-") as tmp:
        workdir = Path(tmp)

        def server(old: bool) -> Server:
            if args.server != "portico":
                return Server(args.server, workdir)
            env = {"PYTHONPATH": str(args.old_src.resolve())} if old and args.old_src else None
            return Server("portico", workdir, config=voice_config(workdir), env=env)

        servers = {"old": server(True), "new": server(False)}
        if args.old_bench is not None:
            servers["new"] = servers["old"]  # one server, two clients
        benches = {"old": args.old_bench, "new": None}
        distinct = list({id(s): s for s in servers.values()}.values())
        try:
            for each in distinct:
                each.launch()
            for each in distinct:
                each.await_ready()

            def measure(name: str, count: int) -> Sample:
                with loadgen_from(benches[name]):
                    sample = measure_voice(servers[name], plan, count)
                log_voice(f"{name} {count:5}", sample)
                return sample

            for rep in range(args.repeat):
                order = ["old", "new"] if rep % 2 == 0 else ["new", "old"]
                for count in callers:
                    for name in order:
                        results[(name, count)].append(measure(name, count))
            climbing = ["old", "new"]
            for count in steps:
                for name in list(climbing):
                    if voice_holds(measure(name, count), plan):
                        held[name] = count
                    else:
                        climbing.remove(name)
        finally:
            stop_all(distinct)
    what = f"Portico ({args.old_src} vs this tree)" if args.old_src else "the load generator"
    print(f"# Voice A/B of {what}, {time.strftime('%Y-%m-%d %H:%M')}, {args.repeat} repeats")
    print(f"server: {args.server}; window {args.seconds:g} s; median (min–max)\n")
    print("| Figure | callers | old | new |\n|---|---:|---:|---:|")
    for count in callers:
        for key, label in FIGURES:
            old = [s[key] for s in results[("old", count)]]
            new = [s[key] for s in results[("new", count)]]
            print(f"| {label} | {count} | {cell(old)} | {cell(new)} |")
    if steps:
        print(
            f"\nLargest step held (of {args.steps}): "
            f"old {held.get('old', 0)}, new {held.get('new', 0)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
