"""50 SDK clients chat through the fault proxy while it cuts connections at random.

Seeded and bounded in time and count; every reply must arrive exactly once,
byte-exact, and the archive must hold each message and reply exactly once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest

from portico.client import SessionClient
from portico.domain.states import TurnState
from portico.protocols.session import frames as f
from support.archive import open_archive
from support.faultproxy import FaultProxy
from support.redis import SESSION_STATES, session_state
from support.server import SCRIPT, ServerProcess
from support.session_clients import session_clients

CLIENTS = 50
MESSAGES = 4  # per client
WORDS = 6  # in each message: the echo reply is 6 chunks and a done
CUTS = 40  # connections the chaos task cuts, at most
SEED = 20261130
DEADLINE = 90.0  # seconds for the whole conversation, a bound, not a measure


@pytest.fixture(scope="module", params=SESSION_STATES)
def stress_server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    with session_state(request.param) as state_env:
        process = ServerProcess(
            tmp_path_factory.mktemp("portico-stress"),
            args=("--runtime", "scripted", "--script", str(SCRIPT)),
            env={
                "PORTICO_RESUME_WINDOW": "60",
                "PORTICO_RATE_LIMIT_MESSAGES": "1000",
                "PORTICO_RATE_LIMIT_BURST": "1000",
                **state_env,
            },
        ).start()
        yield process
        process.stop()


async def chat(client: SessionClient, index: int) -> tuple[str, list[str], list[int]]:
    """The session, its replies, and the seq of every frame the client delivered."""
    replies, seqs = [], []
    for n in range(MESSAGES):
        text = f"client {index} message {n} says hello"
        reply = await client.ask(text, metadata={"mock_scenario": "echo"})
        replies.append(reply.text)
        seqs += [frame.seq or 0 for frame in reply.frames]
        # The echo scenario: one chunk per word, then done; never a chunk twice.
        chunks = [frame.content for frame in reply.frames if isinstance(frame, f.Chunk)]
        assert "".join(chunks) == text, chunks
    return client.session_id or "", replies, seqs


async def chaos(proxy: FaultProxy, rng: random.Random, stop: asyncio.Event) -> int:
    cuts = 0
    while cuts < CUTS and not stop.is_set():
        await asyncio.sleep(rng.uniform(0.02, 0.15))
        open_connections = [c for c in proxy.connections if c.open]
        if open_connections:
            await rng.choice(open_connections).cut()
            cuts += 1
    return cuts


async def test_fifty_clients_with_random_drops_get_every_reply_exactly_once(
    stress_server: ServerProcess,
) -> None:
    rng = random.Random(SEED)
    async with (
        FaultProxy(stress_server.http_url) as proxy,
        session_clients(proxy.url("/v1/session"), CLIENTS) as clients,
    ):
        stop = asyncio.Event()
        cutter = asyncio.create_task(chaos(proxy, rng, stop))
        async with asyncio.timeout(DEADLINE):
            results = await asyncio.gather(*(chat(c, i) for i, c in enumerate(clients)))
        stop.set()
        cuts = await cutter
    assert cuts > 0
    async with open_archive(stress_server.archive_path) as store:
        for index, (session_id, replies, seqs) in enumerate(results):
            expected = [f"client {index} message {n} says hello" for n in range(MESSAGES)]
            assert replies == expected
            # Every server message delivered once, in order: seqs exactly 1..n.
            assert seqs == list(range(1, len(seqs) + 1)), (index, seqs)
            assert len(seqs) == MESSAGES * (WORDS + 1)
            messages = await store.list_messages(session_id)
            assert [m.content for m in messages] == [t for text in expected for t in (text, text)]
            assert [m.global_offset for m in messages] == list(range(1, 2 * MESSAGES + 1))
            assert len({m.id for m in messages}) == len(messages)
            turns = await store.list_turns(session_id)
            assert len(turns) == MESSAGES
            assert {turn.state for turn in turns} == {TurnState.COMPLETED}
