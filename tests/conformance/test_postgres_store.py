"""`portico serve --store postgres`: a real server archiving to PostgreSQL, on a schema
of its own, a restart that keeps the conversation, and two replicas sharing it."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import pytest

from portico.domain.model import Message, Turn
from portico.domain.states import TurnState
from portico.store.postgres import PostgresStore
from support.omnia import OmniaClient, scenario
from support.postgres import create_schema, drop_schemas, require_postgres, schema_url
from support.server import SCRIPT, ServerProcess, run_cli
from support.tcprelay import TcpRelay


@pytest.fixture
async def database_url() -> AsyncIterator[str]:
    require_postgres()
    schema = await create_schema()
    try:
        yield schema_url(schema)
    finally:
        await drop_schemas([schema])


async def settled_messages(url: str, session_id: str, count: int) -> list[Message]:
    """The session's messages once `count` are archived and none is still being written
    (the server archives a reply after its last frame)."""
    store = PostgresStore(url, pool_size=1)
    await store.open()
    try:
        deadline = time.monotonic() + 10.0
        while True:
            messages = await store.list_messages(session_id)
            settled = all(m.status not in ("pending", "streaming") for m in messages)
            if (len(messages) >= count and settled) or time.monotonic() > deadline:
                return messages
            await asyncio.sleep(0.05)
    finally:
        await store.close()


async def turns_once(
    url: str, session_id: str, done: Callable[[list[Turn]], bool], within: float
) -> tuple[list[Turn], float]:
    """The session's turns as soon as `done` holds for them (or after `within` seconds),
    and how long that took."""
    store = PostgresStore(url, pool_size=1)
    await store.open()
    try:
        start = time.monotonic()
        while True:
            turns = await store.list_turns(session_id)
            waited = time.monotonic() - start
            if done(turns) or waited > within:
                return turns, waited
            await asyncio.sleep(0.05)
    finally:
        await store.close()


async def test_a_postgres_server_archives_turns_and_keeps_them_across_a_restart(
    http: aiohttp.ClientSession, tmp_path: Path, database_url: str
) -> None:
    server = ServerProcess(
        tmp_path / "data",
        args=("--store", "postgres", "--runtime", "scripted", "--script", str(SCRIPT)),
        env={"PORTICO_DATABASE_URL": database_url},
    ).start()
    try:
        client = OmniaClient(await http.ws_connect(server.ws_url))
        session_id = (await client.connected())["session_id"]
        frames = await client.ask("hello")
        assert frames[-1]["type"] == "done"
        await client.ws.close()
        first = await settled_messages(database_url, session_id, 2)
        assert [(m.global_offset, m.role, m.status) for m in first] == [
            (1, "user", "completed"),
            (2, "assistant", "completed"),
        ]
        assert (first[0].content, first[1].content) == ("hello", "Hello world")
        assert not (tmp_path / "data" / "archive.sqlite3").exists()

        server.restart()
        resumed = OmniaClient(await http.ws_connect(server.ws_url))
        await resumed.connected()
        again = await resumed.ask("again", session_id=session_id)
        assert {frame["session_id"] for frame in again} == {session_id}
        assert again[-1]["type"] == "done"
        await resumed.ws.close()
        messages = await settled_messages(database_url, session_id, 4)
        assert messages[:2] == first
        assert [(m.global_offset, m.content) for m in messages[2:]] == [
            (3, "again"),
            (4, "Hello world"),
        ]
    finally:
        server.stop()


async def test_a_pooled_read_gives_its_connection_back_without_a_reset_round_trip(
    database_url: str,
) -> None:
    """asyncpg's default reset (`... RESET ALL;`) cost every pooled read, a turn's
    session lookup among them, a second round trip; the archive keeps no session
    state on its connections that it would undo (postgres.py, `_keep_session`)."""
    url = urlsplit(database_url)
    async with TcpRelay(url.port or 5432, url.hostname or "127.0.0.1") as relay:
        user = f"{url.username}@" if url.username else ""
        through = urlunsplit(url._replace(netloc=f"{user}127.0.0.1:{relay.port}"))
        store = PostgresStore(through, pool_size=1)
        await store.open()
        try:
            relay.sent.clear()
            for _ in range(2):
                assert await store.get_session("ses_nowhere") is None
        finally:
            await store.close()
    assert b"sessions" in relay.sent  # the reads went through the relay
    assert b"RESET ALL" not in relay.sent


def test_config_show_masks_the_database_password() -> None:
    url = "postgresql://portico:s3cret@db.internal:5432/archive"
    result = run_cli("config", "show", "--store", "postgres", env={"PORTICO_DATABASE_URL": url})
    assert result.returncode == 0, result.stderr
    assert "database_url: postgresql://portico:***@db.internal:5432/archive" in result.stdout
    assert "s3cret" not in result.stdout


def test_serve_on_an_unreachable_database_exits_with_one_line() -> None:
    url = "postgresql://portico:s3cret@127.0.0.1:1/archive"
    result = run_cli(
        "serve", "--store", "postgres", "--port", "0", env={"PORTICO_DATABASE_URL": url}
    )
    assert result.returncode == 1
    assert "cannot open the PostgreSQL archive" in result.stderr
    assert "Traceback" not in result.stderr
    assert "s3cret" not in result.stderr


LEASE = 1.0  # seconds: short, so a dead replica is noticed quickly


def replica(tmp_path: Path, name: str, database_url: str) -> ServerProcess:
    return ServerProcess(
        tmp_path / name,
        args=("--store", "postgres", "--runtime", "scripted", "--script", str(SCRIPT)),
        env={
            "PORTICO_DATABASE_URL": database_url,
            "PORTICO_REPLICA_ID": name,
            "PORTICO_REPLICA_LEASE": str(LEASE),
            # A held tool call must outlast B's start on a loaded machine (CI saw B take
            # longer than the 5 s an unacknowledged call waits, and the turn ended first).
            "PORTICO_TOOL_ACK_TIMEOUT": "300",
            "PORTICO_CLIENT_TOOL_TIMEOUT": "300",
        },
    )


def running(turns: list[Turn]) -> bool:
    return bool(turns) and turns[-1].state is TurnState.RUNNING


async def test_replicas_spare_each_others_turns_until_one_dies(
    http: aiohttp.ClientSession, tmp_path: Path, database_url: str
) -> None:
    a = replica(tmp_path, "rep-a", database_url).start()
    b = replica(tmp_path, "rep-b", database_url)
    try:
        client = OmniaClient(await http.ws_connect(a.ws_url))
        session_id = (await client.connected())["session_id"]
        # The turn waits for the client's tool result, so it runs for as long as B takes
        # to start on a loaded machine (a timed scenario could end first).
        await client.send({"type": "message", "content": "held", **scenario("tool")})
        call = await client.recv()
        assert call["type"] == "tool_call", call
        await turns_once(database_url, session_id, running, 10.0)

        # B starts (and sweeps) while A's turn runs: the turn is A's, and A is alive.
        b.start()
        turns, _ = await turns_once(database_url, session_id, running, 0.0)
        assert [(t.state, t.replica) for t in turns] == [(TurnState.RUNNING, "rep-a")]
        call_id = call["tool_call"]["id"]
        await client.send({"type": "tool_result", "tool_result": {"call_id": call_id, "result": 1}})
        frames = await client.turn(within=15.0)
        assert frames[-1]["type"] == "done"
        turns, _ = await turns_once(database_url, session_id, lambda t: not running(t), 10.0)
        assert turns[-1].state is TurnState.COMPLETED

        # A dies under its next turn: B interrupts it once A's lease has run out.
        await client.send({"type": "message", "content": "slow", **scenario("lingering")})
        await client.recv()
        await turns_once(database_url, session_id, lambda t: len(t) == 2 and running(t), 10.0)
        a.stop(signal.SIGKILL)
        turns, waited = await turns_once(
            database_url, session_id, lambda t: not running(t), 2 * LEASE + 2.0
        )
        assert (turns[-1].state, turns[-1].replica) == (TurnState.INTERRUPTED, "rep-a")
        assert waited <= 2 * LEASE + 1.0  # a lease, then B's next sweep
        messages = await settled_messages(database_url, session_id, 4)
        # The second turn's: its message, and its reply failed by the interruption.
        assert [(m.role, m.status) for m in messages[-2:]] == [
            ("user", "completed"),
            ("assistant", "failed"),
        ]
    finally:
        a.stop()
        b.stop()
