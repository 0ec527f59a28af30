"""Profile Portico's `stream` path with py-spy while bench/loadgen.py drives it.

    python bench/profile_stream.py [--seconds 8] [--clients 100] [--store sqlite] [--out FILE]
    python bench/profile_stream.py --workload session_stream   # the same on /v1/session
    python bench/profile_stream.py --workload voice --clients 250  # voice calls on /ws

Starts Portico as bench/run.py does, runs the `stream` workload against it, samples the
server with `py-spy record` (pip install py-spy; needs ptrace rights, e.g. root) and prints
markdown tables: samples per thread, the event loop thread's top functions by own and by
cumulative time, and its time by area (aiohttp writes, the engine, the archive, ...).
`voice`: `--clients` real-time callers (bench/run.py's voice workload: Portico's scripted
duplex echo, bench/voice_echo.yaml), sampled once every call has started and warmed up.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import harness
import stores
from common import raise_fd_limit
from harness import (
    BENCH,
    SERVER_KINDS,
    CpuSnapshot,
    Loadgen,
    Server,
    cpu_percentages,
    voice_config,
)

MAIN_THREAD = "MainThread"
CONNECT_BOUND = 120.0  # seconds for the voice callers to connect and start their calls
# The area a function belongs to, by the first pattern its "function (file)" matches.
AREAS: tuple[tuple[str, str], ...] = (
    ("asyncio/runners.py", "event loop internals (uvloop C code under Runner.run)"),
    ("aiohttp/_websocket/writer.py", "socket writes (aiohttp writer, transport.write)"),
    ("aiohttp/", "aiohttp other (reads, handshakes)"),
    ("portico/store/", "archive (the store)"),
    ("portico/core/turns.py", "turn runner"),
    ("portico/core/engine.py", "engine"),
    ("portico/runtime/duplex/", "duplex runtime (scripted echo)"),
    ("portico/runtime/", "scripted runtime"),
    ("portico/calls/", "calls (LiveCall, CallService)"),
    ("portico/protocols/omnia/binary.py", "OMNI binary codec"),
    ("portico/protocols/omnia/voice.py", "Omnia voice core"),
    ("portico/server/duplex.py", "/ws duplex adapter"),
    ("portico/server/sockets.py", "socket loops (sockets.py)"),
    ("portico/protocols/session/", "session core (frames, channel, acks)"),
    ("portico/protocols/", "Omnia core (frames, encode, queue)"),
    ("portico/server/websocket.py", "/ws adapter (read and write loops)"),
    ("portico/server/session_ws.py", "/v1/session adapter"),
    ("prometheus_client/", "Prometheus metrics"),
    ("logging/", "logging"),
    ("asyncio/", "asyncio machinery (Event, sleep, futures)"),
    ("concurrent/futures/", "executor hand-off"),
    ("msgspec", "msgspec"),
)
OTHER_AREA = "other (the loop itself, C code)"
LINE_NUMBER = re.compile(r":\d+\)$")


@dataclass
class Profile:
    """Collapsed py-spy stacks, aggregated by function (line numbers dropped)."""

    samples: Counter[str] = field(default_factory=Counter)  # per thread
    own: dict[str, Counter[str]] = field(default_factory=dict)
    cumulative: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, thread: str, frames: Sequence[str], count: int) -> None:
        self.samples[thread] += count
        self.own.setdefault(thread, Counter())[frames[-1]] += count
        cumulative = self.cumulative.setdefault(thread, Counter())
        for frame in set(frames):  # a recursive function counts once per sample
            cumulative[frame] += count


def parse_collapsed(lines: Iterable[str]) -> Profile:
    """Read `py-spy record --format raw --threads` output: `thread (tid): name;f;f;f N`."""
    profile = Profile()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        thread, *frames = stack.split(";")
        name = thread.split(": ", 1)[-1]
        if frames:
            profile.add(name, [LINE_NUMBER.sub(")", f) for f in frames], int(count))
    return profile


def area_of(function: str) -> str:
    return next((area for pattern, area in AREAS if pattern in function), OTHER_AREA)


def top_table(counts: Counter[str], total: int, top: int, heading: str) -> list[str]:
    lines = [f"| {heading} | % of thread samples |", "|---|---:|"]
    for function, count in counts.most_common(top):
        lines.append(f"| `{function}` | {100 * count / total:.1f} |")
    return lines


def below_roots(cumulative: Counter[str], total: int) -> Counter[str]:
    """Drop the frames every sample passes through (runpy, main, the loop's run)."""
    return Counter({f: n for f, n in cumulative.items() if n < total})


def area_table(own: Counter[str], total: int) -> list[str]:
    areas: Counter[str] = Counter()
    for function, count in own.items():
        areas[area_of(function)] += count
    lines = ["| Area (own time) | % of thread samples |", "|---|---:|"]
    lines += [f"| {area} | {100 * n / total:.1f} |" for area, n in areas.most_common()]
    return lines


def thread_tables(profile: Profile, thread: str, top: int) -> list[str]:
    total = profile.samples[thread]
    return [
        f"### Thread `{thread}` ({total} samples)",
        "",
        *area_table(profile.own[thread], total),
        "",
        *top_table(profile.own[thread], total, top, "Function (own time)"),
        "",
        *top_table(
            below_roots(profile.cumulative[thread], total), total, top, "Function (cumulative)"
        ),
        "",
    ]


def render(profile: Profile, header: Sequence[str], top: int) -> str:
    lines = [*header, "", "| Thread | samples |", "|---|---:|"]
    lines += [f"| {name} | {count} |" for name, count in profile.samples.most_common()]
    lines.append("")
    main = [t for t in profile.samples if t == MAIN_THREAD]
    others = [t for t, _ in profile.samples.most_common() if t != MAIN_THREAD][:1]
    for thread in main + others:
        lines += thread_tables(profile, thread, top)
    return "\n".join(lines)


# -- running it ----------------------------------------------------------------------------


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: pip install py-spy (or '.[bench]')")
    return found


def record(pid: int, seconds: float, rate: int, raw: Path) -> None:
    command = [py_spy(), "record", "--pid", str(pid), "--duration", str(int(seconds))]
    command += ["--rate", str(rate), "--format", "raw", "--threads", "--output", str(raw)]
    subprocess.run(command, check=True, capture_output=True, timeout=seconds + 60)


def profile_stream(args: argparse.Namespace, workdir: Path) -> tuple[Profile, list[str]]:
    env = {}
    if args.store == "postgres":
        schema = f"profile_{uuid.uuid4().hex[:12]}"
        asyncio.run(stores.execute(args.database_url, f"CREATE SCHEMA {schema}"))
        env["PORTICO_DATABASE_URL"] = stores.with_search_path(args.database_url, schema)
    config = None
    if args.workload == "voice" and args.server == "portico":
        config = voice_config(workdir)
    server = Server(args.server, workdir, store=args.store, env=env, config=config).start()
    try:
        window = ["--warmup", "1", "--seconds", str(args.seconds + 2)]
        url = server.session_url if args.workload == "session_stream" else server.url
        if args.workload == "voice":
            url += "?binary=true"
        gen = Loadgen(args.workload, url, ["--clients", str(args.clients), *window])
        try:
            if args.workload == "voice":
                gen.next_event(CONNECT_BOUND)  # every call started (`ready`)
                gen.tell()  # the callers start sending
            time.sleep(1.5)  # connected and warmed up before sampling starts
            before = CpuSnapshot.take(server.pid, [gen.pid])
            raw = workdir / "py-spy.txt"
            record(server.pid, args.seconds, args.rate, raw)
            cpu = cpu_percentages(before, CpuSnapshot.take(server.pid, [gen.pid]))
            result = gen.result(args.seconds + 60)
        finally:
            gen.stop()
        if args.raw:
            shutil.copy(raw, args.raw)
        profile = parse_collapsed(raw.read_text().splitlines())
    finally:
        server.stop()
        if args.store == "postgres":
            asyncio.run(stores.execute(args.database_url, f"DROP SCHEMA {schema} CASCADE"))
    if args.workload == "voice":
        throughput = (
            f"{result['sent'] / args.seconds:,.0f} caller frames/s sent in the window, echo "
            f"p50 {result['echo_p50_ms']:.2f} ms p99 {result['echo_p99_ms']:.2f} ms"
        )
    else:
        throughput = f"{result['frames_per_s']:,.0f} frames/s, {result['turns_per_s']:,.0f} turns/s"
    header = [
        f"# `{args.workload}` profile of {args.server} (py-spy)",
        "",
        f"`python bench/profile_stream.py {' '.join(sys.argv[1:])}`: {args.clients} clients, "
        f"{'voice calls' if args.workload == 'voice' else 'scenario `stream50`'}, store "
        f"{args.store}, py-spy at {args.rate} Hz for {args.seconds:g} s "
        "(blocking mode; only samples of running threads).",
        f"Throughput while sampled: {throughput}; server CPU {cpu['server_cpu']:.0f}% of a core "
        f"(all threads), client {cpu['client_cpu']:.0f}%, other processes {cpu['other_cpu']:.0f}%.",
    ]
    return profile, header


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="sampling time")
    parser.add_argument("--rate", type=int, default=100, help="samples per second")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--store", choices=["sqlite", "memory", "postgres"], default="sqlite")
    parser.add_argument(
        "--database-url", default=stores.DATABASE_URL, help="--store postgres: a fresh schema here"
    )
    parser.add_argument(
        "--server", choices=SERVER_KINDS, default="portico", help="or a bare one, to compare"
    )
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    parser.add_argument(
        "--workload",
        choices=["stream", "session_stream", "voice"],
        default="stream",
        help="session_stream: the same load on Portico's /v1/session; voice: voice calls",
    )
    parser.add_argument("--raw", type=Path, help="also keep py-spy's collapsed stacks here")
    parser.add_argument("--portico-env", action="append", default=[], help=harness.PORTICO_ENV_HELP)
    parser.add_argument("--out", type=Path, default=BENCH / "results" / "profile.md")
    args = parser.parse_args(argv)
    harness.add_portico_env(args.portico_env)
    if args.workload == "session_stream" and args.server != "portico":
        parser.error("only Portico serves /v1/session")
    raise_fd_limit()
    with tempfile.TemporaryDirectory(prefix="portico-profile-") as workdir:
        profile, header = profile_stream(args, Path(workdir))
    text = render(profile, header, args.top)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
