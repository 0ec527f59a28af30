"""`/v1/session` exactly-once across 200 random drops, with every reconnect going
through round-robin HAProxy to whichever of three replicas is next (issue 16).

SDK clients (`SessionClient`, which resumes by itself) talk through the fault proxy to
the balancer, which has no stickiness; the chaos task cuts a random open connection
until it has cut `CUTS` of them, so the resumes land on every replica, the session
state each one finds in Redis. Seeded and bounded in time and count. The ledger, both
ways: every server message delivered once and in order (seqs exactly 1..n), every
reply whole, chunk by chunk; every message the clients sent archived once, every turn completed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from portico.client import SessionClient
from portico.domain.states import TurnState
from portico.protocols.session import frames as f
from support.faultproxy import FaultProxy
from support.postgres import schema_url
from support.replicas import Replicas, balanced_replicas
from support.session_clients import session_clients
from support.session_ledger import archived

CLIENTS = 10
CUTS = 200  # connections the chaos task cuts
MOST_MESSAGES = 400  # per client: a bound on the conversation, not a target
SEED = 20261207
DEADLINE = 90.0  # seconds for the whole run, a bound, not a measure

Chat = tuple[str, int, list[int]]  # the session, how many messages, every delivered seq


@pytest.fixture
async def balanced(tmp_path: Path) -> AsyncIterator[tuple[Replicas, str]]:
    rates = {"PORTICO_RATE_LIMIT_MESSAGES": "1000", "PORTICO_RATE_LIMIT_BURST": "1000"}
    async with balanced_replicas(tmp_path, rates) as group_and_schema:
        yield group_and_schema


async def chat(
    client: SessionClient, index: int, stop: asyncio.Event
) -> tuple[str, int, list[int]]:
    """Messages until the chaos is over: the session, how many, every delivered seq."""
    seqs: list[int] = []
    count = 0
    while not stop.is_set() and count < MOST_MESSAGES:
        text = f"client-{index} message-{count} says hello"  # four distinct words
        reply = await client.ask(text, metadata={"mock_scenario": "echo"})
        assert reply.text == text, (index, count, reply.frames)  # the `done`: whole
        # The echo scenario's chunks are its words: every one, once and in order, also
        # when the session moved to another replica while the turn ran (the new holder
        # replays from the bus what the old one had not recorded).
        chunks = [frame.content.strip() for frame in reply.frames if isinstance(frame, f.Chunk)]
        assert chunks == text.split(" "), (index, count, reply.frames)
        seqs += [frame.seq or 0 for frame in reply.frames]
        count += 1
    return client.session_id or "", count, seqs


async def chaos(proxy: FaultProxy, rng: random.Random, chats: list[asyncio.Task[Chat]]) -> int:
    cuts = 0
    while cuts < CUTS:
        await asyncio.sleep(rng.uniform(0.01, 0.08))
        for task in chats:
            if task.done():
                task.result()  # a client that failed fails the test now, with its error
                raise AssertionError("a client stopped before the chaos was over")
        open_connections = [c for c in proxy.connections if c.open]
        if open_connections:
            await rng.choice(open_connections).cut()
            cuts += 1
    return cuts


async def test_two_hundred_random_drops_across_replicas_lose_nothing_and_repeat_nothing(
    balanced: tuple[Replicas, str],
) -> None:
    group, schema = balanced
    rng = random.Random(SEED)
    async with (
        FaultProxy(group.url) as proxy,
        session_clients(proxy.url("/v1/session"), CLIENTS) as clients,
    ):
        stop = asyncio.Event()
        async with asyncio.timeout(DEADLINE):
            chats = [asyncio.create_task(chat(c, i, stop)) for i, c in enumerate(clients)]
            cuts = await chaos(proxy, rng, chats)
            stop.set()
            results = await asyncio.gather(*chats)
    assert cuts == CUTS
    assert len(proxy.connections) > CLIENTS + CUTS // 2  # the clients came back each time
    for index, (session_id, count, seqs) in enumerate(results):
        assert count > 0
        # Server to client: every numbered message once, in order, 1..n.
        assert seqs == list(range(1, len(seqs) + 1)), (index, seqs)
        # Client to server: each message archived once, each with its one reply.
        messages, turns = await archived(schema_url(schema), session_id, 2 * count)
        expected = [f"client-{index} message-{n} says hello" for n in range(count)]
        assert [m.content for m in messages] == [t for text in expected for t in (text, text)]
        assert [m.global_offset for m in messages] == list(range(1, 2 * count + 1))
        assert [t.state for t in turns] == [TurnState.COMPLETED] * count
