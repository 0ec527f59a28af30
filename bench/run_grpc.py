"""The `grpc` workload: the `stream50` turn through `runtime: grpc`, against the same turn
from the in-process scripted runtime, in the same run; prints a markdown section.

    python bench/run_grpc.py                # 3 repeats; about a minute
    python bench/run_grpc.py --quick        # 1 repeat, short windows
    python bench/run_grpc.py --out /tmp/grpc.md

Two Portico servers, interleaved in every repeat so background noise hits them alike:
`scripted` (`--runtime scripted`, bench/script.yaml) and `grpc` (`--runtime grpc` dialling
`portico agent serve grpc_agent:handler`, bench/grpc_agent.py: the same 50 chunks, in its
own process). Each gets bench/run.py's `stream` workload (/ws, 1 client process) and its
`latency` workload at each rate (first-chunk p50/p99; 200 and 50 msg/s, --quick 200). The
gRPC server's CPU is the facade's; the agent's process is reported beside it. Each repeat
also measures the floor of the hop: the same stream shape over bare grpc.aio, no Portico
(bench/grpc_floor.py).

Targets (figures, not tests): /ws stream throughput through `runtime: grpc` at least 0.5x
the scripted runtime's; the first-chunk p99 the gRPC hop adds at 200 msg/s at most 1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from common import raise_fd_limit
from harness import BENCH, CpuSnapshot, Server, read_line, stop_all, stop_process
from run import QUICK, Plan, background_cpu, log, measure_latency, measure_stream

AGENT_HANDLER = "grpc_agent:handler"
AGENT_READY = re.compile(r"serving grpc://[^:]+:(?P<port>\d+)")
KINDS = ("scripted", "grpc")
# grpc / scripted turns per second: each turn is the same 50 chunks' text, and chunk
# boundaries carry no meaning (text ready together crosses the hop as one chunk, so the
# grpc placement sends fewer, larger frames; docs/runtime-grpc.md).
STREAM_TARGET = 0.5
HOP_P99_TARGET_MS = 1.0


class Agent:
    """`portico agent serve` of the bench agent, on a free port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.process: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> Agent:
        self.workdir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "portico", "agent", "serve", AGENT_HANDLER]
        command += ["--port", "0", "--log-level", "WARNING"]
        with (self.workdir / "agent.log").open("w") as log_file:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
                cwd=BENCH,  # `grpc_agent` imports from here
                env={**_inherited(), "PYTHONPATH": str(BENCH)},
            )
        assert self.process.stdout is not None
        deadline = time.monotonic() + 30.0
        while (line := read_line(self.process.stdout, deadline)) is not None:
            if match := AGENT_READY.search(line):
                self.port = int(match["port"])
                return self
        self.stop()
        raise RuntimeError("the bench agent did not start:\n" + self.log_text())

    def log_text(self) -> str:
        return (self.workdir / "agent.log").read_text()[-2000:]

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None


def _inherited() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PORTICO_")}


class GrpcPortico(Server):
    """Portico whose default agent is `runtime: grpc`, dialling `agent`."""

    def __init__(self, workdir: Path, agent: Agent, log_level: str | None) -> None:
        super().__init__("portico", workdir, log_level)
        self.agent = agent

    def command(self) -> list[str]:
        command = super().command()
        runtime = command.index("--runtime")
        del command[runtime : runtime + 4]  # `--runtime scripted --script PATH`
        return [*command, "--runtime", "grpc"]

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "PORTICO_GRPC_TARGET": f"127.0.0.1:{self.agent.port}"}


Samples = dict[tuple[str, str], list[dict[str, float]]]


def run(plan: Plan, workdir: Path) -> Samples:
    agent = Agent(workdir / "agent").start()
    servers = {"scripted": Server("portico", workdir, plan.log_level)}
    servers["grpc"] = GrpcPortico(workdir, agent, plan.log_level)
    results: Samples = {}
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.await_ready()
        for rep in range(plan.repeat):
            order = KINDS if rep % 2 == 0 else KINDS[::-1]
            for kind in order:
                before = CpuSnapshot.take(agent.pid, [])
                sample = measure_stream(servers[kind], plan, 1)
                sample["agent_cpu"] = _agent_cpu(before, agent) if kind == "grpc" else 0.0
                results.setdefault(("stream", kind), []).append(sample)
                log(
                    f"grpc-bench stream  rep {rep + 1} {kind:8}: {sample['turns_per_s']:6.0f} "
                    f"turns/s, {sample['frames_per_s']:6.0f} frames/s, "
                    f"server CPU {sample['server_cpu']:.0f}%, agent CPU "
                    f"{sample['agent_cpu']:.0f}%, errors {sample['errors']:.0f}"
                )
            floor = measure_floor(plan)
            results.setdefault(("floor", "grpc"), []).append(floor)
            log(f"grpc-bench floor   rep {rep + 1}: {floor['messages_per_s']:8.0f} msg/s")
            for rate in plan.rates:
                bare = measure_floor(plan, "--latency", f"{rate:g}")
                results.setdefault((f"floor{rate:g}", "grpc"), []).append(bare)
                for kind in order:
                    sample = measure_latency(servers[kind], plan, rate)
                    results.setdefault((f"latency{rate:g}", kind), []).append(sample)
                    log(
                        f"grpc-bench latency rep {rep + 1} {kind:8} {rate:g}/s: first chunk "
                        f"p50 {sample['first_p50_ms']:.2f} ms p99 "
                        f"{sample['first_p99_ms']:.2f} ms, errors {sample['errors']:.0f}"
                    )
    finally:
        stop_all(list(servers.values()))
        agent.stop()
    return results


def measure_floor(plan: Plan, *extra: str) -> dict[str, float]:
    """bench/grpc_floor.py: the same stream shape over bare grpc.aio, no Portico."""
    found = subprocess.run(
        [sys.executable, str(BENCH / "grpc_floor.py"), "--seconds", str(plan.seconds), *extra],
        capture_output=True,
        text=True,
        timeout=plan.seconds + 60,
        check=True,
    )
    return {key: float(value) for key, value in json.loads(found.stdout).items()}


def _agent_cpu(before: CpuSnapshot, agent: Agent) -> float:
    """% of a core the agent used from `before` (launch and warm-up included) to now."""
    after = CpuSnapshot.take(agent.pid, [])
    return 100 * (after.server - before.server) / (after.at - before.at)


def median(samples: list[dict[str, float]], key: str) -> float:
    return statistics.median(sample[key] for sample in samples)


def spread(samples: list[dict[str, float]], key: str, digits: int) -> str:
    values = [sample[key] for sample in samples]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    figures = (min(values), median(samples, key), max(values))
    low, middle, high = (f"{v:.{digits}f}" for v in figures)
    return f"{middle} ({low}-{high})"


def report(results: Samples, plan: Plan, commit: str, background: float, took: float) -> str:
    stream_s, stream_g = results[("stream", "scripted")], results[("stream", "grpc")]
    rate = plan.rates[0]  # the target's
    ratio = median(stream_g, "turns_per_s") / median(stream_s, "turns_per_s")
    hop = hop_p99(results, rate)
    floor = results[("floor", "grpc")]
    errors = sum(s.get("errors", 0.0) for rows in results.values() for s in rows)
    rates = ", ".join(f"{r:g}" for r in plan.rates)
    lines = [
        "## Bring your own agent: `runtime: grpc` (bench/run_grpc.py)",
        "",
        f"Commit `{commit}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{plan.repeat} repeat(s), median (min-max); background CPU before the run "
        f"{background:.0f}% of a core; took {took:.0f} s. `scripted`: `--runtime scripted`, "
        "scenario `stream50`; `grpc`: `--runtime grpc` dialling `portico agent serve` "
        "(bench/grpc_agent.py: the same 50 chunks) in its own process. The servers were "
        "interleaved; both log at WARNING. stream: "
        f"{plan.clients} clients, 1 process, {plan.warmup:g} s warm-up, {plan.seconds:g} s "
        f"window; latency: open loop at {rates} msg/s over {plan.pool} connections.",
        "",
        "| Workload | scripted (in process) | grpc (agent process) | grpc / scripted |",
        "|---|---|---|---|",
        f"| /ws stream, turns/s (50 chunks' text each) | {spread(stream_s, 'turns_per_s', 0)} | "
        f"{spread(stream_g, 'turns_per_s', 0)} | {ratio:.2f} |",
        f"| /ws stream, frames/s | {spread(stream_s, 'frames_per_s', 0)} | "
        f"{spread(stream_g, 'frames_per_s', 0)} | |",
        f"| bare grpc.aio, same shape (bench/grpc_floor.py), messages/s | - | "
        f"{spread(floor, 'messages_per_s', 0)} | |",
        f"| stream: Portico CPU % | {spread(stream_s, 'server_cpu', 0)} | "
        f"{spread(stream_g, 'server_cpu', 0)} | |",
        f"| stream: agent process CPU % | - | {spread(stream_g, 'agent_cpu', 0)} | |",
        *(row for r in plan.rates for row in latency_rows(results, r)),
        "",
        f"Targets: stream through grpc >= {STREAM_TARGET:g}x scripted: **{ratio:.2f}x** "
        f"({'met' if ratio >= STREAM_TARGET else 'missed'}); first-chunk p99 added by the "
        f"hop <= {HOP_P99_TARGET_MS:g} ms: **{hop:+.2f} ms** "
        f"({'met' if hop <= HOP_P99_TARGET_MS else 'missed'}; the p50 hop: "
        f"{hop_p50(results, rate):+.2f} ms). Errors: {errors:.0f}.",
        "",
    ]
    return "\n".join(lines)


def hop_p99(results: Samples, rate: float) -> float:
    """First-chunk p99 through grpc minus the scripted runtime's, at `rate`."""
    grpc, scripted = (
        results[(f"latency{rate:g}", "grpc")],
        results[(f"latency{rate:g}", "scripted")],
    )
    return median(grpc, "first_p99_ms") - median(scripted, "first_p99_ms")


def hop_p50(results: Samples, rate: float) -> float:
    grpc, scripted = (
        results[(f"latency{rate:g}", "grpc")],
        results[(f"latency{rate:g}", "scripted")],
    )
    return median(grpc, "first_p50_ms") - median(scripted, "first_p50_ms")


def latency_rows(results: Samples, rate: float) -> list[str]:
    scripted, grpc = (
        results[(f"latency{rate:g}", "scripted")],
        results[(f"latency{rate:g}", "grpc")],
    )
    bare = results[(f"floor{rate:g}", "grpc")]
    return [
        f"| first chunk p50 at {rate:g}/s, ms | {spread(scripted, 'first_p50_ms', 2)} | "
        f"{spread(grpc, 'first_p50_ms', 2)} | |",
        f"| first chunk p99 at {rate:g}/s, ms | {spread(scripted, 'first_p99_ms', 2)} | "
        f"{spread(grpc, 'first_p99_ms', 2)} | {hop_p99(results, rate):+.2f} ms |",
        f"| bare grpc.aio write -> first chunk at {rate:g}/s, p50 / p99 ms | - | "
        f"{spread(bare, 'first_chunk_p50_ms', 2)} / {spread(bare, 'first_chunk_p99_ms', 2)} | |",
    ]


def git_commit() -> str:
    found = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=BENCH
    )
    return found.stdout.strip() or "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, short windows")
    parser.add_argument("--repeat", type=int, help="measurements per figure (default 3)")
    parser.add_argument("--seconds", type=float, help="stream and latency window, seconds")
    parser.add_argument("--clients", type=int, help="stream: concurrent clients (default 100)")
    parser.add_argument("--out", type=Path, help="also write the section here")
    args = parser.parse_args(argv)
    plan = replace(QUICK if args.quick else Plan(), log_level="WARNING")
    if args.repeat is not None:
        plan = replace(plan, repeat=args.repeat)
    if args.seconds is not None:
        plan = replace(plan, seconds=args.seconds, latency_seconds=args.seconds)
    if args.clients is not None:
        plan = replace(plan, clients=args.clients)
    raise_fd_limit()
    background, clock = background_cpu(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="portico-bench-grpc-") as workdir:
        results = run(plan, Path(workdir))
    text = report(results, plan, git_commit(), background, time.monotonic() - clock)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
