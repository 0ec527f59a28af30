"""Child processes the benchmark starts (servers, load generators) and what /proc says of them."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from common import HOST, READY_LINE, RPC_PATH, SESSION_PATH, bench_api_keys

BENCH = Path(__file__).resolve().parent
SCRIPT = BENCH / "script.yaml"
START_TIMEOUT = 30.0  # seconds for a server to print its ready line
STOP_TIMEOUT = 10.0
LOADGEN = BENCH / "loadgen.py"  # what a Loadgen runs (bench/voice_ab.py swaps in an old one)
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Portico's per-connection limits (50 msg/s, burst 100), its 10,000-connection cap and
# its admission limits (100 connections per principal: with authentication off every
# connection is `local`; 256 sockets awaiting connect/hello) would throttle the load
# generator, so the benchmark server lifts them.
PORTICO_BENCH_ENV = {
    "PORTICO_RATE_LIMIT_MESSAGES": "1000000",
    "PORTICO_RATE_LIMIT_BURST": "1000000",
    "PORTICO_MAX_CONNECTIONS": "100000",
    "PORTICO_MAX_CONNECTIONS_PER_PRINCIPAL": "100000",
    "PORTICO_MAX_UNAUTHENTICATED_CONNECTIONS": "50000",
}
SERVER_KINDS = ("portico", "aiohttp", "picows")
PORTICO_ENV_HELP = (
    "a Portico setting for every Portico this run starts, KEY=VALUE (repeatable), e.g. "
    "PORTICO_SQLITE_WRITER=inline for an A/B; the environment's own PORTICO_* never pass"
)


# The archive every Portico the benchmark starts uses, unless a workload names its own
# (`--store`: e.g. `memory` beside the default for what the archive costs, the same run).
BENCH_STORE = ["sqlite"]


def set_store(store: str) -> None:
    """Every Portico server started after this uses `store` (`--store`)."""
    BENCH_STORE[0] = store


def add_portico_env(pairs: Sequence[str]) -> None:
    """Adds `KEY=VALUE` Portico settings (`--portico-env`) to PORTICO_BENCH_ENV: every
    Portico server started after this gets them, and reports print them with the rest."""
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.startswith("PORTICO_"):
            raise SystemExit(f"--portico-env takes PORTICO_NAME=VALUE, not {pair!r}")
        PORTICO_BENCH_ENV[key] = value


# The session_resume server (bench/run.py) also holds whole `longN` replies for clients
# that are away: a resend buffer and a resume window large enough for the biggest backlog.
PORTICO_RESUME_ENV = {
    "PORTICO_RESEND_BUFFER_MESSAGES": "20000",
    "PORTICO_RESEND_BUFFER_BYTES": str(64 * 1024 * 1024),
    "PORTICO_RESUME_WINDOW": "600",
}


# The voice workload's Portico (bench/run.py `voice`, bench/profile_stream.py): the
# default agent takes calls and echoes their audio (bench/voice_echo.yaml).
VOICE_CONFIG = """\
agents:
  default:
    runtime: scripted
    script: {script}
    duplex_runtime: scripted
    duplex_script: {echo}
max_audio_sessions: 100000
realtime_grace_window: 1
"""


def voice_config(workdir: Path) -> Path:
    """Write the voice workload's Portico config in `workdir`; returns its path."""
    config = workdir / "voice.yaml"
    config.write_text(VOICE_CONFIG.format(script=SCRIPT, echo=BENCH / "voice_echo.yaml"))
    return config


def portico_rpc_env(users: int) -> dict[str, str]:
    """The RPC server (bench/run.py): API keys for `users` bench users (bench_token).

    With authentication off every connection is one user, `local`, and each user's updates
    and live chunks go to all of that user's connections: a pool of N connections would get
    N copies of every turn. A user per connection is what a pool of clients looks like.
    """
    return {"PORTICO_AUTH": "apikey", "PORTICO_API_KEYS": bench_api_keys(users)}


def picows_available() -> bool:
    try:
        import picows  # noqa: F401
    except ImportError:
        return False
    return True


# -- /proc ---------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    """Resident memory of a process (VmRSS), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and all its threads so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def system_busy_seconds() -> float:
    """CPU time every process on the machine spent in user and system mode so far."""
    user, nice, system = Path("/proc/stat").read_text().split()[1:4]
    return (int(user) + int(nice) + int(system)) / CLK_TCK


@dataclass(frozen=True)
class CpuSnapshot:
    at: float
    server: float
    clients: float
    system: float

    @staticmethod
    def take(server_pid: int, client_pids: Sequence[int]) -> CpuSnapshot:
        clients = 0.0
        for pid in client_pids:
            try:
                clients += cpu_seconds(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue  # a client that already exited
        server = cpu_seconds(server_pid)
        return CpuSnapshot(time.monotonic(), server, clients, system_busy_seconds())


def cpu_percentages(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """% of one core used over the interval by the server, our clients and everything else."""
    elapsed = after.at - before.at
    server = 100 * (after.server - before.server) / elapsed
    clients = 100 * (after.clients - before.clients) / elapsed
    system = 100 * (after.system - before.system) / elapsed
    other = max(0.0, system - server - clients)
    return {"server_cpu": server, "client_cpu": clients, "other_cpu": other}


# -- processes -----------------------------------------------------------------------------


def read_line(stream: IO[str], deadline: float) -> str | None:
    """One line from a child's pipe, or None at EOF or past the deadline."""
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not select.select([stream], [], [], remaining)[0]:
        return None
    return stream.readline() or None


def stop_process(process: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL after a grace period; only ever our own child, by its pid."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()


class Server:
    """A server under test in its own process: Portico or a bare baseline."""

    def __init__(
        self,
        kind: str,
        workdir: Path,
        log_level: str | None = None,
        store: str | None = None,
        env: dict[str, str] | None = None,
        config: Path | None = None,
    ) -> None:
        self.kind = kind
        self.config = config  # Portico's config file (`--config`), for settings env cannot set
        self.workdir = workdir / f"{kind}-{time.monotonic_ns()}"
        self.log_level = log_level
        self.store = store or BENCH_STORE[0]
        self.extra_env = env or {}  # Portico settings on top of PORTICO_BENCH_ENV
        self.process: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def url(self) -> str:
        return f"ws://{HOST}:{self.port}/ws"

    @property
    def session_url(self) -> str:
        """Portico's resumable-session endpoint (the bare servers have none)."""
        return f"ws://{HOST}:{self.port}{SESSION_PATH}"

    @property
    def rpc_url(self) -> str:
        """Portico's `/v1/rpc` endpoint (the bare servers have none)."""
        return f"ws://{HOST}:{self.port}{RPC_PATH}"

    def command(self) -> list[str]:
        if self.kind != "portico":
            return [sys.executable, str(BENCH / "baseline.py"), self.kind, "--port", "0"]
        command = [sys.executable, "-m", "portico", "serve", "--host", HOST, "--port", "0"]
        command += ["--runtime", "scripted", "--script", str(SCRIPT), "--store", self.store]
        command += ["--data-dir", str(self.workdir / "data")]
        if self.log_level:
            command += ["--log-level", self.log_level]
        if self.config is not None:
            command += ["--config", str(self.config)]
        return command

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PORTICO_")}
        if self.kind == "portico":
            env.update(PORTICO_BENCH_ENV)
            env.update(self.extra_env)
        return env

    def start(self) -> Server:
        self.launch()
        self.port = self.await_ready()
        return self

    def launch(self) -> None:
        """Spawn the process; `await_ready` then waits for its ready line."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with (self.workdir / "server.log").open("w") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=subprocess.PIPE,
                stderr=log,  # a file, never a pipe nobody drains: Portico logs every turn
                text=True,
                env=self.environment(),
                cwd=BENCH.parent,
            )

    def await_ready(self) -> int:
        assert self.process is not None
        assert self.process.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT
        while (line := read_line(self.process.stdout, deadline)) is not None:
            match = READY_LINE.search(line)
            if match:
                self.port = int(match["port"])
                return self.port
        self.stop()
        log = (self.workdir / "server.log").read_text()[-2000:]
        raise RuntimeError(f"{self.kind} server did not start:\n{log}")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None

    def kill(self) -> None:
        """SIGKILL: skips a graceful shutdown that would close thousands of sockets one by one."""
        if self.process is not None:
            self.process.kill()
            self.stop()


def stop_all(servers: Sequence[Server]) -> None:
    """Signal every server first, so their shutdowns overlap, then reap each."""
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
    for server in servers:
        server.stop()


class Loadgen:
    """One load-generator process; its JSON lines arrive on stdout."""

    def __init__(self, workload: str, url: str, args: Sequence[str]) -> None:
        command = [sys.executable, str(LOADGEN), workload, "--url", url, *args]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=BENCH.parent,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def next_event(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = read_line(self.process.stdout, time.monotonic() + timeout)
        if line is None:
            raise RuntimeError(f"load generator sent nothing within {timeout:.0f}s{self._tail()}")
        event: dict[str, Any] = json.loads(line)
        return event

    def tell(self) -> None:
        """Send an `idle` generator on: from `warmed` to opening, or from `ready` to release."""
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()

    def result(self, timeout: float) -> dict[str, Any]:
        event = self.next_event(timeout)
        while event.get("event") != "result":
            event = self.next_event(timeout)
        self.process.wait(STOP_TIMEOUT)
        return event

    def stop(self) -> None:
        stop_process(self.process)

    def _tail(self) -> str:
        if self.process.poll() is None or self.process.stderr is None:
            return ""
        return "\n" + self.process.stderr.read()[-2000:]
