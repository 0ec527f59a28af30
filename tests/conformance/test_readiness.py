"""`/readyz` on a real server process: 503 naming the backend and the reason while Redis
or PostgreSQL cannot be reached, and ready again by itself once it can."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from support.postgres import (
    DATABASE_URL,
    create_schema,
    drop_schemas,
    require_postgres,
    schema_url,
)
from support.replicas import free_port
from support.server import ServerProcess
from support.tcpproxy import TcpProxy

WAIT = 20.0  # deadline for the probe to change its answer


async def readyz(http: aiohttp.ClientSession, server: ServerProcess) -> tuple[int, Any]:
    async with http.get(server.http_url + "/readyz") as response:
        return response.status, await response.json()


async def until_status(http: aiohttp.ClientSession, server: ServerProcess, status: int) -> Any:
    async with asyncio.timeout(WAIT):
        while True:
            found, body = await readyz(http, server)
            if found == status:
                return body
            await asyncio.sleep(0.05)


async def test_unreachable_redis_is_503_naming_the_bus_and_the_session_state(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    server = ServerProcess(
        tmp_path / "data",
        env={
            "PORTICO_BUS": "redis",
            "PORTICO_SESSION_STATE": "redis",
            "PORTICO_REDIS_URL": dead,
            "PORTICO_READINESS_TIMEOUT": "1",
        },
    ).start()
    try:
        status, body = await readyz(http, server)
    finally:
        server.stop()
    assert (status, body["status"]) == (503, "backend unavailable")
    for name in ("bus", "session_state"):
        assert body["backends"][name]["state"] == "down"
        assert "ConnectionError" in body["backends"][name]["reason"], body
    archive = body["backends"]["archive"]
    assert archive["state"] == "ready"
    # The thread writer (one CPU) or the writer process (two or more: `sqlite_writer: auto`).
    assert re.fullmatch(r"in process|writer process \d+", archive["reason"]), archive


async def test_a_reachable_redis_is_ready(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    server = ServerProcess(
        tmp_path / "data",
        env={
            "PORTICO_BUS": "redis",
            "PORTICO_SESSION_STATE": "redis",
            "PORTICO_REDIS_URL": "redis://127.0.0.1:6379/0",
        },
    ).start()
    try:
        status, body = await readyz(http, server)
    finally:
        server.stop()
    assert status == 200, body
    assert body["backends"]["bus"] == {"state": "ready", "reason": "ok"}
    assert body["backends"]["session_state"] == {"state": "ready", "reason": "ok"}


@pytest.fixture
async def postgres_behind_a_proxy() -> AsyncIterator[tuple[str, TcpProxy]]:
    """A schema's URL that goes through a proxy the test can cut."""
    require_postgres()
    schema = await create_schema()
    target = urlsplit(DATABASE_URL)
    proxy = await TcpProxy(target.hostname or "127.0.0.1", target.port or 5432).restore()
    url = schema_url(schema).replace(
        f"{target.hostname}:{target.port or 5432}", f"127.0.0.1:{proxy.port}", 1
    )
    try:
        yield url, proxy
    finally:
        await proxy.cut()
        await drop_schemas([schema])


async def test_unreachable_postgres_is_503_naming_the_archive_then_ready_again(
    http: aiohttp.ClientSession, tmp_path: Path, postgres_behind_a_proxy: tuple[str, TcpProxy]
) -> None:
    url, proxy = postgres_behind_a_proxy
    server = ServerProcess(
        tmp_path / "data",
        args=("--store", "postgres"),
        env={"PORTICO_DATABASE_URL": url, "PORTICO_READINESS_TIMEOUT": "1"},
    )
    # In a thread: the proxy relays on this event loop while the server starts.
    await asyncio.to_thread(server.start)
    try:
        body = await until_status(http, server, 200)
        assert body["backends"]["archive"] == {"state": "ready", "reason": "ok"}
        await proxy.cut()
        body = await until_status(http, server, 503)
        assert body["status"] == "backend unavailable"
        archive = body["backends"]["archive"]
        assert archive["state"] == "down"
        assert archive["reason"], body
        assert "postgresql://" not in archive["reason"]  # never the URL (it may hold a password)
        await proxy.restore()
        body = await until_status(http, server, 200)
        assert body["backends"]["archive"]["state"] == "ready"
    finally:
        await asyncio.to_thread(server.stop)
