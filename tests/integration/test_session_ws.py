"""The `/v1/session` adapter in process, where a test can hold a message mid-handling."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from portico.config import load_settings
from portico.errors import InvalidMessage
from portico.server.app import create_app
from portico.server.services import SERVICES
from support.redis import SESSION_STATES, session_state

WITHIN = 5.0


async def numbered(ws: aiohttp.ClientWebSocketResponse) -> dict[str, Any]:
    """The next numbered frame (acks and pongs skipped)."""
    while True:
        frame: dict[str, Any] = await ws.receive_json(timeout=WITHIN)
        if frame["type"] not in ("ack", "pong"):
            return frame


@pytest.fixture(params=SESSION_STATES)
def state_env(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    with session_state(request.param) as env:
        yield env


async def test_the_answer_to_a_message_of_a_replaced_connection_reaches_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state_env: dict[str, str]
) -> None:
    """A message still being handled when a resume takes the session over: its answer is
    numbered into the session and written to the connection attached now, in order."""
    app = create_app(load_settings(env=state_env, flags={"data_dir": str(tmp_path)}))
    services = app[SERVICES]
    handling, release = asyncio.Event(), asyncio.Event()

    async def held_acknowledge(principal: str, call_id: str) -> None:
        handling.set()
        await release.wait()
        raise InvalidMessage(f"no tool call {call_id}")

    monkeypatch.setattr(services.tools, "acknowledge", held_acknowledge)
    async with TestClient(TestServer(app)) as http, asyncio.timeout(4 * WITHIN):
        old = await http.ws_connect("/v1/session")
        await old.send_json({"type": "hello", "protocol": 1})
        session_id = (await old.receive_json(timeout=WITHIN))["session_id"]
        await old.send_json({"type": "tool_call_ack", "seq": 1, "call_id": "call-x"})
        await handling.wait()
        new = await http.ws_connect("/v1/session")
        await new.send_json(
            {"type": "hello", "protocol": 1, "session_id": session_id, "last_seq": 0}
        )
        ready = await new.receive_json(timeout=WITHIN)
        assert (ready["type"], ready["resumed"], ready["last_seq"]) == ("ready", True, 1)
        release.set()  # the old connection's message fails now, after the takeover
        refused = await numbered(new)
        assert (refused["type"], refused["seq"], refused["ref_seq"]) == ("error", 1, 1)
        assert refused["error"]["code"] == "INVALID_MESSAGE"
        # Numbering goes on without a gap on the connection that holds the session.
        await new.send_json({"type": "message", "seq": 2, "content": "hi"})
        assert (await numbered(new))["seq"] == 2
        await old.close()
        await new.close()
