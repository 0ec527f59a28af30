"""The Redis bus: one Redis Stream per topic and per replica inbox.

Streams, not pub/sub: a reader holds its last id, so a slow consumer loses nothing
(up to `max_len` entries kept) and a reader whose connection broke (Redis restarted)
reconnects and reads on from its id, each entry once. An inbox is read through a
consumer group with XACK so a control message is delivered to its replica once.

An inbox lives as long as its replica: the replica reading it sets its expiry to
`inbox_ttl` and renews it every third of that while it reads, so the inbox of a
replica gone for good (its id never used again) leaves Redis `inbox_ttl` after the
replica stopped. A sender never renews it: its expiry is set only on an inbox that
has none (one the send itself created), so messages for a dead replica cannot keep
its inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from portico.bus.port import Entry
from portico.closing import CLOSE_TIMEOUT, close_within
from portico.health import Health, probe

log = logging.getLogger("portico.bus")
_GROUP = "replica"
TOPIC_TTL = 24 * 3600.0  # seconds a topic's stream outlives its last entry
INBOX_TTL = 300.0  # seconds a replica's inbox outlives the replica's last renewal
PUBLISH_TIMEOUT = 5.0  # seconds a publish may take (redis-py's default socket timeout)


class RedisBus:
    def __init__(
        self,
        url: str,
        prefix: str = "portico:",
        max_len: int = 10_000,
        block: float = 1.0,
        topic_ttl: float | None = TOPIC_TTL,
        inbox_ttl: float | None = INBOX_TTL,
        close_timeout: float = CLOSE_TIMEOUT,
    ) -> None:
        """`topic_ttl`: seconds a topic's stream is kept after its last entry (None:
        until trimmed), so the streams of sessions long over do not pile up in Redis.
        `inbox_ttl`: seconds a replica's inbox is kept after its reader last renewed
        it (None: for ever); it should be several times `block` (renewed between
        reads). `close_timeout`: longest `close` waits for the client (`close_within`)."""
        # Replies are handled as Any: redis-py types them as a union of sync and async.
        self._redis: Any = aioredis.from_url(url)
        # Publishing has a client of its own, with no socket timeout: redis-py bounds a
        # write with `asyncio.wait_for`, which on Python 3.11 runs it as a task of its
        # own, so the entries went out one loop step late, behind whatever that step
        # ran (the rest of a turn's burst of chunks, the archive's writer). The publish
        # is bounded here instead (`PUBLISH_TIMEOUT`).
        self._publisher: Any = aioredis.from_url(url, socket_timeout=None)
        self._prefix = prefix
        self._max_len = max_len
        self._block_ms = max(1, int(block * 1000))
        self._ttl = None if topic_ttl is None else max(1, int(topic_ttl))
        self._inbox_ttl_ms = None if inbox_ttl is None else max(1, int(inbox_ttl * 1000))
        self._close_timeout = close_timeout

    def _key(self, kind: str, name: str) -> str:
        return f"{self._prefix}{kind}:{name}"

    async def publish(self, topic: str, payload: bytes) -> str:
        return (await self.publish_batch([(topic, payload)]))[0]

    async def publish_batch(self, entries: Sequence[tuple[str, bytes]]) -> list[str]:
        # One pipeline, no transaction: the XADDs run in order, one round trip in all.
        pipe = self._publisher.pipeline(transaction=False)
        keys = [self._key("topic", topic) for topic, _ in entries]
        for key, (_, payload) in zip(keys, entries, strict=True):
            pipe.xadd(key, {b"p": payload}, maxlen=self._max_len, approximate=True)
        if self._ttl is not None:
            for key in dict.fromkeys(keys):
                pipe.expire(key, self._ttl)
        async with asyncio.timeout(PUBLISH_TIMEOUT):
            replies = await pipe.execute()
        return [p.decode() if isinstance(p, bytes) else str(p) for p in replies[: len(entries)]]

    async def subscribe(self, topic: str, after: str = "") -> AsyncIterator[Entry]:
        key = self._key("topic", topic)
        last = after or await self._last_id(key)
        while True:
            try:
                batches = await self._redis.xread({key: last}, block=self._block_ms)
            except RedisConnectionError:
                log.warning("bus read failed topic=%s; retrying from %s", topic, last)
                await asyncio.sleep(self._block_ms / 1000)
                continue
            for _, entries in batches or ():
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    yield Entry(last, fields[b"p"])
                # What the entries woke (their sockets' flushes) runs before redis-py
                # builds and sends the next read, not after it.
                await asyncio.sleep(0)

    async def _last_id(self, key: str) -> str:
        entries = await self._redis.xrevrange(key, count=1)
        return entries[0][0].decode() if entries else "0-0"

    async def last_position(self, topic: str) -> str:
        return await self._last_id(self._key("topic", topic))

    async def recent(self, topic: str, count: int) -> list[Entry]:
        if count <= 0:
            return []
        entries = await self._redis.xrevrange(self._key("topic", topic), count=count)
        return [Entry(entry_id.decode(), fields[b"p"]) for entry_id, fields in entries]

    async def send(self, replica: str, payload: bytes) -> None:
        key = self._key("inbox", replica)
        if self._inbox_ttl_ms is None:
            await self._redis.xadd(key, {b"p": payload}, maxlen=self._max_len, approximate=True)
            return
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(key, {b"p": payload}, maxlen=self._max_len, approximate=True)
        # NX: an expiry only where there is none (an inbox this send created), never
        # renewed by senders: only the replica reading it keeps it.
        pipe.pexpire(key, self._inbox_ttl_ms, nx=True)
        await pipe.execute()

    async def inbox(self, replica: str) -> AsyncIterator[bytes]:
        key = self._key("inbox", replica)
        await self._ensure_group(key)
        loop = asyncio.get_running_loop()
        renew_at = 0.0  # at once
        while True:
            try:
                if self._inbox_ttl_ms is not None and loop.time() >= renew_at:
                    await self._redis.pexpire(key, self._inbox_ttl_ms)
                    renew_at = loop.time() + self._inbox_ttl_ms / 3000
                batches = await self._redis.xreadgroup(
                    _GROUP, replica, {key: ">"}, block=self._block_ms
                )
            except (RedisConnectionError, ResponseError):
                # A restarted Redis without persistence lost the group: create it again
                # (and the inbox's expiry with it).
                await asyncio.sleep(self._block_ms / 1000)
                await self._ensure_group_quietly(key)
                renew_at = 0.0
                continue
            for _, entries in batches or ():
                for entry_id, fields in entries:
                    await self._redis.xack(key, _GROUP, entry_id)
                    yield fields[b"p"]

    async def _ensure_group(self, key: str) -> None:
        try:
            await self._redis.xgroup_create(key, _GROUP, id="0", mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    async def _ensure_group_quietly(self, key: str) -> None:
        with contextlib.suppress(RedisConnectionError):
            await self._ensure_group(key)

    async def health(self, within: float) -> Health:
        return await probe(self._redis.ping(), within)

    async def close(self) -> None:
        await asyncio.gather(
            close_within("bus", self._redis, self._close_timeout),
            close_within("bus publisher", self._publisher, self._close_timeout),
        )
