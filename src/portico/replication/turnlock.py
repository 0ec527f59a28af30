"""One turn per session across replicas: a Redis lock per session, with a fencing token.

`SET key value NX PX lease`: one replica wins; the value names it, so any replica can
tell who runs the session's turn (control goes there). The holder renews it while the
turn runs and deletes it at the turn's end, both only if the value is still its own
(a script: compare and act in one step). A replica that dies stops renewing: after
`lease` seconds the session is free again, and the orphan sweep ends the dead
replica's turn `interrupted` (docs/storage.md). Each grant draws a fencing token
(above the session's last one and at least Redis's clock in ms), carried in the value
for writers that check it. The token's counter expires `fence_ttl` after the session's
last grant, renewal or release (docs/replicas.md, "One turn per session").
"""

from __future__ import annotations

from typing import Any, NamedTuple

from redis.exceptions import RedisError

from portico.errors import BusUnavailable

# The fencing token: above the session's last one and at least Redis's clock in ms, so
# a counter that restarts (its key expired after `fence_ttl` idle, or a Redis restart
# without persistence lost it) still starts above every token granted before.
# KEYS[2] the counter; ARGV[3] its expiry (ms). Leaves the token in `token`.
_NEXT_TOKEN = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local token = string.format('%d', math.max(tonumber(redis.call('GET', KEYS[2]) or '0') + 1, now))
redis.call('SET', KEYS[2], token, 'PX', ARGV[3])
"""
# Renew, and keep the session's counter alive with it. A lock that lapsed while nobody
# took it (Redis restarted, a long pause) is taken again under the same value, only if
# no grant came since (the counter still has this token, or is gone with Redis's data):
# after another grant this token is stale and must stay behind.
# ARGV: the value, the lease (ms), the counter's expiry (ms), the value's token.
_RENEW = """
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if not held then
  local last = redis.call('GET', KEYS[2])
  if last and last ~= ARGV[4] then return 0 end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[3])
  return 1
end
return 0
"""
# Free, or held under this replica's id by a turn that is not running any more (its
# release failed while Redis was away, or this replica restarted under its stable id):
# the caller runs no turn in the session, so the lock is its own to take.
# One round trip: the check, the fencing token and the grant.
_ACQUIRE = (
    """
local held = redis.call('GET', KEYS[1])
if held and string.sub(held, 1, string.len(ARGV[1])) ~= ARGV[1] then
  return false
end
"""
    + _NEXT_TOKEN
    + """
local value = ARGV[1] .. token
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return value
"""
)
# The counter outlives the turn's end by its expiry (a turn's end may still be written
# after the release, turn_end_retry_window). It moves past the released token: a
# renewal of it already on its way (sent before the release, arriving after) then
# finds a grant came since and does not take the free lock back, which would hold the
# session for a lease against every other replica (seen in bench/replicas.py).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
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
    def __init__(
        self, redis: Any, *, prefix: str, replica_id: str, lease: float, fence_ttl: float
    ) -> None:
        """`fence_ttl`: how long a session's token counter outlives its last grant,
        renewal or release (the `turn_fence_ttl` setting)."""
        self._redis = redis
        self._prefix = prefix
        self._replica = replica_id
        self._lease_ms = max(1, int(lease * 1000))
        self._fence_ttl_ms = max(1, int(fence_ttl * 1000))
        self._held: dict[str, str] = {}  # session id -> the value this replica set
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._acquire = redis.register_script(_ACQUIRE)

    def _key(self, session_id: str) -> str:
        # The braces keep a session's lock and token in one Redis Cluster slot.
        return f"{self._prefix}turnlock:{{{session_id}}}"

    def _fence_key(self, session_id: str) -> str:
        return f"{self._prefix}turnfence:{{{session_id}}}"

    def _keys(self, session_id: str) -> list[str]:
        return [self._key(session_id), self._fence_key(session_id)]

    def holds(self, session_id: str) -> bool:
        return session_id in self._held

    async def acquire(self, session_id: str) -> bool:
        """Only while this replica runs no turn in the session (the engine's own map)."""
        if session_id in self._held:
            return True
        try:
            value = await self._acquire(
                keys=self._keys(session_id),
                args=[f"{self._replica}|", self._lease_ms, self._fence_ttl_ms],
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
            await self._release(keys=self._keys(session_id), args=[value, self._fence_ttl_ms])
        except RedisError as exc:
            raise BusUnavailable() from exc

    async def renew_all(self) -> list[str]:
        """Extend every lock held here; the sessions whose lock was lost (it lapsed and
        another replica took it: this replica paused longer than the lease)."""
        held = list(self._held.items())
        if not held:
            return []
        # One round trip for all (a replica may hold thousands).
        async with self._redis.pipeline(transaction=False) as pipe:
            for session_id, value in held:
                token = value.rpartition("|")[2]
                await self._renew(
                    keys=self._keys(session_id),
                    args=[value, self._lease_ms, self._fence_ttl_ms, token],
                    client=pipe,
                )
            kept = await pipe.execute()
        # A turn that ended meanwhile released its lock: neither renewed (its release
        # moved the token on) nor lost.
        return [
            session_id
            for (session_id, value), renewed in zip(held, kept, strict=True)
            if not renewed and self._held.get(session_id) == value
        ]
