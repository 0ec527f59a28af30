"""Start a real `portico agent serve` process on a free port."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from support.server import _await_ready_port, _die_with_parent, stop_child

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
READY_LINE = re.compile(r"Portico agent serving grpc://(?P<host>[^:/]+):(?P<port>\d+)")


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
        """Once more if the process died of a signal before listening: grpcio's event
        engine has aborted at start now and then under load ("epoll_wait error: Bad file
        descriptor", SIGABRT), in no code of ours. Any other failure raises at once."""
        try:
            return self._start()
        except RuntimeError:
            if self.process is None or (self.process.returncode or 0) >= 0:
                raise
            stop_child(self.process, signal.SIGKILL)
            return self._start()

    def _start(self) -> AgentProcess:
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
        self.port = _await_ready_port(self.process.stdout, self.process, self.log_path, READY_LINE)
        return self

    def terminated(self) -> int:
        """SIGTERM once, then its exit status (no second signal: it may be exiting)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=15)
        finally:
            self.stop()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        process, self.process = self.process, None
        return stop_child(process, sig)

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""
