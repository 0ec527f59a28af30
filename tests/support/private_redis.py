"""A Redis of the test's own: `redis-server` on a free port, nothing persisted, that a
test may stop, restart or kill. The shared Redis (127.0.0.1:6379) is never touched.

    with PrivateRedis(tmp_path) as redis:     # redis.url: redis://127.0.0.1:<port>/0
        redis.restart()                       # down, then up on the same port, empty
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import pytest

START_TIMEOUT = 10.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateRedis:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("these tests need redis-server (Debian: apt-get install redis-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), "--protected-mode", "no"],
            stdout=log, stderr=log,
        )  # fmt: skip
        self._await(up=True)
        return self

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Down at once (SIGKILL: what it held is gone, as after a crash)."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(sig)
        try:
            process.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._await(up=False)

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()

    def _await(self, *, up: bool) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self._answers() == up:
                return
            if up and self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.directory / 'redis.log'}")
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on {self.port} did not go {'up' if up else 'down'}")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
