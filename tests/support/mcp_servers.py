"""MCP servers for the tests: the reference server `@modelcontextprotocol/server-everything`
from the npm registry (over stdio, and over streamable HTTP in a process of its own),
and `mcp_faulty.py`, whose tools hang, crash and fail on request.

The reference server is installed with `npm install` into a cache directory outside
the repository (once per version, under a lock that parallel test workers share).
Without npm or the registry the tests that need it are skipped locally and fail in CI
(`CI` set), like the browser tests: CI must never skip them. `.ci/run` installs it
ahead of the tests with `python3 tests/support/mcp_servers.py`, which fails loudly.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

EVERYTHING = "@modelcontextprotocol/server-everything"
EVERYTHING_VERSION = "2026.8.31"
NPM_DIR = Path(
    os.environ.get("PORTICO_TEST_NPM_DIR")
    or Path(tempfile.gettempdir()) / f"portico-test-npm-everything-{EVERYTHING_VERSION}"
)
NPM_INSTALL_TIMEOUT = 300.0
HTTP_START_TIMEOUT = 20.0
FAULTY = Path(__file__).resolve().parent / "mcp_faulty.py"


def _unavailable(message: str) -> None:
    import pytest  # here: `.ci/run` runs this file with a Python that has no pytest

    if os.environ.get("CI"):
        pytest.fail(message)  # .ci/run provides node and npm: never skip there
    pytest.skip(message)


ENTRY = NPM_DIR / "node_modules" / EVERYTHING / "dist" / "index.js"


def everything_entry() -> Path:
    """The reference server's `dist/index.js`, installed from npm on first use."""
    failure = install()
    if failure:
        _unavailable(failure)
    return ENTRY


def install() -> str | None:
    """Install the reference server unless it is there; why it could not be, or None."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return f"the MCP tests need node and npm to install {EVERYTHING}"
    NPM_DIR.mkdir(parents=True, exist_ok=True)
    with (NPM_DIR / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        failure = None if ENTRY.exists() else _npm_install()
    if failure is None and not ENTRY.exists():
        failure = f"npm installed {EVERYTHING} without {ENTRY}"
    return failure


def _npm_install() -> str | None:
    command = [
        "npm", "install", "--no-audit", "--no-fund", "--no-save",
        "--prefix", str(NPM_DIR), f"{EVERYTHING}@{EVERYTHING_VERSION}",
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=NPM_INSTALL_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        return f"npm install {EVERYTHING} took longer than {NPM_INSTALL_TIMEOUT:g} s"
    if done.returncode != 0:
        return f"npm install {EVERYTHING} failed:\n{done.stderr[-2000:]}"
    return None


def everything_stdio() -> dict[str, object]:
    """An `mcp_servers` entry that starts the reference server over stdio."""
    return {"command": "node", "args": [str(everything_entry()), "stdio"]}


def faulty_stdio() -> dict[str, object]:
    return {"command": sys.executable, "args": [str(FAULTY)]}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class HttpMcpServer:
    """An MCP server over streamable HTTP in a process of its own, on a port the test
    picks (the reference server takes `PORT` and prints no address): `start` returns
    once the port accepts connections, retrying the rare port another process took."""

    def __init__(self, command: Callable[[int], list[str]], log_path: Path) -> None:
        self.command = command
        self.log_path = log_path
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self, *, same_port: bool = False) -> HttpMcpServer:
        for _ in range(3):
            if not same_port:
                self.port = _free_port()
            with self.log_path.open("ab") as log:
                self.process = subprocess.Popen(
                    self.command(self.port),
                    env={**os.environ, "PORT": str(self.port)},
                    stdout=log,
                    stderr=log,
                )
            if self._await_listening():
                return self
            self.stop()
        log = self.log_path.read_text()
        raise RuntimeError(f"the streamable-HTTP server did not start:\n{log}")

    def _await_listening(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + HTTP_START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
                return True
            except OSError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.process is None:
            return
        process, self.process = self.process, None
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def everything_http(log_path: Path) -> HttpMcpServer:
    """The reference server over streamable HTTP (not started)."""
    entry = everything_entry()
    return HttpMcpServer(lambda port: ["node", str(entry), "streamableHttp"], log_path)


def faulty_http(log_path: Path) -> HttpMcpServer:
    return HttpMcpServer(lambda port: [sys.executable, str(FAULTY), "http", str(port)], log_path)


if __name__ == "__main__":
    problem = install()
    if problem:
        sys.exit(f"error: {problem}")
    print(f"{EVERYTHING}@{EVERYTHING_VERSION} at {ENTRY}")
