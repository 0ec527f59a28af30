"""Shared real servers for the conformance suite (one process each, per test session)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from support.omnia import OmniaClient
from support.server import SCRIPT, ServerProcess

ALICE = "alice-token"
BOB = "bob-token"
# Short limits for the server that tests expiry, keepalive and frame size.
SHORT_CONTEXT_TTL = 0.5
SHORT_PING_INTERVAL = 0.2
SHORT_PONG_TIMEOUT = 0.8
SMALL_MAX_PAYLOAD = 65536
SHORT_TOOL_ACK_TIMEOUT = 1.0
SHORT_CLIENT_TOOL_TIMEOUT = 2.0
RPC_USERS = 400

Connect = Callable[..., Awaitable[OmniaClient]]


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


def start_rpc_server(
    tmp_path_factory: pytest.TempPathFactory, name: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """A scripted server whose API keys `key-N` belong to `user-N`: a test takes users
    of its own, so its update log holds exactly what it did."""
    data_dir = tmp_path_factory.mktemp(name)
    config = data_dir / "portico.yaml"
    keys = {f"key-{n}": f"user-{n}" for n in range(RPC_USERS)}
    config.write_text(
        yaml.safe_dump(
            {"auth": "apikey", "api_keys": keys, "runtime": "scripted", "script": str(SCRIPT)}
        )
    )
    return ServerProcess(data_dir, args=("--config", str(config)), env=env).start()


def rpc_url(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/rpc"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _connector(http: aiohttp.ClientSession, target: ServerProcess, token: str | None) -> Connect:
    async def connect(
        query: str = "", *, as_token: str | None = token, **kwargs: object
    ) -> OmniaClient:
        headers = {"Authorization": f"Bearer {as_token}"} if as_token else {}
        ws = await http.ws_connect(
            target.ws_url + query,
            headers=headers,
            autoping=True,
            **kwargs,  # type: ignore[arg-type]
        )
        return OmniaClient(ws)

    return connect


@pytest.fixture
def connect(http: aiohttp.ClientSession, server: ServerProcess) -> Connect:
    """Open a `/ws` connection to the main server as alice (or `as_token=`)."""
    return _connector(http, server, ALICE)


@pytest.fixture
def connect_short(http: aiohttp.ClientSession, short_server: ServerProcess) -> Connect:
    return _connector(http, short_server, None)


@pytest.fixture
def archive_path(server: ServerProcess) -> Path:
    return server.archive_path


@pytest.fixture
def short_archive_path(short_server: ServerProcess) -> Path:
    return short_server.archive_path
