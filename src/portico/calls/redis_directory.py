"""The call directory in Redis: a `?resume` on any replica finds the call (docs/replicas.md).

One hash per session (`{prefix}call:{session id}`: owner, token, until, the encoded
record). Every conditional change is one Lua script, so a claim racing another claim,
a park or a drop is decided in one step. A live call's record lives `live_ttl` seconds
and its replica renews it every third of that: a replica killed with a live call
leaves a record that lapses by itself. A parked call's record lapses at its window's end.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import msgspec
from redis.asyncio import Redis

from portico.calls.directory import CallRecord
from portico.closing import CLOSE_TIMEOUT, close_within
from portico.core.periodic import every

log = logging.getLogger("portico.calls")

# ARGV: the claimant, now (wall clock). The record's data and window, or nil.
_CLAIM = """
local v = redis.call('HMGET', KEYS[1], 'owner', 'until', 'data')
if not v[1] or v[1] ~= ARGV[1] then return false end
if v[2] ~= '' and tonumber(ARGV[2]) >= tonumber(v[2]) then return false end
redis.call('DEL', KEYS[1])
return {v[3], v[2]}
"""

# ARGV: token, until, expiry (unix ms)
_PARK = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'until', ARGV[2])
redis.call('PEXPIREAT', KEYS[1], ARGV[3])
return 1
"""

_DROP = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""

# ARGV: token, ttl (ms). Only a live record of this holding is renewed.
_RENEW = """
local v = redis.call('HMGET', KEYS[1], 'token', 'until')
if v[1] ~= ARGV[1] or v[2] ~= '' then return 0 end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CallRecord)


class RedisCallDirectory:
    def __init__(
        self,
        redis: Redis,
        *,
        prefix: str = "portico:",
        live_ttl: float,
        close_timeout: float = CLOSE_TIMEOUT,
    ) -> None:
        self._redis = redis
        self._close_timeout = close_timeout
        self._prefix = prefix
        self._live_ttl_ms = max(1, math.ceil(live_ttl * 1000))
        self._renew_every = live_ttl / 3
        self._claim = redis.register_script(_CLAIM)
        self._park = redis.register_script(_PARK)
        self._drop = redis.register_script(_DROP)
        self._renew = redis.register_script(_RENEW)
        self._live: dict[str, str] = {}  # session -> token of the live calls this one renews
        self._renewal: asyncio.Task[None] | None = None

    def _key(self, session_id: str) -> str:
        return f"{self._prefix}call:{session_id}"

    async def register(self, record: CallRecord) -> None:
        key = self._key(record.session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(
                key,
                mapping={
                    "owner": record.owner,
                    "token": record.token,
                    "until": "",
                    "data": _encoder.encode(record),
                },
            )
            pipe.pexpire(key, self._live_ttl_ms)
            await pipe.execute()
        self._live[record.session_id] = record.token
        if self._renewal is None:
            self._renewal = asyncio.create_task(
                every(self._renew_every, "call directory renewal", self._renew_all, at_once=False),
                name="call-directory-renewal",
            )

    async def park(self, session_id: str, token: str, until: float) -> None:
        if self._live.get(session_id) == token:
            del self._live[session_id]
        expiry = math.ceil(until * 1000)
        await self._park(keys=[self._key(session_id)], args=[token, repr(until), expiry])

    async def claim(self, session_id: str, principal: str, now: float) -> CallRecord | None:
        found: Any = await self._claim(keys=[self._key(session_id)], args=[principal, repr(now)])
        if not found:
            return None
        data, until = found
        record = _decoder.decode(data)
        return msgspec.structs.replace(record, until=float(until) if until else None)

    async def drop(self, session_id: str, token: str) -> None:
        if self._live.get(session_id) == token:
            del self._live[session_id]
        await self._drop(keys=[self._key(session_id)], args=[token])

    async def _renew_all(self) -> None:
        if not self._live:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for session_id, token in self._live.items():
                await self._renew(
                    keys=[self._key(session_id)], args=[token, self._live_ttl_ms], client=pipe
                )
            await pipe.execute()

    async def close(self) -> None:
        renewal = () if self._renewal is None else (self._renewal,)
        await close_within("call directory", self._redis, self._close_timeout, renewal)
