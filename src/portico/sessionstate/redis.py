"""Session state in Redis: any replica resumes a `/v1/session`, and it outlives its replica.

One hash per session (epoch, positions, buffered bytes, capabilities, window), one
list holding the unacknowledged messages and one the latest ended turns. The first
list holds exactly server seqs `peer_acked + 1 .. next_seq - 1`, so it needs no seq
per entry. Every write is one Lua
script: the epoch check (fencing), the bound check and the change are atomic.
"""

from __future__ import annotations

import math
from typing import Any

from redis.asyncio import Redis

from portico.errors import BufferOverflow, ProtocolViolation, ResumeFailed, SessionMoved
from portico.health import Health, probe
from portico.sessionstate.base import (
    ENDED_TURNS_KEPT,
    BufferLimits,
    SessionHeader,
    SessionSnapshot,
)

_MISSING, _MOVED, _OVERFLOW, _OUT_OF_ORDER = -1, -2, -3, -4
# A session nobody resumed is forgotten by Redis itself this long after its window's
# deadline (the replica whose timer would remove it may be dead); until then, and
# after, a resume gets the same RESUME_FAILED.
EXPIRY_GRACE_MS = 60_000

# KEYS[1] the hash, KEYS[2] the buffer list; ARGV[1] the caller's epoch.
_FENCE = """
local e = redis.call('HGET', KEYS[1], 'epoch')
if not e then return -1 end
if tonumber(e) ~= tonumber(ARGV[1]) then return -2 end
"""

# A ledger created over an older one carries its epoch on: the old holders stay fenced.
_CREATE = """
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') + 1
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'epoch', epoch, 'next_seq', 1, 'handled', 0, 'peer_acked', 0,
           'bytes', 0, 'capabilities', ARGV[1])
return epoch
"""

_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
redis.call('HDEL', KEYS[1], 'window')
for i = 1, 3 do redis.call('PERSIST', KEYS[i]) end
return redis.call('HINCRBY', KEYS[1], 'epoch', 1)
"""

# ARGV: epoch, seq, data, max_messages, max_bytes, ended turn ('' for none), turns kept,
# expiry grace (ms)
_SENT = (
    _FENCE
    + """
local nxt = tonumber(redis.call('HGET', KEYS[1], 'next_seq'))
if tonumber(ARGV[2]) ~= nxt then return -4 end
local size = string.len(ARGV[3])
local held = tonumber(redis.call('HGET', KEYS[1], 'bytes'))
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[4]) or held + size > tonumber(ARGV[5]) then
  return -3
end
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'next_seq', nxt + 1, 'bytes', held + size)
if ARGV[6] ~= '' then
  redis.call('LPUSH', KEYS[3], ARGV[6])
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[7]) - 1)
end
local window = redis.call('HGET', KEYS[1], 'window')
if window then
  -- Written while no connection holds the session: expire with it (as _WINDOW set).
  local expiry = math.floor(tonumber(window) * 1000) + tonumber(ARGV[8])
  redis.call('PEXPIREAT', KEYS[2], expiry)
  if ARGV[6] ~= '' then redis.call('PEXPIREAT', KEYS[3], expiry) end
end
return 1
"""
)

# ARGV: epoch, seq
_ACK = (
    _FENCE
    + """
local seq = tonumber(ARGV[2])
if seq >= tonumber(redis.call('HGET', KEYS[1], 'next_seq')) then return -4 end
local acked = tonumber(redis.call('HGET', KEYS[1], 'peer_acked'))
if seq <= acked then return 0 end
local freed = 0
for _, data in ipairs(redis.call('LRANGE', KEYS[2], 0, seq - acked - 1)) do
  freed = freed + string.len(data)
end
redis.call('LTRIM', KEYS[2], seq - acked, -1)
redis.call('HSET', KEYS[1], 'peer_acked', seq)
redis.call('HINCRBY', KEYS[1], 'bytes', -freed)
return 1
"""
)

# ARGV: epoch, seq, and optionally the capabilities replaced in the same step
_HANDLED = (
    _FENCE
    + """
local seq = tonumber(ARGV[2])
local handled = tonumber(redis.call('HGET', KEYS[1], 'handled'))
if seq <= handled then return 0 end
if seq ~= handled + 1 then return -4 end
redis.call('HSET', KEYS[1], 'handled', seq)
if ARGV[3] then redis.call('HSET', KEYS[1], 'capabilities', ARGV[3]) end
return 1
"""
)

# ARGV: epoch
_REMOVE = (
    _FENCE
    + """
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
return 1
"""
)

# ARGV: epoch, deadline ('' for none), expiry (unix ms: the deadline and the grace)
_WINDOW = (
    _FENCE
    + """
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], 'window')
  for i = 1, 3 do redis.call('PERSIST', KEYS[i]) end
else
  redis.call('HSET', KEYS[1], 'window', ARGV[2])
  for i = 1, 3 do redis.call('PEXPIREAT', KEYS[i], ARGV[3]) end
end
return 1
"""
)


class RedisSessionStates:
    def __init__(self, redis: Redis, limits: BufferLimits, *, prefix: str = "portico:") -> None:
        self._redis = redis
        self._limits = limits
        self._prefix = prefix
        self._create = redis.register_script(_CREATE)
        self._claim = redis.register_script(_CLAIM)
        self._sent = redis.register_script(_SENT)
        self._ack = redis.register_script(_ACK)
        self._handled = redis.register_script(_HANDLED)
        self._window = redis.register_script(_WINDOW)
        self._remove = redis.register_script(_REMOVE)

    def _keys(self, session_id: str) -> list[str]:
        key = f"{self._prefix}session:{session_id}"
        return [key, key + ":unacked", key + ":turns"]

    async def create(self, session_id: str, *, capabilities: bytes) -> int:
        return int(await self._create(keys=self._keys(session_id), args=[capabilities]))

    async def claim(self, session_id: str) -> int:
        return _checked(await self._claim(keys=self._keys(session_id)))

    async def load(self, session_id: str) -> SessionSnapshot | None:
        keys = self._keys(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(keys[0])
            pipe.lrange(keys[1], 0, -1)
            pipe.lrange(keys[2], 0, -1)
            fields, unacked, turns = await pipe.execute()
        if not fields:
            return None
        acked = int(fields[b"peer_acked"])
        window = fields.get(b"window")
        return SessionSnapshot(
            epoch=int(fields[b"epoch"]),
            next_seq=int(fields[b"next_seq"]),
            handled=int(fields[b"handled"]),
            peer_acked=acked,
            unacknowledged=tuple((acked + 1 + i, data) for i, data in enumerate(unacked)),
            capabilities=fields[b"capabilities"],
            window_deadline=None if window is None else float(window),
            ended_turns=tuple(turn.decode() for turn in turns),
        )

    async def header(self, session_id: str) -> SessionHeader | None:
        fields = await self._redis.hmget(
            self._keys(session_id)[0], "epoch", "capabilities", "window"
        )
        epoch, capabilities, window = fields
        if epoch is None:
            return None
        return SessionHeader(
            epoch=int(epoch),
            # Bytes: the client does not decode responses.
            capabilities=capabilities if isinstance(capabilities, bytes) else b"",
            window_deadline=None if window is None else float(window),
        )

    async def record_sent(
        self, session_id: str, epoch: int, seq: int, data: bytes, *, ends_turn: str = ""
    ) -> None:
        limits = self._limits
        args: list[bytes | int | str] = [
            epoch,
            seq,
            data,
            limits.max_messages,
            limits.max_bytes,
            ends_turn,
            ENDED_TURNS_KEPT,
            EXPIRY_GRACE_MS,
        ]
        _checked(await self._sent(keys=self._keys(session_id), args=args))

    async def record_ack(self, session_id: str, epoch: int, seq: int) -> None:
        _checked(await self._ack(keys=self._keys(session_id), args=[epoch, seq]))

    async def record_handled(
        self, session_id: str, epoch: int, seq: int, *, capabilities: bytes | None = None
    ) -> bool:
        args: list[bytes | int | str] = [epoch, seq]
        if capabilities is not None:
            args.append(capabilities)
        return _checked(await self._handled(keys=self._keys(session_id), args=args)) == 1

    async def set_window(self, session_id: str, epoch: int, deadline: float | None) -> None:
        args: list[bytes | int | str] = [epoch, "", 0]
        if deadline is not None:
            args = [epoch, repr(deadline), math.floor(deadline * 1000) + EXPIRY_GRACE_MS]
        _checked(await self._window(keys=self._keys(session_id), args=args))

    async def remove(self, session_id: str, epoch: int | None = None) -> None:
        if epoch is None:
            await self._redis.delete(*self._keys(session_id))
            return
        code = int(await self._remove(keys=self._keys(session_id), args=[epoch]))
        if code not in (_MISSING, _MOVED):  # gone or held by a newer epoch: nothing to do
            _checked(code)

    async def close(self) -> None:
        await self._redis.aclose()

    async def health(self, within: float) -> Health:
        return await probe(self._redis.ping(), within)


def _checked(result: Any) -> int:
    """A script's status as the error the port promises, or its (non-negative) value."""
    code = int(result)
    if code == _MISSING:
        raise ResumeFailed()
    if code == _MOVED:
        raise SessionMoved()
    if code == _OVERFLOW:
        raise BufferOverflow()
    if code == _OUT_OF_ORDER:
        raise ProtocolViolation("a seq out of order for this session")
    return code
