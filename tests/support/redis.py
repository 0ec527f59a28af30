"""The test Redis (127.0.0.1:6379): a client and a key prefix per test, cleaned after."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from redis.asyncio import Redis

from support.server import SCRIPT, ServerProcess

REDIS_URL = "redis://127.0.0.1:6379/0"


def run_prefix() -> str:
    """A key prefix no other test (or helper sharing this Redis) uses."""
    return f"portico-test:{uuid.uuid4().hex[:12]}:"


# A `/v1/session` session's keys: `{prefix}session:<id>` and these after it.
KEY_SUFFIXES = ("", ":unacked", ":turns")


async def until_gone(client: Redis, keys: list[str], within: float = 10.0) -> None:
    """Until none of `keys` is in Redis (an expiry ran); fails after `within` seconds."""
    deadline = time.monotonic() + within
    while await client.exists(*keys):
        assert time.monotonic() < deadline, f"{keys} still in Redis after {within} s"
        await asyncio.sleep(0.05)


def session_keys(prefix: str, session_id: str) -> list[str]:
    return [f"{prefix}session:{session_id}{suffix}" for suffix in KEY_SUFFIXES]


@asynccontextmanager
async def redis_client(prefix: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=5)
    try:
        yield client
    finally:
        keys = [key async for key in client.scan_iter(match=prefix + "*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


# The `/v1/session` suites run against both session-state backends (docs/replicas.md).
SESSION_STATES = ("memory", "redis")


def session_state_env(kind: str, prefix: str) -> dict[str, str]:
    """A server's environment for `session_state=kind`; Redis keys under `prefix`."""
    if kind == "memory":
        return {"PORTICO_SESSION_STATE": "memory"}
    return {
        "PORTICO_SESSION_STATE": "redis",
        "PORTICO_REDIS_URL": REDIS_URL,
        "PORTICO_REDIS_KEY_PREFIX": prefix,
    }


def drop_keys(prefix: str) -> None:
    """Remove what a server left under `prefix` (synchronous: for fixture teardown)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=5)
    try:
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@contextmanager
def session_state(kind: str) -> Iterator[dict[str, str]]:
    """The environment of a server on `kind`, its Redis keys dropped afterwards."""
    prefix = run_prefix()
    try:
        yield session_state_env(kind, prefix)
    finally:
        if kind == "redis":
            drop_keys(prefix)


@contextmanager
def scripted_server(data_dir: Path, kind: str, env: Mapping[str, str]) -> Iterator[ServerProcess]:
    """A server on the scripted runtime with session state `kind` and `env` besides,
    stopped (and its Redis keys dropped) afterwards."""
    with session_state(kind) as state_env:
        process = ServerProcess(
            data_dir,
            args=("--runtime", "scripted", "--script", str(SCRIPT)),
            env={**env, **state_env},
        ).start()
        try:
            yield process
        finally:
            process.stop()
