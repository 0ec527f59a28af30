"""Three `portico serve` replicas on one PostgreSQL archive and one Redis, behind
Debian's HAProxy in plain round-robin (no stickiness), as issue 16 deploys them.

Every start and stop has a deadline; `kill` (SIGKILL) and `restart` act on one replica
while the balancer's health check on `/readyz` takes it out and back in.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest

from support.postgres import create_schema, drop_schemas, require_postgres, schema_url
from support.server import SCRIPT, ServerProcess, stop_child

REPLICAS = 3
HAPROXY_READY_TIMEOUT = 20.0

_HAPROXY_CONFIG = """\
global
    maxconn 1024
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
    # WebSockets: once upgraded, a connection is a tunnel and may idle between frames.
    timeout tunnel 1h
    option http-server-close
frontend portico
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /readyz
    default-server inter 300ms fall 1 rise 1
    # Which replica answered, so tests can see the rotation without a server change.
    http-response set-header X-Served-By %[srv_name]
{servers}
"""


def require_haproxy() -> str:
    path = shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None
    )
    if path is None:
        pytest.fail(
            "the replica tests need HAProxy (sudo apt-get install -y haproxy; .ci/run does)"
        )
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Replicas:
    """The replicas and their balancer; `url` is the only address a client should use."""

    def __init__(
        self,
        root: Path,
        *,
        database_url: str,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = root
        self.port = free_port()
        base_args = ("--store", "postgres", "--runtime", "scripted", "--script", str(SCRIPT), *args)
        self.servers = [
            ServerProcess(
                root / f"replica-{index}",
                args=base_args,
                env={
                    "PORTICO_DATABASE_URL": database_url,
                    "PORTICO_REPLICA_ID": f"rep-{index}",
                    "PORTICO_BUS": "redis",
                    "PORTICO_SESSION_STATE": "redis",
                    "PORTICO_REDIS_URL": "redis://127.0.0.1:6379/0",
                    **(env or {}),
                },
            )
            for index in range(REPLICAS)
        ]
        self._haproxy: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start(self) -> Replicas:
        for server in self.servers:
            server.start()  # bounded by support.server.START_TIMEOUT
        self._start_haproxy()
        return self

    def stop(self) -> None:
        stop_child(self._haproxy)
        self._haproxy = None
        for server in self.servers:
            server.stop()

    def kill(self, index: int) -> None:
        """SIGKILL one replica: no goodbye, no flush, its sockets just die."""
        self.servers[index].stop(signal.SIGKILL)

    def restart(self, index: int) -> None:
        """Start a stopped (or killed) replica again on its port, under the same id."""
        self.servers[index].stop()
        self.servers[index].start()
        self.await_in_rotation(count=sum(server.process is not None for server in self.servers))

    def _start_haproxy(self) -> None:
        servers = "\n".join(
            f"    server r{index} 127.0.0.1:{server.port} check"
            for index, server in enumerate(self.servers)
        )
        config = self.root / "haproxy.cfg"
        config.write_text(_HAPROXY_CONFIG.format(port=self.port, servers=servers))
        log = (self.root / "haproxy.log").open("a")
        self._haproxy = subprocess.Popen(
            [require_haproxy(), "-db", "-f", str(config)], stdout=log, stderr=log, text=True
        )
        self.await_in_rotation(count=len(self.servers))

    def await_in_rotation(self, *, count: int) -> None:
        """Wait until round-robin through the balancer reaches `count` distinct replicas."""
        deadline = time.monotonic() + HAPROXY_READY_TIMEOUT
        seen: set[str] = set()
        while time.monotonic() < deadline:
            replica = self.replica_behind()
            if replica:
                seen.add(replica)
            if len(seen) >= count:
                return
            time.sleep(0.05)
        raise RuntimeError(f"only {sorted(seen)} of {count} replicas came into rotation")

    def await_out_of_rotation(self, name: str) -> None:
        """Wait until the health check has marked `name` down (a few rounds without it)."""
        deadline = time.monotonic() + HAPROXY_READY_TIMEOUT
        streak = 0
        while time.monotonic() < deadline:
            streak = streak + 1 if self.replica_behind() not in (name, None) else 0
            if streak >= 2 * len(self.servers):
                return
            time.sleep(0.05)
        raise RuntimeError(f"{name} stayed in rotation")

    def replica_behind(self) -> str | None:
        """The replica id that answered one request through the balancer (None: none did)."""
        try:
            with urllib.request.urlopen(self.url + "/readyz", timeout=2) as response:
                served_by: str | None = response.headers.get("X-Served-By")
                return served_by
        except (urllib.error.URLError, OSError):
            return None


@contextlib.asynccontextmanager
async def balanced_replicas(
    root: Path, env: Mapping[str, str] | None = None
) -> AsyncIterator[tuple[Replicas, str]]:
    """Three replicas behind HAProxy on a fresh PostgreSQL schema, started and stopped
    off the event loop: the group and its schema's name (dropped at the end)."""
    require_postgres()
    require_haproxy()
    schema = await create_schema()
    group = Replicas(root, database_url=schema_url(schema), env=dict(env or {}))
    await asyncio.to_thread(group.start)
    try:
        yield group, schema
    finally:
        await asyncio.to_thread(group.stop)
        await drop_schemas([schema])
