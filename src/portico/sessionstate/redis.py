"""Session state in Redis: any replica resumes a `/v1/session`, and it outlives its replica.

One hash per session (epoch, positions, buffered bytes, capabilities, window), one
list holding the unacknowledged messages and one the latest ended turns. The first
list holds exactly server seqs `peer_acked + 1 .. next_seq - 1`, so it needs no seq
per entry. Every write is one Lua
script: the epoch check (fencing), the bound check and the change are atomic.

No key lives for good. A session without a connection expires `expiry_grace` after
its window's deadline; one a connection holds expires `resume_window + expiry_grace`
after its holder's last write or renewal (every write of the holder sets it again,
and a task renews the idle ones every third of the grace). So a session whose
replica died while holding it is forgotten as if its connection had closed at the
holder's last renewal, and its client keeps at least a full resume window to resume
elsewhere.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from redis.asyncio import Redis

from portico.closing import CLOSE_TIMEOUT, close_within
from portico.core.periodic import every
from portico.errors import BufferOverflow, ProtocolViolation, ResumeFailed, SessionMoved
from portico.health import Health, probe
from portico.sessionstate.base import (
    ENDED_TURNS_KEPT,
    NO_MARK,
    BufferLimits,
    SessionHeader,
    SessionSnapshot,
    TurnMark,
)

_MISSING, _MOVED, _OVERFLOW, _OUT_OF_ORDER = -1, -2, -3, -4
# A session nobody resumed is forgotten by Redis itself this long after its window's
# deadline (the replica whose timer would remove it may be dead); until then, and
# after, a resume gets the same RESUME_FAILED. The `session_expiry_grace` default.
EXPIRY_GRACE_MS = 60_000
RESUME_WINDOW = 30.0  # the `resume_window` setting's default

# Sets the held session's expiry (`ttl` ms from now) unless no connection holds it
# (a window is set: the window's expiry stands).
_HOLD = """
local function hold(ttl)
  if redis.call('HEXISTS', KEYS[1], 'window') == 1 then return end
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ttl) end
end
"""

# KEYS[1] the hash, KEYS[2] the buffer list; ARGV[1] the caller's epoch.
_FENCE = """
local e = redis.call('HGET', KEYS[1], 'epoch')
if not e then return -1 end
if tonumber(e) ~= tonumber(ARGV[1]) then return -2 end
"""

# A ledger created over an older one carries its epoch on: the old holders stay fenced.
# ARGV: capabilities, the held expiry (ms)
_CREATE = """
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') + 1
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'epoch', epoch, 'next_seq', 1, 'handled', 0, 'peer_acked', 0,
           'bytes', 0, 'capabilities', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return epoch
"""

# ARGV: the held expiry (ms). Leaves the new epoch in `epoch`.
_TAKE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
redis.call('HDEL', KEYS[1], 'window')
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[1]) end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
"""
_CLAIM = _TAKE + "return epoch\n"
# A resume's claim and the snapshot it reads, one round trip: the hash's fields, the
# unacknowledged messages, the ended turns (what `load` reads, after the claim).
_CLAIM_LOAD = (
    _TAKE
    + """
return {redis.call('HGETALL', KEYS[1]), redis.call('LRANGE', KEYS[2], 0, -1),
        redis.call('LRANGE', KEYS[3], 0, -1)}
"""
)

# ARGV: epoch, seq, data, max_messages, max_bytes, ended turn ('' for none), turns kept,
# expiry grace (ms), held expiry (ms), and optionally the turn step the message ends
# ("turn_id step")
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
if ARGV[10] then redis.call('HSET', KEYS[1], 'last_step', ARGV[10]) end
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
else
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[9]) end
end
return 1
"""
)

# ARGV: epoch, seq, held expiry (ms)
_ACK = (
    _HOLD
    + _FENCE
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
hold(ARGV[3])
return 1
"""
)

# ARGV: epoch, seq, held expiry (ms), and optionally the capabilities replaced in the
# same step
_HANDLED = (
    _HOLD
    + _FENCE
    + """
local seq = tonumber(ARGV[2])
local handled = tonumber(redis.call('HGET', KEYS[1], 'handled'))
if seq <= handled then return 0 end
if seq ~= handled + 1 then return -4 end
redis.call('HSET', KEYS[1], 'handled', seq)
if ARGV[4] then redis.call('HSET', KEYS[1], 'capabilities', ARGV[4]) end
hold(ARGV[3])
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

# ARGV: epoch, deadline ('' for none), expiry (unix ms: the deadline and the grace; with
# no deadline, the held expiry in ms)
_WINDOW = (
    _FENCE
    + """
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], 'window')
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
else
  redis.call('HSET', KEYS[1], 'window', ARGV[2])
  for i = 1, 3 do redis.call('PEXPIREAT', KEYS[i], ARGV[3]) end
end
return 1
"""
)

# ARGV: epoch, held expiry (ms). 1: renewed; 0: a window is set (no connection holds it).
_RENEW = (
    _HOLD
    + _FENCE
    + """
if redis.call('HEXISTS', KEYS[1], 'window') == 1 then return 0 end
hold(ARGV[2])
return 1
"""
)


class RedisSessionStates:
    def __init__(
        self,
        redis: Redis,
        limits: BufferLimits,
        *,
        prefix: str = "portico:",
        resume_window: float = RESUME_WINDOW,
        expiry_grace: float = EXPIRY_GRACE_MS / 1000,
        close_timeout: float = CLOSE_TIMEOUT,
    ) -> None:
        self._redis = redis
        self._close_timeout = close_timeout
        self._limits = limits
        self._prefix = prefix
        self._grace_ms = max(1, math.ceil(expiry_grace * 1000))
        # A held session outlives its holder's last renewal as a closed one outlives
        # its close: a resume window, then the grace.
        self._held_ttl_ms = max(1, math.ceil((resume_window + expiry_grace) * 1000))
        # A third of the grace: a session is renewed at most two of these after its
        # last write, so its client keeps more than the resume window after a holder dies.
        self._renew_every = expiry_grace / 3
        self._create = redis.register_script(_CREATE)
        self._claim = redis.register_script(_CLAIM)
        self._claim_load = redis.register_script(_CLAIM_LOAD)
        self._sent = redis.register_script(_SENT)
        self._ack = redis.register_script(_ACK)
        self._handled = redis.register_script(_HANDLED)
        self._window = redis.register_script(_WINDOW)
        self._remove = redis.register_script(_REMOVE)
        self._renew = redis.register_script(_RENEW)
        # session -> (epoch held here, monotonic time its expiry was last set)
        self._held: dict[str, tuple[int, float]] = {}
        self._renewal: asyncio.Task[None] | None = None

    def _keys(self, session_id: str) -> list[str]:
        key = f"{self._prefix}session:{session_id}"
        return [key, key + ":unacked", key + ":turns"]

    async def create(self, session_id: str, *, capabilities: bytes) -> int:
        keys, since = self._keys(session_id), time.monotonic()
        epoch = int(await self._create(keys=keys, args=[capabilities, self._held_ttl_ms]))
        self._hold(session_id, epoch, since)
        return epoch

    async def claim(self, session_id: str) -> int:
        since = time.monotonic()
        epoch = _checked(await self._claim(keys=self._keys(session_id), args=[self._held_ttl_ms]))
        self._hold(session_id, epoch, since)
        return epoch

    async def claim_and_load(self, session_id: str) -> SessionSnapshot:
        since = time.monotonic()
        found: Any = await self._claim_load(keys=self._keys(session_id), args=[self._held_ttl_ms])
        if not isinstance(found, list):
            _checked(found)  # the session is gone: ResumeFailed
        flat, unacked, turns = found
        snapshot = _snapshot(dict(zip(flat[::2], flat[1::2], strict=True)), unacked, turns)
        self._hold(session_id, snapshot.epoch, since)
        return snapshot

    async def load(self, session_id: str) -> SessionSnapshot | None:
        keys = self._keys(session_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(keys[0])
            pipe.lrange(keys[1], 0, -1)
            pipe.lrange(keys[2], 0, -1)
            fields, unacked, turns = await pipe.execute()
        return _snapshot(fields, unacked, turns) if fields else None

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
        self, session_id: str, epoch: int, seq: int, data: bytes, mark: TurnMark = NO_MARK
    ) -> None:
        limits = self._limits
        args: list[bytes | int | str] = [
            epoch,
            seq,
            data,
            limits.max_messages,
            limits.max_bytes,
            mark.ends,
            ENDED_TURNS_KEPT,
            self._grace_ms,
            self._held_ttl_ms,
        ]
        if mark.step is not None:
            args.append(f"{mark.step[0]} {mark.step[1]}")
        await self._held_write(session_id, epoch, self._sent, args)

    async def record_ack(self, session_id: str, epoch: int, seq: int) -> None:
        await self._held_write(session_id, epoch, self._ack, [epoch, seq, self._held_ttl_ms])

    async def record_handled(
        self, session_id: str, epoch: int, seq: int, *, capabilities: bytes | None = None
    ) -> bool:
        args: list[bytes | int | str] = [epoch, seq, self._held_ttl_ms]
        if capabilities is not None:
            args.append(capabilities)
        return await self._held_write(session_id, epoch, self._handled, args) == 1

    async def set_window(self, session_id: str, epoch: int, deadline: float | None) -> None:
        args: list[bytes | int | str] = [epoch, "", self._held_ttl_ms]
        if deadline is not None:
            args = [epoch, repr(deadline), math.floor(deadline * 1000) + self._grace_ms]
        since = time.monotonic()
        await self._held_write(session_id, epoch, self._window, args)
        if deadline is None:
            self._hold(session_id, epoch, since)
        else:
            self._let_go(session_id, epoch)  # the window's expiry stands: no renewal

    async def remove(self, session_id: str, epoch: int | None = None) -> None:
        self._let_go(session_id, epoch)
        if epoch is None:
            await self._redis.delete(*self._keys(session_id))
            return
        code = int(await self._remove(keys=self._keys(session_id), args=[epoch]))
        if code not in (_MISSING, _MOVED):  # gone or held by a newer epoch: nothing to do
            _checked(code)

    async def close(self) -> None:
        # The held sessions keep their expiry: another replica may resume them. The
        # renewal and the client are waited for within one bound: a renewal cancelled
        # mid-pipeline can leave redis-py's connection stuck.
        renewal = () if self._renewal is None else (self._renewal,)
        await close_within("session state", self._redis, self._close_timeout, renewal)

    async def health(self, within: float) -> Health:
        return await probe(self._redis.ping(), within)

    # -- the held sessions' expiry ------------------------------------------------------------

    async def _held_write(self, session_id: str, epoch: int, script: Any, args: list[Any]) -> int:
        """Run a fenced write that also sets a held session's expiry; note the renewal,
        or let go of a session another epoch took."""
        since = time.monotonic()  # the expiry counts from the script, not its answer
        try:
            code = _checked(await script(keys=self._keys(session_id), args=args))
        except (ResumeFailed, SessionMoved):
            self._let_go(session_id, epoch)
            raise
        if self._held.get(session_id, (0, 0.0))[0] == epoch:
            self._held[session_id] = (epoch, since)
        return code

    def _hold(self, session_id: str, epoch: int, since: float) -> None:
        self._held[session_id] = (epoch, since)
        if self._renewal is None:
            self._renewal = asyncio.get_running_loop().create_task(
                every(self._renew_every, "session state renewal", self._renew_idle, at_once=False),
                name="session-state-renewal",
            )

    def _let_go(self, session_id: str, epoch: int | None) -> None:
        held = self._held.get(session_id)
        if held is not None and (epoch is None or held[0] == epoch):
            del self._held[session_id]

    async def _renew_idle(self) -> None:
        """Renew the held sessions no write renewed for a third of the grace, in one
        pipeline; one a newer epoch or a window took is let go."""
        now = time.monotonic()
        due = [(sid, e) for sid, (e, at) in self._held.items() if at <= now - self._renew_every]
        if not due:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for session_id, epoch in due:
                await self._renew(
                    keys=self._keys(session_id), args=[epoch, self._held_ttl_ms], client=pipe
                )
            results = await pipe.execute(raise_on_error=False)
        for (session_id, epoch), result in zip(due, results, strict=True):
            if isinstance(result, Exception):
                continue  # the next round tries again
            if int(result) == 1:
                if self._held.get(session_id, (0, 0.0))[0] == epoch:
                    self._held[session_id] = (epoch, now)
            else:
                self._let_go(session_id, epoch)


def _snapshot(
    fields: dict[bytes, bytes], unacked: list[bytes], turns: list[bytes]
) -> SessionSnapshot:
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
        last_step=_step(fields.get(b"last_step")),
    )


def _step(field: bytes | None) -> tuple[str, int]:
    """`last_step` as `record_sent` wrote it ("turn_id step")."""
    if not field:
        return ("", 0)
    turn_id, _, step = field.decode().rpartition(" ")
    return (turn_id, int(step))


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
