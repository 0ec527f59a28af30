"""`/v1/rpc` update recovery across restarts, kills, retention and a reset archive."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.conformance import rpc_url, start_rpc_server
from support.rpc import RpcProbe
from support.server import ServerProcess

SHORT_RETENTION = 0.5


@pytest.fixture
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_rpc_server(tmp_path_factory, "portico-rpc-restart")
    yield process
    process.stop()


async def open_probe(http: aiohttp.ClientSession, server: ServerProcess, **kwargs: Any) -> RpcProbe:
    return await RpcProbe.open(http, rpc_url(server), token="key-1", **kwargs)


async def send(probe: RpcProbe, text: str, **params: Any) -> str:
    result = await probe.call(
        "v1.message.send", {"content_data": text, "client_id": f"c-{text}", **params}
    )
    return str(result["session_id"])


def ended_turns(probe: RpcProbe) -> list[dict[str, Any]]:
    return [t for t in probe.entities("turn") if t["status"] in {"completed", "interrupted"}]


async def test_updates_made_before_and_after_a_restart_are_replayed_in_order(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    first = await open_probe(http, server)
    session_id = await send(first, "one")
    await first.wait_turn_end(session_id)
    seen, epoch = first.offsets()[-1], first.connected["epoch"]
    await first.close()
    other = await open_probe(http, server)
    await other.call("v1.session.update", {"session_id": session_id, "title": "before restart"})
    await other.close()
    server.restart()
    after = await open_probe(http, server)
    assert after.connected["epoch"] == epoch  # the log survived the restart
    await send(after, "two", server_session_id=session_id)
    await after.until(lambda p: len(ended_turns(p)) == 1)
    head = after.offsets()[-1]
    await after.close()
    back = await open_probe(http, server, offset=seen, epoch=epoch)
    assert back.connected["recovered"] is True
    await back.until(lambda p: bool(p.updates) and p.offsets()[-1] == head)
    assert back.offsets() == list(range(seen + 1, head + 1))
    assert next(s["title"] for s in back.entities("session")) == "before restart"


async def test_a_turn_killed_with_the_server_replays_as_interrupted(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    probe = await open_probe(http, server)
    session_id = await send(probe, "slow", metadata={"mock_scenario": "slow"})
    await probe.until(lambda p: bool(p.live))
    seen, epoch = probe.offsets()[-1], probe.connected["epoch"]
    server.stop(signal.SIGKILL)
    server.start()
    back = await open_probe(http, server, offset=seen, epoch=epoch)
    assert back.connected["recovered"] is True
    await back.until(lambda p: bool(ended_turns(p)))
    (turn,) = ended_turns(back)
    assert (turn["session_id"], turn["status"]) == (session_id, "interrupted")
    reply = next(m for m in back.entities("message") if m["role"] == "assistant")
    assert (reply["status"], reply["content_data"]) == ("failed", "")
    # The session takes new messages after the restart.
    await send(back, "again", server_session_id=session_id)
    await back.until(lambda p: len(ended_turns(p)) == 2)


async def test_a_reset_archive_has_a_new_epoch_and_nothing_is_recovered(
    http: aiohttp.ClientSession, server: ServerProcess, tmp_path: Path
) -> None:
    probe = await open_probe(http, server)
    await probe.wait_turn_end(await send(probe, "one"))
    old_epoch, seen = probe.connected["epoch"], probe.offsets()[-1]
    await probe.close()
    server.stop()
    (server.data_dir / "archive.sqlite3").unlink()
    server.start()
    back = await open_probe(http, server, offset=seen, epoch=old_epoch)
    assert back.connected["recovered"] is False
    assert back.connected["epoch"] != old_epoch
    assert back.connected["offset"] == 0
    assert (await back.call("v1.session.list"))["items"] == []
    assert back.updates == []


async def test_an_offset_older_than_the_retained_log_is_not_recovered(
    http: aiohttp.ClientSession, tmp_path_factory: pytest.TempPathFactory
) -> None:
    env = {"PORTICO_UPDATE_RETENTION": str(SHORT_RETENTION), "PORTICO_UPDATE_PRUNE_INTERVAL": "0.1"}
    server = start_rpc_server(tmp_path_factory, "portico-rpc-retention", env)
    try:
        probe = await open_probe(http, server)
        await probe.wait_turn_end(await send(probe, "one"))
        epoch, latest = probe.connected["epoch"], probe.offsets()[-1]
        await asyncio.sleep(SHORT_RETENTION * 3)  # the log is pruned meanwhile
        stale = await open_probe(http, server, offset=0, epoch=epoch)
        assert stale.connected["recovered"] is False
        # The latest offset is still current: nothing is missing after it.
        current = await open_probe(http, server, offset=latest, epoch=epoch)
        assert current.connected["recovered"] is True
        assert current.connected["offset"] == latest
    finally:
        server.stop()
