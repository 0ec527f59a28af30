"""Readiness follows the archive: an ASGI-level check on a real socket."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from portico.config import load_settings
from portico.server.app import create_app
from portico.server.observability import readyz
from portico.server.services import SERVICES


async def test_readyz_is_503_while_not_ready_and_200_once_the_archive_is_open(
    tmp_path: Path,
) -> None:
    settings = load_settings(env={}, flags={"data_dir": str(tmp_path)})
    app = create_app(settings)
    services = app[SERVICES]
    assert services.ready is False  # before start-up opened the archive
    async with TestClient(TestServer(app)) as client:
        assert services.ready is True
        assert (await client.get("/readyz")).status == 200
        services.lifecycle.stop_requested(0.0)  # what a stop signal does
        response = await client.get("/readyz")
        assert response.status == 503
        assert (await client.get("/healthz")).status == 200


async def test_readyz_is_503_while_the_archive_is_opening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp runs start-up before it binds the socket, so while the archive opens the
    port refuses connections: the probe is asked in process at that moment, then on the
    real socket once start-up has finished."""
    app = create_app(load_settings(env={}, flags={"data_dir": str(tmp_path)}))
    store = app[SERVICES].store
    opening, release = asyncio.Event(), asyncio.Event()
    real_open = store.open

    async def held_open() -> None:
        opening.set()
        await release.wait()
        await real_open()

    monkeypatch.setattr(store, "open", held_open)
    server = TestServer(app)
    starting = asyncio.create_task(server.start_server())
    try:
        await opening.wait()
        probe = await readyz(make_mocked_request("GET", "/readyz", app=app))
        assert probe.status == 503
    finally:
        release.set()
        await starting
    async with TestClient(server) as client:
        assert (await client.get("/readyz")).status == 200
