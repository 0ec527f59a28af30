"""What the conformance suite's servers are made of, for its conftest.py and its tests
(a test module imports these from here, never from `conftest`: several suites have a
conftest.py, and which one `import conftest` finds depends on what ran first)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

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


def connector(http: aiohttp.ClientSession, target: ServerProcess, token: str | None) -> Connect:
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
