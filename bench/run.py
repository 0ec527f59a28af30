"""Run every workload against Portico and the two bare servers; print and write a markdown report.

    python bench/run.py             # the full run (about 8 minutes); writes bench/results/latest.md
    python bench/run.py --quick     # about a minute
    python bench/run.py --only rpc  # one section (rpc, session), for A/B runs
    python bench/run.py --clients 2 --seconds 1 --idle 20 --repeat 1 --out /tmp/r.md
    python bench/run.py --only idle --kinds portico,aiohttp --idle 10000   # one phase, an A/B
    python bench/run.py --only voice --voice 100:100,250,500   # voice calls (issue 15)

Each server runs in its own process, each load generator in its own (bench/loadgen.py), all
on 127.0.0.1. Every figure is measured `--repeat` times, servers interleaved so background
noise hits them alike; the report gives the median, the min-max spread and Portico's ratio
to each bare server (bench/baseline.py).

Portico's resumable sessions (`/v1/session`) are measured too: the stream workload on them,
right after Portico's `/ws` stream in each repeat (the report divides the two), and the
time a resume with 1,000 and 10,000 buffered messages takes (`--resume`), on a Portico of
its own whose resend buffer holds the largest backlog.

Portico's `/v1/rpc` too, on a Portico of its own with one API key per pooled connection
(bench/harness.py says why): `v1.message.send` -> first `live` chunk at the target rate,
back to back with `/ws` latency at the same rate on the same server in each repeat, and
`v1.message.list` pages of a session filled with `--rpc-messages` messages through the RPC.

Idle memory at `--idle` counts on every server, and `--idle-max` (50,000) idle connections
on one Portico (measured at the hard RLIMIT_NOFILE when that is lower). Voice calls
(`--voice`): real-time 20 ms PCM callers over `/ws`, echoed by the scripted duplex runtime
beside the bare servers' echo, then Portico's callers, the bare aiohttp echo's and the
bare picows echo's (the machine's floor) stepped up alternately to a 20 ms p99 (the largest
N each holds, in the same run), with the load generators' CPU at each step.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from common import FILL_SCENARIO, FILL_WINDOW, PAGE_SIZE, raise_fd_limit
from harness import (
    BENCH,
    BENCH_STORE,
    PORTICO_BENCH_ENV,
    PORTICO_ENV_HELP,
    PORTICO_RESUME_ENV,
    SERVER_KINDS,
    CpuSnapshot,
    Loadgen,
    Server,
    add_portico_env,
    cpu_percentages,
    picows_available,
    portico_rpc_env,
    rss_kib,
    set_store,
    stop_all,
    voice_config,
)

FD_RESERVE = 200  # descriptors a server keeps for its own files, listener and archive
SETTLE = 0.3  # seconds for a server's RSS to settle after connections open
RESULT_SLACK = 30.0  # seconds past its own bounds a load generator may take to report
IDLE_WARMUP = 50  # connections opened and closed before the baseline RSS is read
BUSY_THRESHOLD = 50.0  # % of a core used by other processes before the run
BUSY_WARNING = (
    " **The machine was busy: absolute figures are low and noisy; servers were interleaved, "
    "so the ratios are the figures to compare.**"
)

Sample = dict[str, float]
Results = dict[tuple[str, str], list[Sample]]  # (workload row, server kind) -> one per repeat


@dataclass(frozen=True)
class Plan:
    repeat: int = 3
    clients: int = 100
    launch: float = 0.7  # seconds for stream generators to start and connect before sending
    warmup: float = 0.5
    seconds: float = 2.0  # 2.5 until the /v1/session phases came; the run stays under 5 min
    client_procs: tuple[int, ...] = (1, 2)
    # The first rate is the target's (200 msg/s); a lower one shows latency below saturation.
    rates: tuple[float, ...] = (200.0, 50.0)
    pool: int = 32
    latency_warmup: float = 0.3
    latency_seconds: float = 2.0
    idle_counts: tuple[int, ...] = (1000, 10000)
    idle_per_process: int = 5000
    # One Portico holding this many idle /ws connections (0 skips), once per run, after the
    # idle repeats; the server's RLIMIT_NOFILE (its hard limit) may be below it.
    idle_max: int = 50_000
    kinds: tuple[str, ...] = SERVER_KINDS
    log_level: str | None = None  # None: Portico's default (INFO, one line per turn)
    # /v1/session stream beside Portico's /ws stream (1 client process) in every repeat.
    session_stream: bool = True
    # session_resume: (buffered messages, timed resumes); each backlog is a `long<N>`
    # scenario of bench/script.yaml. The timed resumes are pooled for p50/p99.
    resume: tuple[tuple[int, int], ...] = ((1000, 200), (10000, 20))
    resume_warm: int = 1  # unmeasured resumes first, per backlog
    # /v1/rpc: send -> first live chunk at rates[0] over `pool` connections (and /ws at the
    # same rate on the same server) in every repeat; then, once, `rpc_pages` timed
    # `v1.message.list` pages of a session of `rpc_messages` messages (0 skips the pages).
    rpc: bool = True
    rpc_repeat: int | None = None  # None: `repeat`
    rpc_messages: int = 10_000
    rpc_pages: int = 1000
    rpc_page_warm: int = 5
    # voice (issue 15): `voice_callers` callers on every server in each repeat (the relay
    # latency beside the bare echo), then Portico, the bare aiohttp echo and the bare
    # picows echo, alternately, at each of `voice_steps` callers, each until its echo p99
    # passes `voice_p99_ms` (or frames are lost, or errors come): the bare servers' own
    # ceilings on this machine, measured beside Portico's, are what Portico's is judged
    # against (aiohttp: the same stack; picows: the fastest Python server, the floor).
    voice_callers: int = 100
    voice_steps: tuple[int, ...] = (100, 250, 500, 750, 1000, 1500, 2000)
    voice_warmup: float = 1.0
    voice_seconds: float = 3.0
    voice_p99_ms: float = 20.0
    voice_per_process: int = 500  # callers per load generator
    # Which phases run: the stream and latency repeats, /v1/rpc, resumes, idle, voice.
    phases: tuple[str, ...] = ("stream", "rpc", "resume", "idle", "idle_max", "voice")


QUICK = Plan(
    launch=0.7,
    warmup=0.3,
    seconds=0.8,
    client_procs=(1,),
    latency_warmup=0.3,
    latency_seconds=0.8,
    rates=(200.0,),
    idle_counts=(500,),
    idle_max=0,
    voice_callers=50,
    voice_steps=(100, 500),
    voice_warmup=0.5,
    voice_seconds=1.0,
    resume=((1000, 20), (10000, 5)),
    rpc_repeat=1,
    rpc_messages=2000,
    rpc_pages=200,
)
RPC_DEFAULT_RATE = 200.0  # when `--rates` names none
PAGE_TARGET_MESSAGES = 10_000  # the session size the page target is stated for


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def split(total: int, parts: int) -> list[int]:
    """`total` as `parts` near-equal positive shares."""
    parts = max(1, min(parts, total))
    return [total // parts + (i < total % parts) for i in range(parts)]


def sleep_until(wall_time: float) -> None:
    time.sleep(max(0.0, wall_time - time.time()))


@contextmanager
def loadgens(workload: str, url: str, shares: Sequence[Sequence[str]]) -> Iterator[list[Loadgen]]:
    """Start one load generator per argument list; every one is stopped on the way out."""
    started: list[Loadgen] = []
    try:
        for args in shares:
            started.append(Loadgen(workload, url, args))
        yield started
    finally:
        for gen in started:
            gen.stop()


# -- one measurement each ----------------------------------------------------------------


def measure_stream(server: Server, plan: Plan, procs: int, workload: str = "stream") -> Sample:
    """`stream` on /ws, or `session_stream` on Portico's /v1/session."""
    start_at = time.time() + plan.launch
    window = ["--warmup", str(plan.warmup), "--seconds", str(plan.seconds)]
    shares = [
        ["--clients", str(n), *window, "--start-at", str(start_at)]
        for n in split(plan.clients, procs)
    ]
    bound = plan.launch + plan.warmup + plan.seconds + RESULT_SLACK
    url = server.session_url if workload == "session_stream" else server.url
    with loadgens(workload, url, shares) as gens:
        pids = [gen.pid for gen in gens]
        sleep_until(start_at + plan.warmup)
        before = CpuSnapshot.take(server.pid, pids)
        time.sleep(plan.seconds)
        after = CpuSnapshot.take(server.pid, pids)
        results = [gen.result(bound) for gen in gens]
    turns = sum(r["turns_per_s"] for r in results)
    acks = sum(r.get("acks_per_turn", 0.0) * r["turns_per_s"] for r in results)
    return {
        "frames_per_s": sum(r["frames_per_s"] for r in results),
        "turns_per_s": turns,
        "errors": sum(r["errors"] + r["connect_errors"] for r in results),
        **({"acks_per_turn": acks / turns if turns else 0.0} if workload != "stream" else {}),
        **cpu_percentages(before, after),
    }


def measure_latency(
    server: Server,
    plan: Plan,
    rate: float,
    workload: str = "latency",
    users: int = 0,
    cpu: bool = False,
) -> Sample:
    """`latency` on /ws, or `rpc_latency` on /v1/rpc; `users`: API keys to use (0: none).

    With `cpu`, the generator starts sending `launch` seconds after it is started, and the
    server's, the client's and other processes' CPU over its window are measured too.
    """
    args = ["--rate", str(rate), "--pool", str(plan.pool), "--users", str(users)]
    args += ["--warmup", str(plan.latency_warmup), "--seconds", str(plan.latency_seconds)]
    start_at = time.time() + plan.launch
    if cpu:
        args += ["--start-at", str(start_at)]
    url = server.rpc_url if workload == "rpc_latency" else server.url
    usage: Sample = {}
    with loadgens(workload, url, [args]) as (gen,):
        if cpu:
            sleep_until(start_at + plan.latency_warmup)
            before = CpuSnapshot.take(server.pid, [gen.pid])
            time.sleep(plan.latency_seconds)
            usage = cpu_percentages(before, CpuSnapshot.take(server.pid, [gen.pid]))
        bound = plan.launch + plan.latency_warmup + plan.latency_seconds + RESULT_SLACK
        result = gen.result(bound)
    figures = {key: float(value) for key, value in result.items() if key.endswith("_ms")}
    errors = result["errors"] + result["connect_errors"]
    achieved = result["sent"] / (plan.latency_warmup + plan.latency_seconds)
    return {
        **figures,
        "achieved_rate": achieved,
        "samples": result["samples"],
        "missed": result["missed"],
        "errors": errors,
        **usage,
    }


def measure_resume(server: Server, plan: Plan, backlog: int, samples: int) -> Sample:
    """`samples` resumes of a session with `backlog` buffered messages (one at a time)."""
    args = ["--scenario", f"long{backlog}", "--backlog", str(backlog)]
    args += ["--samples", str(samples), "--warm", str(plan.resume_warm)]
    # A bound for a failure only: a resume of 10,000 messages takes well under a second.
    bound = RESULT_SLACK + (samples + plan.resume_warm) * (5.0 + 0.002 * backlog)
    with loadgens("session_resume", server.session_url, [args]) as (gen,):
        result = gen.result(bound)
    figures = {key: float(value) for key, value in result.items() if key.endswith("_ms")}
    return {
        **figures,
        "samples": result["samples"],
        "received_min": result["received_min"],
        "fixed_wait": result["fixed_wait"],
        "errors": result["errors"],
    }


def measure_rpc_pages(server: Server, plan: Plan) -> Sample:
    """Fill a session with `rpc_messages` messages, then time `rpc_pages` pages of it."""
    args = ["--users", "1", "--messages", str(plan.rpc_messages)]
    args += ["--samples", str(plan.rpc_pages), "--warm", str(plan.rpc_page_warm)]
    # A bound for a failure only: filling 10,000 messages takes a few seconds, a page ~1 ms.
    bound = RESULT_SLACK + 0.02 * plan.rpc_messages + (plan.rpc_pages + plan.rpc_page_warm)
    with loadgens("rpc_pages", server.rpc_url, [args]) as (gen,):
        result = gen.result(bound)
    figures = {key: float(value) for key, value in result.items() if key.endswith("_ms")}
    keys = ("messages", "sends", "replies", "fill_s", "samples", "errors")
    return {**figures, **{key: float(result[key]) for key in keys}}


def wait_ready(gens: Sequence[Loadgen]) -> int:
    """Wait for every `idle` generator's `ready`; returns the connections that failed."""
    return sum(int(gen.next_event(RESULT_SLACK * 3)["connect_errors"]) for gen in gens)


def release(gens: Sequence[Loadgen], server: Server) -> int:
    """Let the connections go and kill the server (measured already: a graceful close of
    10,000 sockets takes longer than opening them); returns how many the server had
    dropped while they were held."""
    for gen in gens:
        gen.tell()
    dropped = sum(int(gen.next_event(RESULT_SLACK)["dropped"]) for gen in gens)
    server.kill()
    for gen in gens:
        try:
            # Its closes end at once (the server is gone) or after loadgen's CLOSE_TIMEOUT.
            gen.result(RESULT_SLACK * 2)
        except RuntimeError as exc:  # measured already: a slow goodbye costs nothing
            log(f"idle    a load generator did not finish its closes: {exc}")
        gen.stop()
    return dropped


def idle_shares(plan: Plan) -> list[list[int]]:
    """Per count, the connections each new generator opens (at most `idle_per_process`)."""
    counts = sorted(plan.idle_counts)
    batches = [count - before for before, count in zip([0, *counts], counts, strict=False)]
    return [split(batch, math.ceil(batch / plan.idle_per_process)) for batch in batches]


def measure_idle(server: Server, plan: Plan) -> dict[int, Sample]:
    """RSS growth per connection at each of `idle_counts` connections held at once.

    Ends with the server killed: use a fresh one for each call.
    """
    shares = idle_shares(plan)
    # The first generator cycles some connections before the baseline is read, so the
    # server's one-time costs (imports, buffers, caches) are not counted per connection.
    sources = (f"127.0.0.{2 + i}" for i in range(250))  # 28k ephemeral ports per address
    first = Loadgen(
        "idle",
        server.url,
        ["--count", str(shares[0][0]), "--warm", str(IDLE_WARMUP), "--source", next(sources)],
    )
    held = [first]
    samples: dict[int, Sample] = {}
    failures = 0
    try:
        first.next_event(RESULT_SLACK * 3)  # `warmed`
        time.sleep(SETTLE)
        base = rss_kib(server.pid)
        first.tell()
        for index, (count, batch) in enumerate(zip(sorted(plan.idle_counts), shares, strict=True)):
            # The first batch's first share is `first`'s, already under way.
            new = [
                Loadgen("idle", server.url, ["--count", str(n), "--source", next(sources)])
                for n in batch[index == 0 :]
            ]
            held += new
            failures += wait_ready([first, *new] if index == 0 else new)
            time.sleep(SETTLE)
            rss = rss_kib(server.pid)
            held_now = max(1, count - failures)
            samples[count] = {"kib_per_conn": (rss - base) / held_now, "errors": failures}
        samples[max(samples)]["errors"] += release(held, server)
    finally:
        for gen in held:
            gen.stop()
    return samples


# -- the whole run -------------------------------------------------------------------------


def run_streams_and_latency(plan: Plan, workdir: Path, results: Results) -> None:
    servers = {kind: Server(kind, workdir, plan.log_level) for kind in plan.kinds}
    try:
        for server in servers.values():
            server.launch()  # start-ups overlap
        for server in servers.values():
            server.await_ready()
        for rep in range(plan.repeat):
            for kind, server in servers.items():
                for procs in plan.client_procs:
                    sample = measure_stream(server, plan, procs)
                    results[(f"stream{procs}", kind)].append(sample)
                    log(
                        f"stream  rep {rep + 1} {kind:8} {procs} proc: "
                        f"{sample['frames_per_s']:9.0f} frames/s, server CPU "
                        f"{sample['server_cpu']:.0f}%, client CPU {sample['client_cpu']:.0f}%"
                    )
                    if kind == "portico" and procs == 1 and plan.session_stream:
                        # Right after /ws stream on the same server and client count, so
                        # the ratio of the two sees the same machine.
                        sample = measure_stream(server, plan, 1, "session_stream")
                        results[("session_stream1", kind)].append(sample)
                        log(
                            f"session rep {rep + 1} {kind:8} 1 proc: "
                            f"{sample['frames_per_s']:9.0f} frames/s, server CPU "
                            f"{sample['server_cpu']:.0f}%, client CPU "
                            f"{sample['client_cpu']:.0f}%"
                        )
        for rep in range(plan.repeat):
            for rate in plan.rates:
                for kind, server in servers.items():
                    sample = measure_latency(server, plan, rate)
                    results[(f"latency{rate:g}", kind)].append(sample)
                    log(
                        f"latency rep {rep + 1} {kind:8} {rate:g}/s: first chunk p50 "
                        f"{sample['first_p50_ms']:.2f} ms p99 {sample['first_p99_ms']:.2f} ms, "
                        f"{sample['missed']:.0f} sends skipped (pool busy)"
                    )
    finally:
        stop_all(list(servers.values()))


def rpc_rate(plan: Plan) -> float:
    return plan.rates[0] if plan.rates else RPC_DEFAULT_RATE


def rpc_repeats(plan: Plan) -> int:
    return plan.repeat if plan.rpc_repeat is None else plan.rpc_repeat


def run_rpc(plan: Plan, workdir: Path, results: Results) -> None:
    """/v1/rpc on a Portico of its own: Portico's settings plus an API key per connection."""
    server = Server("portico", workdir, plan.log_level, env=portico_rpc_env(plan.pool))
    rate = rpc_rate(plan)
    clock = time.monotonic()
    try:
        server.start()
        for rep in range(rpc_repeats(plan)):
            # Back to back on the same server and rate; the order alternates by repeat.
            order = ["latency", "rpc_latency"]
            for workload in order if rep % 2 == 0 else order[::-1]:
                sample = measure_latency(server, plan, rate, workload, plan.pool, cpu=True)
                key = "rpc_ws_latency" if workload == "latency" else "rpc_latency"
                results[(f"{key}{rate:g}", "portico")].append(sample)
                log(
                    f"rpc     rep {rep + 1} {workload:11} {rate:g}/s: first chunk p50 "
                    f"{sample['first_p50_ms']:.2f} ms p99 {sample['first_p99_ms']:.2f} ms, "
                    f"{sample['missed']:.0f} sends skipped, errors {sample['errors']:.0f}, "
                    f"server CPU {sample['server_cpu']:.0f}%, others {sample['other_cpu']:.0f}%"
                )
        if plan.rpc_messages:
            sample = measure_rpc_pages(server, plan)
            results[("rpc_pages", "portico")].append(sample)
            log(
                f"rpc     pages of {sample['messages']:.0f} messages (filled in "
                f"{sample['fill_s']:.1f} s): p50 {sample['page_p50_ms']:.2f} ms p99 "
                f"{sample['page_p99_ms']:.2f} ms, errors {sample['errors']:.0f}"
            )
    finally:
        server.stop()
    log(f"rpc     took {time.monotonic() - clock:.1f} s")


def run_resume(plan: Plan, workdir: Path, results: Results) -> None:
    """Resume latency on a Portico of its own (a resend buffer for the largest backlog)."""
    server = Server("portico", workdir, plan.log_level, env=PORTICO_RESUME_ENV)
    try:
        server.start()
        for backlog, samples in plan.resume:
            sample = measure_resume(server, plan, backlog, samples)
            results[(f"resume{backlog}", "portico")].append(sample)
            log(
                f"resume  {backlog:6} buffered, {sample['samples']:.0f} resumes: ready p50 "
                f"{sample['ready_p50_ms']:.1f} ms, done p50 {sample['done_p50_ms']:.1f} ms "
                f"p99 {sample['done_p99_ms']:.1f} ms, errors {sample['errors']:.0f}"
            )
    finally:
        server.stop()


def run_idle_all(plan: Plan, workdir: Path, results: Results) -> None:
    for rep in range(plan.repeat):
        # Fresh servers each repeat: memory freed by an earlier repeat's connections would
        # be reused and understate the cost per connection. Launched together, so their
        # start-ups overlap; each is measured alone, the others idle.
        servers = [Server(kind, workdir, plan.log_level) for kind in plan.kinds]
        try:
            for server in servers:
                server.launch()
            for server in servers:
                server.await_ready()
                for count, sample in measure_idle(server, plan).items():
                    results[(f"idle{count}", server.kind)].append(sample)
                    log(
                        f"idle    rep {rep + 1} {server.kind:8} {count:6} conns: "
                        f"{sample['kib_per_conn']:.1f} KiB/conn, errors {sample['errors']:.0f}"
                    )
        finally:
            stop_all(servers)


def run_idle_max(plan: Plan, workdir: Path, results: Results) -> None:
    """`idle_max` connections on one Portico, once: held, failed, RSS per connection."""
    server = Server("portico", workdir, plan.log_level)
    clock = time.monotonic()
    # The server inherits this process's limit (raise_fd_limit: the hard one). A count
    # above it cannot be held, whatever Portico does: it is measured at the limit
    # instead, and the report says so.
    fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    count = min(plan.idle_max, fd_limit - FD_RESERVE)
    try:
        server.start()
        sample = measure_idle(server, replace(plan, idle_counts=(count,)))
        result = sample[count]
        result["fd_limit"] = float(fd_limit)
        result["held"] = float(count - result["errors"])
        result["count"] = float(count)
        results[("idle_max", "portico")].append(result)
        log(
            f"idle    max {count} conns: {result['kib_per_conn']:.1f} KiB/conn, errors "
            f"{result['errors']:.0f}, server RLIMIT_NOFILE {result['fd_limit']:.0f}, "
            f"{time.monotonic() - clock:.0f} s"
        )
    finally:
        server.stop()


VOICE_FRAME_S = 0.020  # a caller's frame period (bench/loadgen.py)
VOICE_DRAIN_SLACK = 40.0  # seconds past the window for the drain, hangups and closes


def voice_server(plan: Plan, workdir: Path) -> Server:
    return Server("portico", workdir, plan.log_level, config=voice_config(workdir))


def measure_voice(server: Server, plan: Plan, callers: int) -> Sample:
    """`callers` real-time callers (bench/loadgen.py `voice`), the server's CPU over the
    window. Several load generators: each one's percentiles, the largest taken."""
    shares = split(callers, math.ceil(callers / plan.voice_per_process))
    window = ["--warmup", str(plan.voice_warmup), "--seconds", str(plan.voice_seconds)]
    url = server.url + "?binary=true"  # agent audio as binary frames
    args = [
        ["--clients", str(n), *window, "--source", f"127.0.0.{2 + i}"] for i, n in enumerate(shares)
    ]
    with loadgens("voice", url, args) as gens:
        connect_errors = sum(
            int(gen.next_event(RESULT_SLACK * 3)["connect_errors"]) for gen in gens
        )
        for gen in gens:
            gen.tell()  # every generator starts sending now
        time.sleep(plan.voice_warmup)
        pids = [gen.pid for gen in gens]
        before = CpuSnapshot.take(server.pid, pids)
        time.sleep(plan.voice_seconds)
        usage = cpu_percentages(before, CpuSnapshot.take(server.pid, pids))
        found = [gen.result(RESULT_SLACK + VOICE_DRAIN_SLACK) for gen in gens]
    sent = sum(r["sent"] for r in found)
    return {
        "callers": float(callers),
        "sent": float(sent),
        "lost": float(sum(r["lost"] for r in found)),
        "errors": float(connect_errors + sum(r["errors"] + r["dropped"] for r in found)),
        "echo_p50_ms": max(r["echo_p50_ms"] for r in found),
        "echo_p99_ms": max(r["echo_p99_ms"] for r in found),
        "lag_p99_ms": max(r["lag_p99_ms"] for r in found),
        "start_p50_ms": max(r["start_p50_ms"] for r in found),
        "start_p99_ms": max(r["start_p99_ms"] for r in found),
        "frames_per_s": sent / plan.voice_seconds,
        "cpu_per_call": usage["server_cpu"] / callers,
        "client_cpu_per_call": usage["client_cpu"] / callers,
        "loadgens": float(len(gens)),
        "load_1m": os.getloadavg()[0],
        # Server CPU per frame relayed (in and its echo out): what a frame costs even
        # when the server gets less CPU than the callers' rate needs (a busy machine).
        "cpu_us_per_frame": usage["server_cpu"]
        / 100
        * plan.voice_seconds
        * 1e6
        / max(1, sum(r["echoes_in_window"] for r in found)),
        **usage,
    }


def voice_holds(sample: Sample, plan: Plan) -> bool:
    """Whether a step held: p99 under the bound, nothing lost beyond 0.1 %, no errors."""
    lost_ok = sample["lost"] <= 0.001 * max(1.0, sample["sent"])
    return sample["echo_p99_ms"] < plan.voice_p99_ms and lost_ok and sample["errors"] == 0


def log_voice(what: str, sample: Sample) -> None:
    log(
        f"voice   {what}: {sample['callers']:.0f} callers, echo p50 {sample['echo_p50_ms']:.2f} "
        f"ms p99 {sample['echo_p99_ms']:.2f} ms, lost {sample['lost']:.0f} of "
        f"{sample['sent']:.0f}, errors {sample['errors']:.0f}, server CPU "
        f"{sample['server_cpu']:.0f}% ({sample['cpu_us_per_frame']:.1f} µs a frame), "
        f"client CPU {sample['client_cpu']:.0f}% ({sample['loadgens']:.0f} proc), "
        f"send lag p99 {sample['lag_p99_ms']:.1f} ms, load {sample['load_1m']:.1f}"
    )


# The servers whose callers are stepped up (those of `--kinds`): picows is the floor.
VOICE_STEPPED = ("portico", "aiohttp", "picows")


def run_voice(plan: Plan, workdir: Path, results: Results) -> None:
    """Relay latency beside the bare echo servers, then Portico's callers and the bare
    echoes' stepped up."""
    servers = {"portico": voice_server(plan, workdir)}
    servers.update({k: Server(k, workdir) for k in plan.kinds if k != "portico"})
    clock = time.monotonic()
    try:
        for server in servers.values():
            server.launch()
        for server in servers.values():
            server.await_ready()
        for rep in range(plan.repeat if plan.voice_callers else 0):
            for kind, server in servers.items():
                sample = measure_voice(server, plan, plan.voice_callers)
                results[("voice", kind)].append(sample)
                log_voice(f"rep {rep + 1} {kind:8}", sample)
        step_voice(plan, {k: s for k, s in servers.items() if k in VOICE_STEPPED}, results)
    finally:
        stop_all(list(servers.values()))
    log(f"voice   took {time.monotonic() - clock:.0f} s")


def step_voice(plan: Plan, servers: dict[str, Server], results: Results) -> None:
    """Each server at each step in turn (alternating, so a busy spell of the machine
    falls on all), until its first step that does not hold: bounded by the steps."""
    climbing = list(servers)
    for callers in plan.voice_steps:
        for kind in list(climbing):
            sample = measure_voice(servers[kind], plan, callers)
            results[(f"voice_step{callers}", kind)].append(sample)
            log_voice(f"step {kind:8}", sample)
            if not voice_holds(sample, plan):
                climbing.remove(kind)
        if not climbing:
            return


def run(plan: Plan, workdir: Path) -> Results:
    results: Results = defaultdict(list)
    if "stream" in plan.phases:
        run_streams_and_latency(plan, workdir, results)
    if plan.rpc and "rpc" in plan.phases:
        run_rpc(plan, workdir, results)
    if plan.resume and "resume" in plan.phases:
        run_resume(plan, workdir, results)
    if plan.idle_counts and "idle" in plan.phases:
        run_idle_all(plan, workdir, results)
    if plan.idle_max and "idle_max" in plan.phases:
        run_idle_max(plan, workdir, results)
    if "voice" in plan.phases and (plan.voice_callers or plan.voice_steps):
        run_voice(plan, workdir, results)
    return results


# -- the report ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    workload: str  # key in Results
    figure: str  # key in a Sample
    label: str
    unit: str


def stats(
    results: Results, workload: str, figure: str, kind: str
) -> tuple[float, float, float] | None:
    """Median, min and max of one figure over the repeats, or None if never measured."""
    values = [sample[figure] for sample in results.get((workload, kind), []) if figure in sample]
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def fmt(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"


def cell(figures: tuple[float, float, float] | None) -> str:
    if figures is None:
        return "—"
    median, low, high = figures
    if low == high:
        return fmt(median)
    return f"{fmt(median)} ({fmt(low)}–{fmt(high)})"


def count_cell(figures: tuple[float, float, float] | None) -> str:
    """`cell` for a count: whole numbers (a median of an even number of repeats rounds)."""
    if figures is None:
        return "—"
    median, low, high = figures
    return f"{median:,.0f}" if low == high else f"{median:,.0f} ({low:,.0f}–{high:,.0f})"


def ratio_cell(portico: tuple[float, ...] | None, bare: tuple[float, ...] | None, unit: str) -> str:
    if portico is None or bare is None or bare[0] == 0:
        return "—"
    ratio = f"{portico[0] / bare[0]:.2f}"
    if unit == "ms":
        return f"{ratio} ({portico[0] - bare[0]:+.2f} ms)"
    if unit == "KiB":
        return f"{ratio} ({portico[0] - bare[0]:+.1f} KiB)"
    return ratio


def rows_for(plan: Plan) -> list[Row]:
    rows: list[Row] = []
    for procs in plan.client_procs:
        name = f"stream, {plan.clients} clients, {procs} client process{'es' if procs > 1 else ''}"
        rows.append(Row(f"stream{procs}", "frames_per_s", name, "frames/s"))
        rows.append(Row(f"stream{procs}", "turns_per_s", name, "turns/s"))
    for rate in plan.rates:
        key, name = f"latency{rate:g}", f"latency, {rate:g} msg/s over {plan.pool} connections"
        rows.append(Row(key, "achieved_rate", name, "msg/s achieved"))
        for stage, what in (("first", "send → first chunk"), ("done", "send → done")):
            for q in ("p50", "p99", "p999"):
                rows.append(Row(key, f"{stage}_{q}_ms", name, f"{what} {q}, ms"))
    for count in sorted(plan.idle_counts):
        label = f"idle, {count:,} connections"
        rows.append(Row(f"idle{count}", "kib_per_conn", label, "KiB"))
    return rows


def results_table(results: Results, plan: Plan) -> list[str]:
    head = (
        "| Workload | Figure | Portico | bare aiohttp | bare picows "
        "| Portico ÷ aiohttp | Portico ÷ picows |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|"]
    for row in rows_for(plan):
        portico, aio, pico = (stats(results, row.workload, row.figure, k) for k in SERVER_KINDS)
        unit = "ms" if row.figure.endswith("_ms") else row.unit
        unit_label = row.unit if unit != "KiB" else "server RSS per connection, KiB"
        lines.append(
            f"| {row.label} | {unit_label} | {cell(portico)} | {cell(aio)} | {cell(pico)} "
            f"| {ratio_cell(portico, aio, unit)} | {ratio_cell(portico, pico, unit)} |"
        )
    return lines


def diagnostics_table(results: Results, plan: Plan) -> list[str]:
    """Whether the client limits a figure: 2 client processes must not raise it."""
    lines = [
        "| Server | frames/s, 1 client proc | frames/s, 2 client procs | 2 ÷ 1 "
        "| server CPU % | client CPU % | other processes' CPU % | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in plan.kinds:
        one = stats(results, "stream1", "frames_per_s", kind)
        two = stats(results, "stream2", "frames_per_s", kind)
        ratio = f"{two[0] / one[0]:.2f}" if one and two else "—"
        cpu = [
            cell(stats(results, "stream1", key, kind))
            for key in ("server_cpu", "client_cpu", "other_cpu")
        ]
        errors = sum(
            sample["errors"]
            for (workload, server), samples in results.items()
            if server == kind
            for sample in samples
        )
        lines.append(
            f"| {kind} | {cell(one)} | {cell(two)} | {ratio} | {' | '.join(cpu)} | {errors:.0f} |"
        )
    return lines + errors_by_workload(results)


def errors_by_workload(results: Results) -> list[str]:
    """Which workloads the errors column counts (it sums them all): named when any."""
    counts = {
        f"{workload} on {server}": total
        for (workload, server), samples in results.items()
        if (total := sum(sample.get("errors", 0) for sample in samples))
    }
    if not counts:
        return []
    named = ", ".join(f"{where} {total:.0f}" for where, total in sorted(counts.items()))
    return ["", f"Errors by workload: {named}."]


def median_of(results: Results, workload: str, figure: str, kind: str) -> float | None:
    figures = stats(results, workload, figure, kind)
    return None if figures is None else figures[0]


def verdict(
    value: float | None, ok: Callable[[float], bool], text: str, show: Callable[[float], str] = fmt
) -> str:
    if value is None:
        return f"| {text} | not measured | — |"
    return f"| {text} | {show(value)} | {'met' if ok(value) else '**not met**'} |"


def targets_table(results: Results, plan: Plan) -> list[str]:
    def ratio(kind: str) -> float | None:
        portico = median_of(results, "stream1", "frames_per_s", "portico")
        bare = median_of(results, "stream1", "frames_per_s", kind)
        return None if portico is None or not bare else portico / bare

    target_rate = f"latency{plan.rates[0]:g}" if plan.rates else ""
    portico_p99 = median_of(results, target_rate, "first_p99_ms", "portico")
    bare_p99 = median_of(results, target_rate, "first_p99_ms", "aiohttp")
    added = None if portico_p99 is None or bare_p99 is None else portico_p99 - bare_p99
    session = median_of(results, "session_stream1", "frames_per_s", "portico")
    ws = median_of(results, "stream1", "frames_per_s", "portico")
    session_ratio = None if session is None or not ws else session / ws
    resume_p99 = median_of(results, "resume1000", "done_p99_ms", "portico")
    largest = max(plan.idle_counts, default=0)
    per_conn = median_of(results, f"idle{largest}", "kib_per_conn", "portico")
    idle_errors = sum(s["errors"] for s in results.get(("idle10000", "portico"), []))
    held = None if ("idle10000", "portico") not in results else idle_errors
    return [
        "| Target | Measured | |",
        "|---|---:|---|",
        verdict(ratio("aiohttp"), lambda v: v >= 0.80, "stream frames/s ≥ 0.80 × bare aiohttp"),
        verdict(ratio("picows"), lambda v: v >= 0.60, "stream frames/s ≥ 0.60 × bare picows"),
        verdict(added, lambda v: v <= 1.0, "p99 send → first chunk, ms added to bare aiohttp ≤ 1"),
        verdict(per_conn, lambda v: v <= 14, f"≤ 14 KiB per idle connection (at {largest:,})"),
        verdict(
            held, lambda v: v == 0, "10,000 idle connections held, errors", lambda v: f"{v:.0f}"
        ),
        *idle_max_targets(results, plan),
        *voice_targets(results, plan),
        verdict(
            session_ratio, lambda v: v >= 0.70, "/v1/session stream frames/s ≥ 0.70 × /ws stream"
        ),
        verdict(
            resume_p99,
            lambda v: v <= 50,
            "resume of 1,000 buffered messages, p99 reconnect → last message ≤ 50 ms",
        ),
        *rpc_targets(results, plan),
    ]


def voice_largest(results: Results, plan: Plan, kind: str = "portico") -> float | None:
    """The most callers of a step that held (`voice_holds`); 0 when none did."""
    steps = [results.get((f"voice_step{n}", kind), []) for n in plan.voice_steps]
    if not any(steps):
        return None
    held = [s[0]["callers"] for s in steps if s and voice_holds(s[0], plan)]
    return max(held, default=0.0)


def voice_targets(results: Results, plan: Plan) -> list[str]:
    largest = voice_largest(results, plan)
    if not results.get(("voice", "portico")) and largest is None:
        return []
    portico = median_of(results, "voice", "echo_p99_ms", "portico")
    bare = median_of(results, "voice", "echo_p99_ms", "aiohttp")
    added = None if portico is None or bare is None else portico - bare
    bound = f"{plan.voice_p99_ms:g} ms"
    bare_largest = voice_largest(results, plan, "aiohttp")
    # The bare echo's own ceiling in the same run says what this machine allows: when
    # even it holds fewer than 1,000, the absolute target cannot be judged here, and
    # Portico's ceiling is judged against the bare one's.
    machine = "".join(
        f"; the bare {kind} echo held {value:,.0f}"
        for kind in ("aiohttp", "picows")
        if (value := voice_largest(results, plan, kind)) is not None
    )
    against_bare = "voice callers held, Portico ÷ the bare aiohttp echo (same run, same steps) ≥ 1"
    if largest is not None and bare_largest == 0:
        compared = (
            f"| {against_bare} | n/a: the bare echo held no step (Portico {largest:,.0f}) | — |"
        )
    else:
        share = None if largest is None or bare_largest is None else largest / bare_largest
        compared = verdict(
            share,
            lambda v: v >= 1.0,
            against_bare,
            lambda v: f"{v:.2f} ({largest or 0:,.0f} of {bare_largest or 0:,.0f})",
        )
    return [
        verdict(
            added,
            lambda v: v <= 1.0,
            f"voice relay p99, ms added to bare aiohttp ≤ 1 (at {plan.voice_callers} callers)",
        ),
        verdict(
            largest,
            lambda v: v >= 1000,
            f"voice callers one process holds with echo p99 < {bound} ≥ 1,000{machine}",
            lambda v: f"{v:,.0f}",
        ),
        compared,
    ]


VOICE_COLUMNS = (
    ("echo_p50_ms", "echo p50, ms"),
    ("echo_p99_ms", "echo p99, ms"),
    ("lost", "frames lost"),
    ("errors", "errors"),
    ("server_cpu", "server CPU, % of a core"),
    ("cpu_per_call", "server CPU per call, % of a core"),
    ("cpu_us_per_frame", "server CPU per frame relayed, µs"),
    ("client_cpu", "client CPU, %"),
    ("client_cpu_per_call", "client CPU per call, % of a core"),
    ("other_cpu", "other processes' CPU, %"),
    ("lag_p99_ms", "client send lag p99, ms"),
    ("start_p99_ms", "call start p99 (first frame → `session_config`), ms"),
    ("load_1m", "load average (1 min) at the end"),
)


VOICE_COUNTS = frozenset({"lost", "errors"})


def voice_tables(results: Results, plan: Plan) -> list[str]:
    kinds = [k for k in plan.kinds if results.get(("voice", k))]
    steps = [
        (n, k)
        for n in plan.voice_steps
        for k in VOICE_STEPPED
        if results.get((f"voice_step{n}", k))
    ]
    if not kinds and not steps:
        return []
    lines = [
        "## Voice (/ws calls, issue 15)",
        "",
        "Each caller is a `/ws?binary=true` voice call sending a 20 ms frame of 16 kHz mono "
        "PCM16 (OMNI binary frames, the first naming the format) every 20 ms in real time, "
        "the callers' sends spread evenly over the period (the load generator woken for "
        "them by a timer, not spinning: its CPU is its work). Portico's agent is the scripted "
        "duplex runtime with `echo: true` (bench/voice_echo.yaml): every caller frame comes "
        "back as agent audio; the bare servers send the binary message back as it came. "
        "Echo: client send → the frame's echo back (matched by a sequence number in the "
        f"payload), nearest-rank, over a {plan.voice_seconds:g} s window after "
        f"{plan.voice_warmup:g} s; with several load generators ({plan.voice_per_process} "
        "callers each, each from its own 127.0.0.x), the largest of their percentiles. A "
        "frame not echoed within 1 s of the window's end is lost. Send lag: how late the "
        "client sent, a client that cannot keep up shows here. CPU over the window. Every "
        "call is started (its first frame sent, its `session_config` back) before the "
        "first timed frame: the call start, which opens the call's session in the archive, "
        "is a figure of its own (from a bare server: the first frame's echo).",
        "",
    ]
    if kinds:
        lines += [
            f"Relay at {plan.voice_callers} callers, servers interleaved, {plan.repeat} repeat(s):",
            "",
            "| Figure | " + " | ".join(kinds) + " | Portico − aiohttp |",
            "|---|" + "---:|" * (len(kinds) + 1),
        ]
        for key, label in VOICE_COLUMNS:
            show = count_cell if key in VOICE_COUNTS else cell
            cells = [show(stats(results, "voice", key, k)) for k in kinds]
            diff = "—"
            a = median_of(results, "voice", key, "portico")
            b = median_of(results, "voice", key, "aiohttp")
            if key.endswith("_ms") and a is not None and b is not None:
                diff = f"{a - b:+.2f} ms"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {diff} |")
        lines.append("")
    if steps:
        lines += [
            "Portico and the bare echoes, callers stepped up (the servers alternately at "
            f"each step), each until its echo p99 reaches {plan.voice_p99_ms:g} ms, a frame in "
            "a thousand is lost or an error comes. The bare picows echo is the machine's "
            "floor: where it fails, the load generators (their CPU beside it; they share "
            "the machine's cores with the server) or the machine are the limit, not the "
            "server's code:",
            "",
            "| Callers | server | frames/s sent | "
            + " | ".join(label for _, label in VOICE_COLUMNS)
            + " | held |",
            "|---:|---|---:|" + "---:|" * len(VOICE_COLUMNS) + "---|",
        ]
        for n, kind in steps:
            sample = results[(f"voice_step{n}", kind)][0]
            cells = [
                f"{sample[key]:,.0f}" if key in VOICE_COUNTS else fmt(sample[key])
                for key, _ in VOICE_COLUMNS
            ]
            held = "yes" if voice_holds(sample, plan) else "**no**"
            lines.append(
                f"| {n:,} | {kind} | {fmt(sample['frames_per_s'])} | "
                + " | ".join(cells)
                + f" | {held} |"
            )
        held = [
            f"{'Portico' if kind == 'portico' else f'the bare {kind} echo'} {value:,.0f}"
            for kind in VOICE_STEPPED
            if (value := voice_largest(results, plan, kind)) is not None
        ]
        lines += ["", f"Largest step held (callers): {', '.join(held)}."]
        per_frame = median_of(results, "voice", "cpu_us_per_frame", "portico")
        if per_frame:
            # A call relays 50 frames a second each way; the CPU per frame says how many
            # calls a core would carry if it had nothing else to do.
            lines.append(
                f"From Portico's CPU per relayed frame at {plan.voice_callers} callers "
                f"({per_frame:.0f} µs), one core carries about "
                f"{1e6 / (per_frame / VOICE_FRAME_S):,.0f} calls."
            )
        lines.append("")
    return lines


def idle_max_targets(results: Results, plan: Plan) -> list[str]:
    samples = results.get(("idle_max", "portico"), [])
    if not samples:
        return []
    sample = samples[0]
    count = int(sample["count"])
    capped = (
        f" (measured at {count:,}: the server's RLIMIT_NOFILE hard limit is "
        f"{sample['fd_limit']:,.0f})"
        if count < plan.idle_max
        else ""
    )
    held = sample["held"] if count >= plan.idle_max else None
    return [
        verdict(
            held,
            lambda v: v >= plan.idle_max and sample["errors"] == 0,
            f"{plan.idle_max:,} idle connections held by one process, held{capped}",
            lambda v: f"{v:,.0f}",
        )
        if held is not None
        else f"| {plan.idle_max:,} idle connections held by one process{capped} | "
        f"{sample['held']:,.0f} held, {sample['errors']:,.0f} errors | **not measurable here** |",
        verdict(
            sample["kib_per_conn"],
            lambda v: v <= 14,
            f"≤ 14 KiB per idle connection (at {count:,}, one Portico)",
        ),
    ]


def rpc_targets(results: Results, plan: Plan) -> list[str]:
    """The /v1/rpc rows of the Targets table."""
    rate = rpc_rate(plan)
    rpc_p99 = median_of(results, f"rpc_latency{rate:g}", "first_p99_ms", "portico")
    ws_p99 = median_of(results, f"rpc_ws_latency{rate:g}", "first_p99_ms", "portico")
    added = None if rpc_p99 is None or ws_p99 is None else rpc_p99 - ws_p99
    page_p99 = median_of(results, "rpc_pages", "page_p99_ms", "portico")
    messages = median_of(results, "rpc_pages", "messages", "portico")
    page_target = f"50-message page of a {PAGE_TARGET_MESSAGES:,}-message session p99 ≤ 10 ms"
    if messages is not None and messages < PAGE_TARGET_MESSAGES:
        page_target += f" (this run: {messages:,.0f} messages)"
    return [
        verdict(
            added,
            lambda v: v <= 2.0,
            f"rpc send → first live chunk p99 ≤ /ws first chunk p99 + 2 ms (at {rate:g} msg/s)",
            lambda v: f"{v:+.2f} ms",
        ),
        verdict(page_p99, lambda v: v <= 10.0, page_target),
    ]


def rpc_tables(results: Results, plan: Plan) -> list[str]:
    """/v1/rpc latency beside /ws on the same server, and message pages; empty if not run."""
    rate = rpc_rate(plan)
    rpc_key, ws_key = f"rpc_latency{rate:g}", f"rpc_ws_latency{rate:g}"
    lines: list[str] = []
    if (rpc_key, "portico") in results:
        lines += [
            f"Latency at {rate:g} msg/s over {plan.pool} connections, scenario `stream50`, "
            f"{rpc_repeats(plan)} repeat(s), "
            "open loop as in the latency rows above, on a Portico of its own: the same "
            "settings plus `PORTICO_AUTH=apikey` with one API key (one user) per connection, "
            "sent in `connect` (/v1/rpc) or as a bearer token (/ws). With authentication "
            "off every connection is the one user `local`, and a user's updates and live "
            "chunks go to all of its connections: each of the pool's connections would get "
            "every turn of the pool. Each connection's first send makes its session (during "
            "the warm-up); later sends name it (`server_session_id`). In each repeat /ws "
            "and /v1/rpc run back to back on that server (the order alternates). The "
            "/v1/rpc stages: `v1.message.send` → its reply (the user message stored), → "
            "the turn's `running` update, → the first `live` frame (after the assistant "
            "message's `created` update), → the update that ends the turn.",
            "",
            "| Figure | /v1/rpc | /ws, same server | /v1/rpc − /ws "
            "| /ws, main Portico (latency rows above) |",
            "|---|---:|---:|---:|---:|",
        ]
        main_key = f"latency{rate:g}"
        figures: list[tuple[str, str]] = [("achieved_rate", "msg/s achieved")]
        figures += [(f"reply_{q}_ms", f"send → reply {q}, ms") for q in ("p50", "p99")]
        figures += [(f"running_{q}_ms", f"send → turn running {q}, ms") for q in ("p50", "p99")]
        for stage, what in (("first", "send → first chunk"), ("done", "send → turn end")):
            figures += [(f"{stage}_{q}_ms", f"{what} {q}, ms") for q in ("p50", "p99", "p999")]
        figures += [("samples", "turns timed"), ("missed", "sends skipped (pool busy)")]
        figures += [("errors", "errors"), ("server_cpu", "server CPU over the window, % of a core")]
        figures += [("other_cpu", "other processes' CPU over the window, % of a core")]
        for figure, label in figures:
            rpc = stats(results, rpc_key, figure, "portico")
            ws = stats(results, ws_key, figure, "portico")
            main = stats(results, main_key, figure, "portico")
            diff = "—"
            if figure.endswith("_ms") and rpc is not None and ws is not None:
                diff = f"{rpc[0] - ws[0]:+.2f} ms"
            show = count_cell if figure in ("samples", "missed", "errors") else cell
            lines.append(f"| {label} | {show(rpc)} | {show(ws)} | {diff} | {show(main)} |")
        lines.append("")
    if ("rpc_pages", "portico") in results:

        def med(figure: str) -> float:
            value = median_of(results, "rpc_pages", figure, "portico")
            return math.nan if value is None else value

        lines += [
            "Pages: one session filled through `v1.message.send` on one connection (scenario "
            f"`{FILL_SCENARIO}`, a one-chunk reply): the first send makes the session, then "
            f"up to {FILL_WINDOW} sends stay in flight; sends that arrive while a turn runs "
            "wait and merge into one turn (each stores its user message; each turn that runs "
            "adds one assistant reply), and the fill ends with single sends once every turn "
            f"has ended. Then `v1.message.list` with `limit` {PAGE_SIZE} at uniformly random "
            f"cursors (`global_offset` 0 … messages − {PAGE_SIZE}, a fixed seed), one request "
            f"at a time on that connection, after {plan.rpc_page_warm} unmeasured ones; time "
            f"from the request's send to its reply; every page is checked ({PAGE_SIZE} items, "
            "from the cursor on). Once per run, after the latency repeats, on the same server.",
            "",
            "| Session | Filled by | fill time, s | pages timed | page p50 / p99 / p999, ms "
            "| errors |",
            "|---|---|---:|---:|---:|---:|",
            f"| {med('messages'):,.0f} messages | {med('sends'):,.0f} sends, "
            f"{med('replies'):,.0f} replies | {fmt(med('fill_s'))} | {med('samples'):,.0f} "
            f"| {fmt(med('page_p50_ms'))} / {fmt(med('page_p99_ms'))} / "
            f"{fmt(med('page_p999_ms'))} | {med('errors'):.0f} |",
            "",
        ]
    return lines


def session_tables(results: Results, plan: Plan) -> list[str]:
    """/v1/session beside /ws on Portico, and resume latency; empty if neither ran."""
    lines: list[str] = []
    if ("session_stream1", "portico") in results:
        lines += [
            f"Stream, {plan.clients} clients, 1 client process, both on Portico in the same "
            "run (each repeat measures one right after the other).",
            "",
            "| Figure | /v1/session | /ws | /v1/session ÷ /ws |",
            "|---|---:|---:|---:|",
        ]
        figures = (
            ("frames_per_s", "frames/s"),
            ("turns_per_s", "turns/s"),
            ("server_cpu", "server CPU, % of a core"),
            ("client_cpu", "client CPU, % of a core"),
            ("other_cpu", "other processes' CPU, % of a core"),
        )
        for figure, label in figures:
            session = stats(results, "session_stream1", figure, "portico")
            ws = stats(results, "stream1", figure, "portico")
            ratio = ratio_cell(session, ws, "") if figure.endswith("_per_s") else "—"
            pairs = zip(
                results[("session_stream1", "portico")],
                results[("stream1", "portico")],
                strict=False,
            )
            each = [a[figure] / b[figure] for a, b in pairs if b[figure]]
            if ratio != "—" and len(each) > 1:
                # Repeat by repeat (each pair measured back to back): how steady the ratio is.
                ratio += f" ({fmt(min(each))}–{fmt(max(each))} per repeat)"
            lines.append(f"| {label} | {cell(session)} | {cell(ws)} | {ratio} |")
        acks = stats(results, "session_stream1", "acks_per_turn", "portico")
        lines += [f"| client acks per turn | {cell(acks)} | — | — |", ""]
    resumes = [(b, n) for b, n in plan.resume if (f"resume{b}", "portico") in results]
    if resumes:
        lines += [
            "Resume: open a session, send a message whose reply is N numbered messages "
            "(scenario `long<N>`), drop the connection at once (nothing read or acknowledged), "
            "wait until the server ends the turn, then reconnect and `hello` with the "
            "session id and `last_seq` 0. Times from the start of the reconnect (TCP "
            f"connect, upgrade, `hello`); one session at a time, {plan.resume_warm} "
            "unmeasured resume(s) first; percentiles are nearest-rank over one run's resumes "
            "(with fewer than 100, p99 is the slowest).",
            "",
            "| Buffered messages | Resumes timed | reconnect → `ready` p50 / p99, ms "
            "| reconnect → last backlog message (`done`) p50 / p99, ms "
            "| per buffered message at p50, µs | errors |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for backlog, _ in resumes:
            key = f"resume{backlog}"

            def med(figure: str, key: str = key) -> float:
                value = median_of(results, key, figure, "portico")
                return math.nan if value is None else value

            per_message = 1000 * med("done_p50_ms") / backlog
            lines.append(
                f"| {backlog:,} | {med('samples'):.0f} "
                f"| {fmt(med('ready_p50_ms'))} / {fmt(med('ready_p99_ms'))} "
                f"| {fmt(med('done_p50_ms'))} / {fmt(med('done_p99_ms'))} "
                f"| {fmt(per_message)} | {med('errors'):.0f} |"
            )
        fixed = sum(med("fixed_wait", f"resume{b}") for b, _ in resumes)
        if fixed:
            lines += [
                "",
                f"**{fixed:.0f} resume(s) waited a fixed time for the turn's end**: the "
                "server exported no `portico_turns_total`, so those may include turn time.",
            ]
        lines.append("")
    return lines


def versions() -> str:
    names = ("portico", "aiohttp", "uvloop", "msgspec", "picows", "py-spy")
    found = []
    for name in names:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def source_state() -> str:
    """The commit measured, and whether src/ had uncommitted changes."""

    def git(*args: str) -> str:
        command = ["git", "-C", str(BENCH.parent), *args]
        return subprocess.run(command, capture_output=True, text=True, check=False).stdout

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    dirty = git("status", "--porcelain", "--", "src").strip()
    return f"commit {head}" + (" with uncommitted changes in src/" if dirty else "")


def python_call_ns() -> float:
    """What one Python function call costs on this host, best of 5 (timeit): hosts with
    the same CPU name differ by 3x in it, and Portico's figures against the bare servers
    (mostly C) move with it, so each report says it."""

    def noop() -> None:
        return None

    best = min(timeit.repeat(noop, number=200_000, repeat=5))
    return best / 200_000 * 1e9


def machine() -> list[str]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return [
        f"- CPU: {cpu}, {os.cpu_count()} cores; memory {int(mem) / 1024**2:.1f} GiB; "
        f"Linux {platform.release()}; RLIMIT_NOFILE {nofile}; a Python function call "
        f"{python_call_ns():.0f} ns",
        f"- Python {platform.python_version()}; {versions()}; Portico at {source_state()}",
    ]


def report(results: Results, plan: Plan, started: float, elapsed: float, background: float) -> str:
    env = ", ".join(f"`{k}={v}`" for k, v in PORTICO_BENCH_ENV.items())
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started))
    clients = "picows" if picows_available() else "aiohttp (picows not installed)"
    lines = [
        "# Portico benchmark",
        "",
        f"Run {when}, {elapsed:.0f} s, `python bench/run.py {' '.join(sys.argv[1:])}`.".replace(
            "`python bench/run.py `", "`python bench/run.py`"
        ),
        f"Each figure: median (min–max) of {plan.repeat} repeat(s); ratios divide medians.",
        "",
        *machine(),
        f"- Other processes used {background:.0f}% of a core in the second before the run "
        "(the machine is shared; see the last table for each stream window)."
        + (BUSY_WARNING if background > BUSY_THRESHOLD else ""),
        f"- Portico: `python -m portico serve --runtime scripted --script bench/script.yaml "
        f"--store {BENCH_STORE[0]}`, log level {plan.log_level or 'INFO (default)'}, "
        f"with {env} so its "
        "per-connection rate limit (50 msg/s) and 10,000-connection cap do not shape the figures.",
        f"- Load generator: bench/loadgen.py on uvloop, {clients} client; every server and "
        "client in its own process, on 127.0.0.1.",
        f"- stream: {plan.clients} clients, each sends a `message` (scenario `stream50`: 50 "
        f"`chunk` frames and a `done`) and sends the next when `done` arrives; {plan.warmup:g} s "
        f"warm-up, {plan.seconds:g} s window. latency: open loop at each rate, `stream50`, a "
        "message only on a connection whose last turn ended (else the send is skipped and "
        f"counted), {plan.latency_seconds:g} s after {plan.latency_warmup:g} s warm-up; "
        "percentiles are nearest-rank. idle: server VmRSS growth "
        f"over its RSS after {IDLE_WARMUP} connections opened and closed.",
        "- session stream: the stream workload on `/v1/session`: `hello` once per client, "
        "then numbered `message`s; the client acknowledges every 16 server messages, within "
        "100 ms of the first unacknowledged one, and at each `done`, and counts `chunk` and "
        "`done` frames as /ws stream does. session resume: on a Portico of its own with "
        + ", ".join(f"`{k}={v}`" for k, v in PORTICO_RESUME_ENV.items())
        + " (a resend buffer for the largest backlog); it waits for a turn's end by polling "
        'the server\'s `portico_turns_total{state="completed"}` (/metrics, every 10 ms, '
        "bounded).",
        "",
        "## Results",
        "",
        *results_table(results, plan),
        "",
        "## Resumable sessions (/v1/session, Portico only)",
        "",
        *session_tables(results, plan),
        "## RPC (/v1/rpc, Portico only)",
        "",
        *(rpc_tables(results, plan) or ["Not run.", ""]),
        *voice_tables(results, plan),
        "## Targets",
        "",
        *targets_table(results, plan),
        "",
        "## Is the client the bottleneck?",
        "",
        "Stream workload; CPU is % of one core over the window (2 cores in all). "
        '"Other processes" is everything else on the machine in that window: '
        "a high figure means the run was disturbed.",
        "",
        *diagnostics_table(results, plan),
        "",
    ]
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------


def parse_plan(argv: Sequence[str] | None) -> tuple[Plan, Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="shorter windows and fewer resumes; about a minute"
    )
    parser.add_argument("--repeat", type=int, help="measurements per figure (default 3)")
    parser.add_argument("--clients", type=int, help="stream: concurrent clients (default 100)")
    parser.add_argument("--seconds", type=float, help="stream and latency window, seconds")
    parser.add_argument("--warmup", type=float, help="seconds before each window")
    parser.add_argument("--rates", help="latency: messages/s, comma-separated (default 200,50)")
    parser.add_argument("--idle", help="idle: connection counts, comma-separated; 0 skips")
    parser.add_argument(
        "--resume",
        help="session_resume: BACKLOG:RESUMES pairs, comma-separated (default "
        "1000:200,10000:20); each BACKLOG needs a long<BACKLOG> scenario; 0 skips",
    )
    parser.add_argument(
        "--rpc-messages",
        type=int,
        help="rpc_pages: messages in the paged session (default 10000; --quick 2000); 0 skips",
    )
    parser.add_argument(
        "--rpc-pages", type=int, help="rpc_pages: pages timed (default 1000; --quick 200)"
    )
    parser.add_argument(
        "--rpc-repeat", type=int, help="/v1/rpc latency repeats (default: --repeat; --quick 1)"
    )
    parser.add_argument("--no-rpc", action="store_true", help="skip /v1/rpc altogether")
    parser.add_argument(
        "--only",
        help="phases to run, comma-separated, of stream (with latency), rpc, resume, idle, "
        "idle_max, voice, session (default: all); e.g. `--only idle --kinds portico,aiohttp` "
        "for an idle A/B; `rpc` alone skips the message pages unless --rpc-messages is given; "
        "`session` is Portico's /ws and /v1/session stream alone, 1 client process",
    )
    parser.add_argument(
        "--idle-max", type=int, help="idle connections on one Portico, once (default 50000)"
    )
    parser.add_argument(
        "--voice",
        help="voice: CALLERS[:STEP,STEP...], the callers on every server beside the bare "
        "echo, then the steps of Portico and the bare echoes (default "
        "100:100,250,500,750,1000,1500,2000); 0 skips",
    )
    parser.add_argument("--voice-seconds", type=float, help="voice: window, seconds")
    parser.add_argument("--kinds", help="servers, comma-separated (default portico,aiohttp,picows)")
    parser.add_argument("--log-level", help="Portico's log level (default: its own, INFO)")
    parser.add_argument("--portico-env", action="append", default=[], help=PORTICO_ENV_HELP)
    parser.add_argument(
        "--store",
        choices=["sqlite", "memory"],
        default="sqlite",
        help="the archive of every Portico this run starts (default sqlite); e.g. memory "
        "for an A/B of what the archive costs",
    )
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "latest.md")
    args = parser.parse_args(argv)
    add_portico_env(args.portico_env)
    set_store(args.store)
    plan = QUICK if args.quick else Plan()
    if args.seconds is not None:
        plan = replace(plan, seconds=args.seconds, latency_seconds=args.seconds)
    if args.warmup is not None:
        plan = replace(plan, warmup=args.warmup, latency_warmup=args.warmup)
    if args.idle is not None:
        counts = tuple(int(n) for n in args.idle.split(",") if int(n) > 0)
        plan = replace(plan, idle_counts=counts)
    overrides = {"repeat": args.repeat, "clients": args.clients}
    overrides["log_level"] = args.log_level
    overrides["idle_max"] = args.idle_max
    overrides["rpc_messages"] = args.rpc_messages
    overrides["rpc_pages"] = args.rpc_pages
    overrides["rpc_repeat"] = args.rpc_repeat
    if args.no_rpc:
        overrides["rpc"] = False
    if args.voice is not None:
        callers, _, steps = args.voice.partition(":")
        plan = replace(plan, voice_callers=int(callers))
        if steps or not int(callers):
            chosen = tuple(int(n) for n in steps.split(",") if n and int(n) > 0)
            plan = replace(plan, voice_steps=chosen)
    if args.voice_seconds is not None:
        plan = replace(plan, voice_seconds=args.voice_seconds)
    if args.kinds is not None:
        plan = replace(plan, kinds=tuple(k for k in args.kinds.split(",") if k in SERVER_KINDS))
    if args.resume is not None:
        pairs = [item.split(":") for item in args.resume.split(",") if item not in ("", "0")]
        resume = tuple((int(backlog), int(count)) for backlog, count in pairs)
        plan = replace(plan, resume=resume)
    if args.rates is not None:
        plan = replace(plan, rates=tuple(float(r) for r in args.rates.split(",") if r))
    plan = replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    if args.repeat is not None and args.rpc_repeat is None:
        plan = replace(plan, rpc_repeat=None)  # an explicit --repeat applies to /v1/rpc too
    if not picows_available():
        plan = replace(plan, kinds=tuple(k for k in plan.kinds if k != "picows"))
    if args.only is not None:
        plan = only_phases(plan, args.only, rpc_pages=args.rpc_messages is not None)
    return plan, args.out


def only_phases(plan: Plan, only: str, *, rpc_pages: bool) -> Plan:
    """The plan cut down to the phases `--only` names (for A/B runs); the other
    sections' rows stay empty."""
    phases = tuple(p for p in only.split(",") if p)
    plan = replace(plan, phases=phases)
    if "stream" not in phases and "rpc" in phases and not rpc_pages:
        # The RPC latency beside /ws alone (`rates[0]` stays the RPC rate).
        plan = replace(plan, rpc_messages=0)
    if "session" in phases:
        # Portico's /ws and /v1/session streams back to back, one client process.
        plan = replace(
            plan,
            phases=(*phases, "stream"),
            kinds=("portico",),
            client_procs=(1,),
            rates=(),
            rpc=False,
        )
    return plan


def background_cpu(seconds: float = 1.0) -> float:
    """% of one core the machine's other processes use, sampled before the run."""
    before = CpuSnapshot.take(os.getpid(), [])
    time.sleep(seconds)
    return cpu_percentages(before, CpuSnapshot.take(os.getpid(), []))["other_cpu"]


def main(argv: Sequence[str] | None = None) -> int:
    plan, out = parse_plan(argv)
    raise_fd_limit()  # inherited by every server and load generator started below
    started, clock = time.time(), time.monotonic()
    background = background_cpu()
    with tempfile.TemporaryDirectory(prefix="portico-bench-") as workdir:
        results = run(plan, Path(workdir))
    text = report(results, plan, started, time.monotonic() - clock, background)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    log(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
