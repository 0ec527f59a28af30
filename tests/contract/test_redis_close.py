"""A replica's Redis clients close within `redis_close_timeout`, whatever Redis does.

redis-py's `aclose` waits for each socket to finish closing, and a socket whose command
bytes wait for a server that stopped reading does not (redis-py issue #3941): the close
took the connection's own timeout and then raised, or hung with none. The Redis here is
the test's own (tests/support/private_redis.py), paused with SIGSTOP: it accepts
nothing more, as a host that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from portico.config import Settings
from portico.server.backends import SharedState, build_shared_state
from support.private_redis import PrivateRedis

DEADLINE = 30.0  # a guard against a hang, not a measure
# A command larger than the kernel's socket buffers take, so its bytes wait in the
# client while the server reads nothing.
STUCK_BYTES = 16 * 1024 * 1024


def _waiting_bytes(port: Any) -> int:
    """Bytes the port's Redis client holds for a server that does not read them."""
    clients = [port._redis, getattr(port, "_publisher", port._redis)]
    pools = [client.connection_pool for client in clients]  # seen inside redis-py
    connections = [c for p in pools for c in (*p._in_use_connections, *p._available_connections)]
    return sum(
        c._writer.transport.get_write_buffer_size() for c in connections if c._writer is not None
    )


async def _until_stuck(shared: SharedState) -> None:
    ports = (shared.bus, shared.session_states, shared.call_directory)
    async with asyncio.timeout(DEADLINE):
        while not all(_waiting_bytes(port) for port in ports):  # noqa: ASYNC110 (a socket)
            await asyncio.sleep(0.01)


async def test_every_redis_client_closes_within_the_bound_when_redis_stops_answering(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with PrivateRedis(tmp_path / "redis") as server:
        settings = Settings(
            bus="redis",
            session_state="redis",
            redis_url=server.url,
            redis_close_timeout=0.2,
        )
        shared = build_shared_state(settings)
        # Each client connected and used once.
        assert (await shared.bus.health(DEADLINE)).ready
        await shared.bus.publish("session:stuck", b"before")  # the publishing client
        assert (await shared.session_states.health(DEADLINE)).ready
        assert await shared.call_directory.claim("ses_none", "alice", 0.0) is None
        assert server.process is not None
        os.kill(server.process.pid, signal.SIGSTOP)
        big = "x" * STUCK_BYTES
        in_flight = [
            asyncio.ensure_future(shared.bus.publish("session:stuck", big.encode())),
            asyncio.ensure_future(shared.session_states.header(big)),
            asyncio.ensure_future(shared.call_directory.claim(big, "alice", 0.0)),
        ]
        try:
            await _until_stuck(shared)
            with caplog.at_level(logging.WARNING, logger="portico.closing"):
                async with asyncio.timeout(DEADLINE):
                    await shared.close()  # returns, and raises nothing
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
            for task in in_flight:
                task.cancel()
            await asyncio.wait(in_flight, timeout=DEADLINE)
    said = [r.getMessage() for r in caplog.records if r.name == "portico.closing"]
    # The bus's stuck command is on its publishing client ("bus publisher").
    for what in ("bus publisher", "session state", "call directory"):
        assert any(line.startswith(f"{what}: closing the Redis client") for line in said), said
