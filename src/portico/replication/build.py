"""The link to the other replicas, from the settings (bus=redis); None with bus=memory."""

from __future__ import annotations

from typing import Any

from portico.bus.port import Bus
from portico.config import Settings
from portico.replication.link import BusLink
from portico.store.base import Store


def build_link(settings: Settings, store: Store, replica_id: str, bus: Bus) -> BusLink | None:
    """`bus`: the process's bus (server/backends.py), which the link does not close."""
    if settings.bus != "redis":
        return None
    # Imported here: redis-py is an optional extra (`portico[redis]`).
    import redis.asyncio as aioredis

    from portico.replication.turnlock import TurnLocks

    # Lock calls must answer or fail fast: a new turn waits on them.
    redis: Any = aioredis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2)
    locks = TurnLocks(
        redis,
        prefix=settings.redis_key_prefix,
        replica_id=replica_id,
        lease=settings.replica_lease,
        fence_ttl=settings.turn_fence_ttl,
    )
    return BusLink(
        bus,
        locks,
        store,
        replica_id=replica_id,
        lease=settings.replica_lease,
        control_timeout=settings.bus_control_timeout,
    )
