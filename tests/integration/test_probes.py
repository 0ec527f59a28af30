"""Readiness follows the archive: an ASGI-level check on a real socket."""

from __future__ import annotations

from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from portico.config import load_settings
from portico.server.app import create_app
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
        services.ready = False  # what shutdown sets while it drains
        response = await client.get("/readyz")
        assert response.status == 503
        assert (await client.get("/healthz")).status == 200
