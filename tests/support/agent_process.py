"""Start a real `portico agent serve` process on a free port."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.server import _die_with_parent

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
READY_LINE = re.compile(r"Portico agent serving grpc://(?P<host>[^:/]+):(?P<port>\d+)")
START_TIMEOUT = 20.0


def agent_env() -> dict[str, str]:
    """The environment a child needs to import the test agents and the examples."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PORTICO_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")])
    return env


class AgentProcess:
    """`portico agent serve HANDLER` as a child; `start` returns once it listens."""

    def __init__(self, handler: str, log_path: Path, *, args: tuple[str, ...] = ()) -> None:
        self.handler = handler
        self.args = args
        self.log_path = log_path
        self.port = 0
        self.process: subprocess.Popen[str] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> AgentProcess:
        command = [sys.executable, "-m", "portico", "agent", "serve", self.handler]
        command += ["--port", str(self.port), *self.args]
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=agent_env(),
                cwd=REPO,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.port = self._await_ready()
        return self

    def _await_ready(self) -> int:
        process = self.process
        assert process is not None
        assert process.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                if process.poll() is not None:
                    raise RuntimeError(f"agent exited {process.returncode}:\n{self.log_text()}")
                continue
            match = READY_LINE.search(line)
            if match:
                return int(match.group("port"))
        process.kill()
        raise RuntimeError(f"agent did not start in {START_TIMEOUT}s:\n{self.log_text()}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process is None:
            return 0
        process, self.process = self.process, None
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

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""
