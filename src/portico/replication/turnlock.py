"""One turn per session across replicas: a Redis lock per session, with a fencing token.

`SET key value NX PX lease`: one replica wins; the value names it, so any replica can
tell who runs the session's turn (control goes there). The holder renews it while the
turn runs and deletes it at the turn's end, both only if the value is still its own
(a script: compare and act in one step). A replica that dies stops renewing: after
`lease` seconds the session is free again, and the orphan sweep ends the dead
replica's turn `interrupted` (docs/storage.md). Each grant draws a fencing token
(`INCR`), increasing per session, carried in the value for writers that check it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from redis.exceptions import RedisError

from portico.errors import BusUnavailable

# Renew; a lock that lapsed while nobody took it (Redis restarted, a long pause) is
# taken again under the same value.
_RENEW = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if not held then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
# Free, or held under this replica's id by a turn that is not running any more (its
# release failed while Redis was away, or this replica restarted under its stable id):
# the caller runs no turn in the session, so the lock is its own to take.
# One round trip: the check, the fencing token and the grant.
_ACQUIRE = """
local held = redis.call('GET', KEYS[1])
if (not held) or string.sub(held, 1, string.len(ARGV[1])) == ARGV[1] then
  local value = ARGV[1] .. redis.call('INCR', KEYS[2])
  redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
  return value
end
return false
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Holder(NamedTuple):
    replica: str
    fence: int


def parse_holder(value: bytes | str | None) -> Holder | None:
    if value is None:
        return None
    text = value.decode() if isinstance(value, bytes) else value
    replica, _, fence = text.rpartition("|")
    return Holder(replica, int(fence)) if replica and fence.isdigit() else None


class TurnLocks:
    def __init__(self, redis: Any, *, prefix: str, replica_id: str, lease: float) -> None:
        self._redis = redis
        self._prefix = prefix
        self._replica = replica_id
        self._lease_ms = max(1, int(lease * 1000))
        self._held: dict[str, str] = {}  # session id -> the value this replica set
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._acquire = redis.register_script(_ACQUIRE)

    def _key(self, session_id: str) -> str:
        # The braces keep a session's lock and token in one Redis Cluster slot.
        return f"{self._prefix}turnlock:{{{session_id}}}"

    def _fence_key(self, session_id: str) -> str:
        return f"{self._prefix}turnfence:{{{session_id}}}"

    def holds(self, session_id: str) -> bool:
        return session_id in self._held

    async def acquire(self, session_id: str) -> bool:
        """Only while this replica runs no turn in the session (the engine's own map)."""
        if session_id in self._held:
            return True
        try:
            value = await self._acquire(
                keys=[self._key(session_id), self._fence_key(session_id)],
                args=[f"{self._replica}|", self._lease_ms],
            )
        except RedisError as exc:
            raise BusUnavailable() from exc
        if value is None:
            return False
        self._held[session_id] = value.decode() if isinstance(value, bytes) else str(value)
        return True

    async def holder(self, session_id: str) -> Holder | None:
        try:
            return parse_holder(await self._redis.get(self._key(session_id)))
        except RedisError as exc:
            raise BusUnavailable() from exc

    async def release(self, session_id: str) -> None:
        value = self.forget(session_id)
        if value is not None:
            await self.release_value(session_id, value)

    def forget(self, session_id: str) -> str | None:
        """Stop holding the lock here at once (the next `acquire` asks Redis); the value
        to delete it with, None when not held."""
        return self._held.pop(session_id, None)

    async def release_value(self, session_id: str, value: str) -> None:
        """Delete the lock if it still has `value` (a newer grant is left alone)."""
        try:
            await self._release(keys=[self._key(session_id)], args=[value])
        except RedisError as exc:
            raise BusUnavailable() from exc

    async def renew_all(self) -> list[str]:
        """Extend every lock held here; the sessions whose lock was lost (it lapsed and
        another replica took it: this replica paused longer than the lease)."""
        lost: list[str] = []
        for session_id, value in list(self._held.items()):
            kept = await self._renew(keys=[self._key(session_id)], args=[value, self._lease_ms])
            if not kept:
                lost.append(session_id)
        return lost
