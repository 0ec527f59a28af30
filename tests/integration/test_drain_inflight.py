"""The drain and a `/ws` message the engine is still admitting (issue 16, the rolling
restart's extra turn): on a real socket, a message whose `submit` awaits the archive
when the stop signal comes keeps its connection busy, so the drain closes it (1001)
only after the turn's `done`, never before a turn the client would not see and would
send again on another replica."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from portico.config import load_settings
from portico.domain.model import Session
from portico.server.app import create_app
from portico.server.drain import drain
from portico.server.services import SERVICES
from support.omnia import OmniaClient


async def test_a_message_being_admitted_holds_the_drain_until_its_turn_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(load_settings(env={}, flags={"data_dir": str(tmp_path)}))
    services = app[SERVICES]
    store = services.store
    reading, release = asyncio.Event(), asyncio.Event()
    real_get_session = store.get_session

    async def held_get_session(session_id: str) -> Session | None:
        # The engine's first await in `submit`: the message is with the engine, its
        # turn not started, nothing in the engine says the session is busy yet.
        reading.set()
        await release.wait()
        return await real_get_session(session_id)

    monkeypatch.setattr(store, "get_session", held_get_session)
    async with TestClient(TestServer(app)) as http:
        client = OmniaClient(await http.ws_connect("/ws"))
        session_id = (await client.connected())["session_id"]
        await client.send({"type": "message", "content": "hi", "session_id": session_id})
        await reading.wait()
        (connection,) = services.connections
        assert connection.busy(), "a message with the engine must hold the drain"

        services.lifecycle.stop_requested(asyncio.get_running_loop().time())
        draining = asyncio.create_task(drain(services))
        release.set()
        frames = await client.turn()
        assert frames[-1]["type"] == "done", frames
        closing = await client.ws.receive(timeout=10)
        assert (closing.type, closing.data) == (aiohttp.WSMsgType.CLOSE, 1001)
        await draining
