"""A turn's end the archive refused is written again, as the settings
`turn_end_retry_interval` and `turn_end_retry_window` say (docs/replicas.md, backend
faults): a real server in process, a `/ws` turn, an archive whose `end_turn` fails."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from portico.config import load_settings
from portico.domain.model import Message, Turn
from portico.domain.states import TurnState
from portico.errors import StoreError
from portico.server.app import create_app
from portico.server.services import SERVICES
from support.omnia import OmniaClient

WITHIN = 10.0  # a deadline on what the test waits for, not a measured figure


class RefusedEnds:
    """`end_turn` fails its first `failures` calls (None: every call)."""

    def __init__(self, store: object, failures: int | None) -> None:
        self._end_turn = store.end_turn  # type: ignore[attr-defined]
        self._failures = failures
        self.calls = 0
        self.written = asyncio.Event()
        self.given_up = asyncio.Event()

    async def end_turn(self, turn: Turn, reply: Message | None) -> None:
        self.calls += 1
        if self._failures is None or self.calls <= self._failures:
            raise StoreError("the archive is unreachable")
        await self._end_turn(turn, reply)
        self.written.set()


class GivingUp(logging.Handler):
    """Sees the turn's log say the retries gave up (past their window)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "failed for good" in record.getMessage():
            self.seen.set()


async def one_turn(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    env: dict[str, str],
    failures: int | None,
) -> tuple[RefusedEnds, Turn]:
    """Run one `/ws` turn; the archive's `end_turn` and the turn as archived once the
    retries wrote it or gave up."""
    app = create_app(load_settings(env=env, flags={"data_dir": str(tmp_path)}))
    store = app[SERVICES].store
    refused = RefusedEnds(store, failures)
    monkeypatch.setattr(store, "end_turn", refused.end_turn)
    giving_up = GivingUp()
    logging.getLogger("portico.turn").addHandler(giving_up)
    try:
        return await turn_against(app, refused, giving_up.seen if failures is None else None)
    finally:
        logging.getLogger("portico.turn").removeHandler(giving_up)


async def turn_against(
    app: web.Application, refused: RefusedEnds, given_up: asyncio.Event | None
) -> tuple[RefusedEnds, Turn]:
    store = app[SERVICES].store
    async with TestClient(TestServer(app)) as http:
        client = OmniaClient(await http.ws_connect("/ws"))
        session_id = (await client.connected())["session_id"]
        frames = await client.ask(session_id=session_id)
        assert frames[-1]["type"] == "done", frames  # the client's one terminal frame
        await asyncio.wait_for((given_up or refused.written).wait(), WITHIN)
        (turn,) = await store.list_turns(session_id)
        return refused, turn


async def test_a_refused_turn_end_is_written_again_at_the_set_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"PORTICO_TURN_END_RETRY_INTERVAL": "0.01", "PORTICO_TURN_END_RETRY_WINDOW": "30"}
    refused, turn = await one_turn(tmp_path, monkeypatch, env=env, failures=3)
    assert refused.calls == 4  # the end, refused, then three retries: the last one wrote it
    assert turn.state is TurnState.COMPLETED


async def test_the_retries_end_with_their_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default window (two minutes) this would not give up within the test's
    deadline: the setting reaches the turn."""
    env = {"PORTICO_TURN_END_RETRY_INTERVAL": "0.01", "PORTICO_TURN_END_RETRY_WINDOW": "0.1"}
    refused, turn = await one_turn(tmp_path, monkeypatch, env=env, failures=None)
    assert refused.calls > 1
    assert turn.state is TurnState.RUNNING  # left to the next start's sweep
