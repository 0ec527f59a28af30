"""Shared real servers for the conformance suite (one process each, per test session)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from support.conformance import (
    ALICE,
    BOB,
    SHORT_CLIENT_TOOL_TIMEOUT,
    SHORT_CONTEXT_TTL,
    SHORT_PING_INTERVAL,
    SHORT_PONG_TIMEOUT,
    SHORT_TOOL_ACK_TIMEOUT,
    SMALL_MAX_PAYLOAD,
    Connect,
    connector,
)
from support.server import SCRIPT, ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Scripted agent, API keys for alice and bob, a second agent with a sandbox."""
    data_dir = tmp_path_factory.mktemp("portico-main")
    config = data_dir / "portico.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "auth": "apikey",
                "api_keys": {ALICE: "alice", BOB: "bob"},
                "runtime": "scripted",
                "script": str(SCRIPT),
                "agents": {
                    "sandboxed": {
                        "runtime": "scripted",
                        "script": str(SCRIPT),
                        "sandboxes": ["workspace"],
                    }
                },
            }
        )
    )
    process = ServerProcess(data_dir, args=("--config", str(config))).start()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def short_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("portico-short"),
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={
            "PORTICO_CONTEXT_TTL": str(SHORT_CONTEXT_TTL),
            "PORTICO_PING_INTERVAL": str(SHORT_PING_INTERVAL),
            "PORTICO_PONG_TIMEOUT": str(SHORT_PONG_TIMEOUT),
            "PORTICO_MAX_PAYLOAD_SIZE": str(SMALL_MAX_PAYLOAD),
            "PORTICO_TOOL_ACK_TIMEOUT": str(SHORT_TOOL_ACK_TIMEOUT),
            "PORTICO_CLIENT_TOOL_TIMEOUT": str(SHORT_CLIENT_TOOL_TIMEOUT),
        },
    ).start()
    yield process
    process.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def connect(http: aiohttp.ClientSession, server: ServerProcess) -> Connect:
    """Open a `/ws` connection to the main server as alice (or `as_token=`)."""
    return connector(http, server, ALICE)


@pytest.fixture
def connect_short(http: aiohttp.ClientSession, short_server: ServerProcess) -> Connect:
    return connector(http, short_server, None)


@pytest.fixture
def archive_path(server: ServerProcess) -> Path:
    return server.archive_path


@pytest.fixture
def short_archive_path(short_server: ServerProcess) -> Path:
    return short_server.archive_path
