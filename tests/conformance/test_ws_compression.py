"""permessage-deflate on (`ws_compression`): frames go through aiohttp's compressing writer."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from support.omnia import OmniaClient, scenario
from support.server import SCRIPT, ServerProcess


@pytest.fixture(scope="module")
def compressing_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("portico-deflate"),
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={"PORTICO_WS_COMPRESSION": "true"},
    ).start()
    yield process
    process.stop()


async def test_a_streamed_reply_arrives_compressed_and_whole(
    http: aiohttp.ClientSession, compressing_server: ServerProcess
) -> None:
    ws = await http.ws_connect(compressing_server.ws_url, compress=15)
    assert ws.compress == 15  # the extension was negotiated
    client = OmniaClient(ws)
    session_id = (await client.connected())["session_id"]
    for _ in range(3):  # several turns: the writer picks up frames queued while it sent
        frames = await client.ask("go", session_id=session_id, **scenario("stream50"))
        assert [f["type"] for f in frames] == ["chunk"] * 5 + ["done"]
        assert frames[-1]["content"] == "c " * 5
    await ws.close()
