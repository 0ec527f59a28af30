"""The README's first command: `pip install -e .` (no extras) and `portico serve`.

The test suite runs with every extra installed, so an optional backend's library
imported on the server's path (redis-py did, through the replicas' link) breaks the
quick start and nothing else notices. Here the extras' top-level modules are shadowed by
packages that fail to import, as when they are not installed, and the server must start
on its embedded defaults, be ready, and answer a turn.
"""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp

from support.omnia import OmniaClient
from support.server import ServerProcess

# The top-level modules of the optional extras (pyproject.toml): redis, postgres, grpc
# (with protobuf's `google`), jwt, s3, mcp, voice.
EXTRAS_MODULES = (
    "redis",
    "asyncpg",
    "grpc",
    "google",
    "jwt",
    "aiobotocore",
    "botocore",
    "mcp",
    "webrtcvad",
    "pocketsphinx",
)


def without_extras(root: Path) -> str:
    """A folder for the front of PYTHONPATH in which each extra's module fails to import."""
    for name in EXTRAS_MODULES:
        package = root / name
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {name!r}'!r}, name={name!r})\n"
        )
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)


async def test_portico_serve_runs_on_its_defaults_without_any_extra(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = ServerProcess(
        tmp_path / "data", env={"PYTHONPATH": without_extras(tmp_path / "no-extras")}
    ).start()
    try:
        async with http.get(server.http_url + "/readyz") as ready:
            assert ready.status == 200, await ready.text()
        client = OmniaClient(await http.ws_connect(server.ws_url))
        await client.connected()
        frames = await client.ask("hello")
        assert frames[-1]["type"] == "done", frames
        assert any(frame["type"] == "chunk" for frame in frames), frames
    finally:
        server.stop()
    assert "No module named" not in server.log_text()
