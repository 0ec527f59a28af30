"""Credential expiry across two replicas (PostgreSQL, Redis, `--auth jwt`): a `/ws`
connection on replica A whose token's close point passes while replica B runs a turn
of its session waits for that turn, as it waits for one running on A (spec
identity.md, docs/replicas.md "Credential expiry")."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.jwks import AUDIENCE, Issuer, served_issuer
from support.postgres import create_schema, drop_schemas, require_postgres, schema_url
from support.redis import REDIS_URL, drop_keys
from support.replicas import free_port
from support.server import ServerProcess

MARGIN = 2.0  # seconds before `exp` the server closes (PORTICO_CREDENTIAL_EXPIRY_MARGIN)
LIFE = 6  # seconds the watcher's token lives: its close point is about 4 s on
BOUND = 30.0  # no wait in this module is longer
SLOW_WORD_DELAY = "0.01"  # the demo's `slow` reply then streams for about 8 s


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    yield from served_issuer()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, issuer: Issuer) -> Iterator[list[ServerProcess]]:
    require_postgres()
    schema = asyncio.run(create_schema())
    prefix = f"portico-test:{uuid.uuid4().hex[:12]}:"
    root: Path = tmp_path_factory.mktemp("replicas-credentials")
    servers = [
        ServerProcess(
            root / f"rep-{index}",
            args=("--auth", "jwt", "--runtime", "demo", "--store", "postgres"),
            port=free_port(),
            env={
                "PORTICO_DATABASE_URL": schema_url(schema),
                "PORTICO_REPLICA_ID": f"rep-{index}",
                "PORTICO_BUS": "redis",
                "PORTICO_REDIS_URL": REDIS_URL,
                "PORTICO_REDIS_KEY_PREFIX": prefix,
                "PORTICO_JWT_ISSUER": issuer.url,
                "PORTICO_JWT_AUDIENCE": AUDIENCE,
                "PORTICO_JWT_SESSION_CLAIM": "sid",
                "PORTICO_CREDENTIAL_EXPIRY_MARGIN": str(MARGIN),
                "PORTICO_DEMO_WORD_DELAY": SLOW_WORD_DELAY,
            },
        )
        for index in range(2)
    ]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()
        drop_keys(prefix)
        asyncio.run(drop_schemas([schema]))


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession() as session:
        yield session


def token(issuer: Issuer, user: str, life: int) -> str:
    return issuer.token(sub=user, sid="dev-1", exp=int(time.time()) + life)


async def ws_open(http: aiohttp.ClientSession, server: ServerProcess, bearer: str) -> Any:
    ws = await http.ws_connect(server.ws_url, headers={"Authorization": f"Bearer {bearer}"})
    connected = await ws.receive_json(timeout=BOUND)
    assert connected["type"] == "connected", connected
    return ws


async def frames_until(ws: Any, kind: str) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    async with asyncio.timeout(BOUND):
        while not frames or frames[-1]["type"] != kind:
            msg = await ws.receive()
            assert msg.type is aiohttp.WSMsgType.TEXT, (msg, frames[-3:])
            frames.append(msg.json())
    return frames


async def test_a_ws_close_waits_for_its_sessions_turn_on_the_other_replica(
    http: aiohttp.ClientSession, pair: list[ServerProcess], issuer: Issuer
) -> None:
    a, b = pair
    user = f"cred-{uuid.uuid4().hex[:8]}"
    short = token(issuer, user, LIFE)
    watcher = await ws_open(http, a, short)
    await watcher.send_json({"type": "message", "content": "echo hi"})
    session_id = (await frames_until(watcher, "done"))[-1]["session_id"]
    runner = await ws_open(http, b, token(issuer, user, 600))
    await runner.send_json({"type": "message", "session_id": session_id, "content": "slow"})
    # A relays B's turn to the watcher; its close point passes meanwhile.
    frames = await frames_until(watcher, "done")
    assert time.time() > exp_of_close(short), "the turn ended before the close point"
    assert frames[-1]["session_id"] == session_id
    msg = await watcher.receive(timeout=BOUND)
    assert msg.type is aiohttp.WSMsgType.CLOSE, msg
    assert (watcher.close_code, msg.extra) == (4401, "credential expired")
    await runner.close()


def exp_of_close(bearer: str) -> float:
    """When the server's close point for `bearer` passed (its `exp` less the margin)."""
    import jwt

    exp: int = jwt.decode(bearer, options={"verify_signature": False})["exp"]
    return exp - MARGIN
