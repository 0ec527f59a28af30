"""The server's acks on `/v1/session` (spec/sessions-protocol.md section 6): within
`ack_delay` of handling a message, and no later than the server's next numbered
message (docs/performance.md, "`/v1/session` per frame")."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from support.redis import SESSION_STATES, scripted_server
from support.server import ServerProcess
from support.session import SessionProbe

# Far longer than any test runs: an ack seen before it comes with the server's output.
ACK_DELAY = "3600"


@pytest.fixture(scope="module", params=SESSION_STATES)
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("portico-session-acks")
    with scripted_server(data_dir, request.param, {"PORTICO_ACK_DELAY": ACK_DELAY}) as process:
        yield process


async def test_a_message_is_acknowledged_with_the_first_message_of_its_turn(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
    await probe.hello()
    seq = await probe.message("hi")
    frames = await probe.turn()
    acks = [frame for frame in probe.received if frame["type"] == "ack"]
    assert acks, probe.received
    assert acks[0]["seq"] == seq
    # Right behind the turn's first numbered message, in the same write.
    first = probe.received.index(frames[0])
    assert probe.received[first + 1] == {"type": "ack", "seq": seq}
    await probe.ws.close()
