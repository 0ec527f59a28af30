"""The bus and the session-state ledger, as the settings choose them: in this process
(`bus: memory`, `session_state: memory`), or in Redis (`redis_url`) for replicas."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from portico.bus.memory_bus import InProcessBus
from portico.bus.port import Bus
from portico.calls.directory import CallDirectory, InProcessCallDirectory
from portico.config import Settings
from portico.sessionstate.base import BufferLimits, SessionStates
from portico.sessionstate.memory import InProcessSessionStates


async def _nothing() -> None:
    return None


@dataclass(frozen=True)
class SharedState:
    bus: Bus
    session_states: SessionStates
    call_directory: CallDirectory
    close: Callable[[], Awaitable[None]] = _nothing


def build_shared_state(settings: Settings) -> SharedState:
    bus, close_bus = _build_bus(settings)
    states = _build_session_states(settings)
    directory = _build_call_directory(settings)

    async def close() -> None:
        await close_bus()
        await states.close()
        await directory.close()

    return SharedState(bus, states, directory, close)


def _build_bus(settings: Settings) -> tuple[Bus, Callable[[], Awaitable[None]]]:
    if settings.bus != "redis":
        return InProcessBus(settings.bus_stream_max_len), _nothing
    # Imported here: redis-py is an optional extra (`portico[redis]`). The client
    # connects at its first command, so building it costs nothing at start.
    from portico.bus.redis_bus import RedisBus

    redis_bus = RedisBus(
        settings.redis_url,
        prefix=settings.redis_key_prefix,
        max_len=settings.bus_stream_max_len,
        block=settings.bus_read_block,
        topic_ttl=settings.bus_topic_ttl,
        inbox_ttl=settings.bus_inbox_ttl,
        close_timeout=settings.redis_close_timeout,
    )
    return redis_bus, redis_bus.close


def _build_call_directory(settings: Settings) -> CallDirectory:
    """Where `/ws` voice calls are found by `?resume`: this process, or Redis with the bus
    (a call on another replica is let go of through the bus's control)."""
    if settings.bus != "redis":
        return InProcessCallDirectory()
    from redis.asyncio import Redis

    from portico.calls.redis_directory import RedisCallDirectory

    # A resume waits on it before its `connected`: it answers or fails fast.
    client = Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2)
    return RedisCallDirectory(
        client,
        prefix=settings.redis_key_prefix,
        live_ttl=settings.replica_lease,
        close_timeout=settings.redis_close_timeout,
    )


def _build_session_states(settings: Settings) -> SessionStates:
    """Where `/v1/session` streams live: this process, or Redis for every replica."""
    limits = BufferLimits(
        max_messages=settings.resend_buffer_messages, max_bytes=settings.resend_buffer_bytes
    )
    if settings.session_state != "redis":
        return InProcessSessionStates(limits)
    from redis.asyncio import Redis

    from portico.sessionstate.redis import RedisSessionStates

    client = Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=5)
    return RedisSessionStates(
        client,
        limits,
        prefix=settings.redis_key_prefix,
        resume_window=settings.resume_window,
        expiry_grace=settings.session_expiry_grace,
        close_timeout=settings.redis_close_timeout,
    )
