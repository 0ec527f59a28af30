"""The bus and the session-state ledger, as the settings choose them: in this process
(`bus: memory`), or in Redis (`bus: redis`, `redis_url`) for replicas."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from portico.bus.memory_bus import InProcessBus
from portico.bus.port import Bus
from portico.config import Settings
from portico.sessionstate.base import BufferLimits, SessionStates
from portico.sessionstate.memory import InProcessSessionStates


async def _nothing() -> None:
    return None


@dataclass(frozen=True)
class SharedState:
    bus: Bus
    session_states: SessionStates
    close: Callable[[], Awaitable[None]] = _nothing


def build_shared_state(settings: Settings) -> SharedState:
    limits = BufferLimits(
        max_messages=settings.resend_buffer_messages, max_bytes=settings.resend_buffer_bytes
    )
    if settings.bus != "redis":
        return SharedState(
            InProcessBus(settings.bus_stream_max_len), InProcessSessionStates(limits)
        )
    # Imported here: redis-py is an optional extra (`portico[redis]`). Neither client
    # connects before its first command, so building them costs nothing at start.
    import redis.asyncio as aioredis

    from portico.bus.redis_bus import RedisBus
    from portico.sessionstate.redis import RedisSessionStates

    prefix = settings.redis_key_prefix
    redis_bus = RedisBus(
        settings.redis_url,
        prefix=prefix,
        max_len=settings.bus_stream_max_len,
        block=settings.bus_read_block,
    )
    client = aioredis.from_url(settings.redis_url)
    states = RedisSessionStates(client, limits, prefix=prefix)

    async def close() -> None:
        await redis_bus.close()
        await client.aclose()

    return SharedState(redis_bus, states, close)
