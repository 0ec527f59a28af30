"""Idempotency keys on `/v1/session` messages (`message.client_id`, docs/session.md).

A client that cannot know whether a message reached the server (it restarted under
it) sends it again with the same key: the archive holds it once, the agent answers
it once, and the client is told where the earlier one is.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.archive import wait_for_messages
from support.rpc import RpcProbe
from support.server import SCRIPT, ServerProcess
from support.session import SessionProbe

ALICE, BOB = "alice-token", "bob-token"
HELLO = "Hello world"  # the scripted default reply
ENV = {"PORTICO_AUTH": "apikey", "PORTICO_API_KEYS": f"{ALICE}=alice,{BOB}=bob"}


def start(data_dir: Path) -> ServerProcess:
    return ServerProcess(
        data_dir, args=("--runtime", "scripted", "--script", str(SCRIPT)), env=ENV
    ).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start(tmp_path_factory.mktemp("portico-keys"))
    yield process
    process.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def session_url(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/session"


async def archived(
    http: aiohttp.ClientSession, server: ServerProcess, token: str, session_id: str
) -> list[tuple[str, str, str]]:
    """(role, content, client_id) of every message, read with `v1.message.list`."""
    rpc = await RpcProbe.open(http, f"ws://127.0.0.1:{server.port}/v1/rpc", token=token)
    page = await rpc.call("v1.message.list", {"session_id": session_id, "limit": 100})
    await rpc.close()
    return [(m["role"], m["content_data"], m.get("client_id", "")) for m in page["items"]]


async def turns_of(
    http: aiohttp.ClientSession, server: ServerProcess, session_id: str
) -> list[dict[str, Any]]:
    rpc = await RpcProbe.open(http, f"ws://127.0.0.1:{server.port}/v1/rpc", token=ALICE)
    page = await rpc.call("v1.turn.list", {"session_id": session_id})
    await rpc.close()
    items: list[dict[str, Any]] = page["items"]
    return items


async def duplicate_answer(probe: SessionProbe, seq: int) -> dict[str, Any]:
    """The numbered `error` answering message `seq`, and no turn with it."""
    frame = await probe.recv_numbered()
    assert (frame["type"], frame.get("ref_seq")) == ("error", seq), frame
    assert "turn_id" not in frame  # it ends no turn: none was started
    assert frame["error"]["code"] == "DUPLICATE_MESSAGE"
    details: dict[str, Any] = frame["error"]["details"]
    return details


async def test_a_line_archived_before_a_kill_is_not_duplicated_when_sent_again(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    own = start(tmp_path / "server")
    try:
        probe = await SessionProbe.connect(http, session_url(own))
        session_id = (await probe.hello(credential=ALICE))["session_id"]
        # The client reads nothing: it never sees the ack nor the reply.
        await probe.message("only once", client_id="k-1")
        await wait_for_messages(own.archive_path, session_id, 2)
        own.stop(signal.SIGKILL)
        own.start()
        again = await SessionProbe.connect(http, session_url(own))
        ready = await again.hello(credential=ALICE, **{"continue": session_id})
        assert (ready["type"], ready["session_id"]) == ("ready", session_id)
        seq = await again.message("only once", client_id="k-1")
        details = await duplicate_answer(again, seq)
        messages = await archived(http, own, ALICE, session_id)
        assert messages == [("user", "only once", "k-1"), ("assistant", HELLO, "")]
        assert details["session_id"] == session_id
        assert (details["turn_state"], details["reply"]) == ("completed", HELLO)
        assert len(await turns_of(http, own, session_id)) == 1  # the agent ran once
        # The session goes on: a new key is a new message.
        await again.message("next", client_id="k-2")
        assert (await again.turn())[-1]["content"] == HELLO
        await again.ws.close()
    finally:
        own.stop()


async def test_a_repeated_key_is_acknowledged_and_the_connection_stays(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    probe = await SessionProbe.connect(http, session_url(server))
    session_id = (await probe.hello(credential=ALICE))["session_id"]
    await probe.message("hi", client_id="k-same")
    first = await probe.turn()
    seq = await probe.message("hi", client_id="k-same")
    details = await duplicate_answer(probe, seq)
    assert details["turn_id"] == first[-1]["turn_id"]
    await probe.ack()
    while (frame := await probe.recv()).get("type") != "ack" or frame["seq"] < seq:
        pass  # the repeated message is acknowledged like any other
    assert [m[0] for m in await archived(http, server, ALICE, session_id)] == [
        "user",
        "assistant",
    ]
    await probe.ws.close()


async def test_another_principal_reusing_a_key_gets_its_own_message(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    alice = await SessionProbe.connect(http, session_url(server))
    alice_session = (await alice.hello(credential=ALICE))["session_id"]
    await alice.message("alice's secret", client_id="k-shared")
    await alice.turn()
    bob = await SessionProbe.connect(http, session_url(server))
    bob_session = (await bob.hello(credential=BOB))["session_id"]
    await bob.message("bob's line", client_id="k-shared")
    frames = await bob.turn()
    assert frames[-1]["type"] == "done"  # a turn of his own, nothing of Alice's
    assert "alice's secret" not in str(bob.received)
    assert await archived(http, server, BOB, bob_session) == [
        ("user", "bob's line", "k-shared"),
        ("assistant", HELLO, ""),
    ]
    assert len(await archived(http, server, ALICE, alice_session)) == 2
    await alice.ws.close()
    await bob.ws.close()


async def test_an_overlong_key_is_an_invalid_message_and_the_connection_stays(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    probe = await SessionProbe.connect(http, session_url(server))
    session_id = (await probe.hello(credential=ALICE))["session_id"]
    seq = await probe.message("hi", client_id="k" * 129)
    frame = await probe.recv_numbered()
    assert (frame["type"], frame["ref_seq"], frame["error"]["code"]) == (
        "error",
        seq,
        "INVALID_MESSAGE",
    )
    await probe.message("hi", client_id="k" * 128)
    assert (await probe.turn())[-1]["content"] == HELLO
    assert len(await archived(http, server, ALICE, session_id)) == 2
    await probe.ws.close()
