"""The test Redis (127.0.0.1:6379): a client and a key prefix per test, cleaned after."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from redis.asyncio import Redis

REDIS_URL = "redis://127.0.0.1:6379/0"


def run_prefix() -> str:
    """A key prefix no other test (or helper sharing this Redis) uses."""
    return f"portico-test:{uuid.uuid4().hex[:12]}:"


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
