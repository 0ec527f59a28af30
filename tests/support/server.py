"""Start a real `portico serve` process on a free port and talk to it."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SCRIPT = FIXTURES / "script.yaml"
READY_LINE = re.compile(r"Portico serving http://(?P<host>[^:/]+):(?P<port>\d+)/")
START_TIMEOUT = 20.0


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the test process dies, so none is orphaned."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


PR_SET_PDEATHSIG = 1


class ServerProcess:
    """`portico serve` as a child process; `start` returns once it accepts connections."""

    def __init__(
        self,
        data_dir: Path,
        *,
        args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        port: int = 0,
    ) -> None:
        self.data_dir = data_dir
        self.args = args
        self.env = dict(env or {})
        self.port = port
        self.process: subprocess.Popen[str] | None = None
        self.log_path = data_dir / "server.log"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def archive_path(self) -> Path:
        return self.data_dir / "archive.sqlite3"

    def start(self) -> ServerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {key: value for key, value in os.environ.items() if not key.startswith("PORTICO_")}
        env.update(self.env)
        command = [
            sys.executable,
            "-m",
            "portico",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            *self.args,
        ]
        with self.log_path.open("a") as log:  # the child keeps its own copy of the fd
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.port = _await_ready_port(self.process.stdout, self.process, self.log_path)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> int:
        process, self.process = self.process, None
        return stop_child(process, sig)

    def restart(self) -> ServerProcess:
        """Stop and start again on the same port and data dir."""
        self.stop()
        return self.start()

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


def stop_child(process: subprocess.Popen[str] | None, sig: int = signal.SIGTERM) -> int:
    """Signal a child, wait for its exit status (killed past a deadline)."""
    if process is None:
        return 0
    if process.poll() is None:
        process.send_signal(sig)
    try:
        return process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()
    finally:
        if process.stdout is not None:
            process.stdout.close()


def _await_ready_port(
    stdout: IO[str] | None,
    process: subprocess.Popen[str],
    log_path: Path,
    ready_line: re.Pattern[str] = READY_LINE,
) -> int:
    assert stdout is not None
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        line = stdout.readline()
        if not line:
            if process.poll() is not None:
                raise RuntimeError(f"portico exited {process.returncode}:\n{log_path.read_text()}")
            continue
        match = ready_line.search(line)
        if match:
            return int(match.group("port"))
    process.kill()
    raise RuntimeError(f"portico did not start in {START_TIMEOUT}s:\n{log_path.read_text()}")


def run_cli(
    *args: str, env: Mapping[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`portico ARGS` to its end, in an environment of `env` alone (plus the module path
    the tests import portico from, so the command runs the same code). `prefix` runs it
    under another command (`setpriv ...`)."""
    inherited = {key: os.environ[key] for key in ("PYTHONPATH",) if key in os.environ}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "portico", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", **inherited, **(env or {})},
        check=False,
    )
