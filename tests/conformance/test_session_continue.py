"""`hello.continue`: a new numbering on an archived conversation (docs/session.md),
and the idempotency keys that make sending a message again after a restart harmless.

The resume of a session the server no longer holds fails (`RESUME_FAILED`); a
`hello` with `continue` naming that session then opens a new numbering on the same
conversation: the same id, seq from 1 in both directions, nothing old replayed,
and the agent's history (the archive) kept.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.archive import open_archive, wait_for_messages
from support.redis import SESSION_STATES, session_state
from support.rpc import RpcProbe
from support.server import SCRIPT, ServerProcess
from support.session import SessionProbe

ALICE, BOB = "alice-token", "bob-token"
WINDOW = 0.5  # resume window, seconds
HELLO = "Hello world"  # the scripted default reply
FAILED = {
    "type": "error",
    "error": {"code": "RESUME_FAILED", "message": "the session cannot be resumed"},
}
ENV = {
    "PORTICO_AUTH": "apikey",
    "PORTICO_API_KEYS": f"{ALICE}=alice,{BOB}=bob",
    "PORTICO_RESUME_WINDOW": str(WINDOW),
}


def start(data_dir: Path, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(
        data_dir,
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={**ENV, **(env or {})},
    ).start()


@pytest.fixture(scope="module", params=SESSION_STATES)
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    with session_state(request.param) as env:
        process = start(tmp_path_factory.mktemp("portico-continue"), env)
        yield process
        process.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def url(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/session"


async def conversation(http: aiohttp.ClientSession, server: ServerProcess) -> str:
    """A session with one exchange, its connection closed; its id."""
    probe = await SessionProbe.connect(http, url(server))
    ready = await probe.hello(credential=ALICE)
    await probe.message("before")
    assert (await probe.turn())[-1]["content"] == HELLO
    await probe.ws.close()
    return str(ready["session_id"])


async def resume_fails(
    http: aiohttp.ClientSession, server: ServerProcess, session_id: str, *, wait: bool = True
) -> None:
    """The resume is refused: the session's window has passed (or the server restarted).

    A refused attempt would restart nothing, but an accepted one would reattach and
    restart the window, so it waits out the window once and tries once.
    """
    if wait:
        await asyncio.sleep(3 * WINDOW)
    probe = await SessionProbe.connect(http, url(server))
    assert await probe.hello(credential=ALICE, session_id=session_id, last_seq=2) == FAILED
    assert (await probe.closed())[0] == 4404


async def continue_and_talk(
    http: aiohttp.ClientSession, server: ServerProcess, session_id: str
) -> SessionProbe:
    """Continue `session_id`, send one message; check the numbering starts afresh."""
    probe = await SessionProbe.connect(http, url(server))
    ready = await probe.hello(credential=ALICE, **{"continue": session_id})
    assert (ready["type"], ready["session_id"]) == ("ready", session_id)
    assert (ready["resumed"], ready["last_seq"]) == (False, 0)
    assert await probe.message("after") == 1  # the client numbers from 1 again
    frames = await probe.turn()
    assert frames[-1]["content"] == HELLO
    # Nothing of the old numbering came back: only this turn, numbered from 1.
    assert probe.numbered_seqs() == list(range(1, len(frames) + 1))
    assert {frame["turn_id"] for frame in frames if "turn_id" in frame} == {frames[-1]["turn_id"]}
    return probe


async def assert_one_conversation(archive: Path, session_id: str) -> None:
    messages = await wait_for_messages(archive, session_id, 4)
    assert [(m.role, m.content) for m in messages] == [
        ("user", "before"),
        ("assistant", HELLO),
        ("user", "after"),
        ("assistant", HELLO),
    ]
    async with open_archive(archive) as store:
        sessions = await store.list_sessions("alice", limit=1000, include_deleted=False)
    assert [s.id for s in sessions].count(session_id) == 1


async def test_continue_after_the_window_keeps_the_conversation_and_numbers_from_1(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    session_id = await conversation(http, server)
    await resume_fails(http, server, session_id)
    probe = await continue_and_talk(http, server, session_id)
    await probe.ws.close()
    await assert_one_conversation(server.archive_path, session_id)


async def test_a_continued_session_is_resumed_in_its_new_numbering(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    session_id = await conversation(http, server)
    await resume_fails(http, server, session_id)
    probe = await continue_and_talk(http, server, session_id)
    handled = probe.handled
    await probe.ws.close()
    again = await SessionProbe.connect(http, url(server))
    ready = await again.hello(credential=ALICE, session_id=session_id, last_seq=handled)
    assert (ready["type"], ready["resumed"], ready["last_seq"]) == ("ready", True, 1)
    await again.ws.close()


async def test_continuing_a_live_session_replaces_its_connection(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    old = await SessionProbe.connect(http, url(server))
    session_id = (await old.hello(credential=ALICE))["session_id"]
    await old.message("before")
    await old.turn()
    new = await continue_and_talk(http, server, session_id)
    assert (await old.closed())[0] == 4409
    await new.ws.close()
    await assert_one_conversation(server.archive_path, session_id)


@pytest.mark.parametrize("case", ["other principal", "unknown id"])
async def test_a_foreign_or_unknown_id_is_answered_like_a_failed_resume(
    http: aiohttp.ClientSession, server: ServerProcess, case: str
) -> None:
    session_id = await conversation(http, server)
    probe = await SessionProbe.connect(http, url(server))
    credential, target = (BOB, session_id) if case == "other principal" else (ALICE, "sess-nope")
    assert await probe.hello(credential=credential, **{"continue": target}) == FAILED
    assert (await probe.closed())[0] == 4404
    messages = await wait_for_messages(server.archive_path, session_id, 2)
    assert len(messages) == 2  # the stranger added nothing


async def test_continue_with_a_session_id_is_a_protocol_error(
    http: aiohttp.ClientSession, server: ServerProcess
) -> None:
    session_id = await conversation(http, server)
    probe = await SessionProbe.connect(http, url(server))
    answer = await probe.hello(credential=ALICE, session_id=session_id, **{"continue": session_id})
    assert answer["error"]["code"] == "PROTOCOL_ERROR"
    assert (await probe.closed())[0] == 4400


async def test_continue_after_a_server_restart_with_the_sqlite_archive(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    own = start(tmp_path / "server")
    try:
        session_id = await conversation(http, own)
        await asyncio.to_thread(own.restart)
        await resume_fails(http, own, session_id, wait=False)
        probe = await continue_and_talk(http, own, session_id)
        await probe.ws.close()
        await assert_one_conversation(own.archive_path, session_id)
    finally:
        own.stop()


# -- idempotency keys (`message.client_id`, docs/session.md) ------------------------------
#
# A client that cannot know whether a message reached the server (it restarted under
# it) sends it again with the same key: the archive holds it once, the agent answers it
# once, and the client is told where the earlier one is.


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
        probe = await SessionProbe.connect(http, url(own))
        session_id = (await probe.hello(credential=ALICE))["session_id"]
        # The client reads nothing: it never sees the ack nor the reply.
        await probe.message("only once", client_id="k-1")
        await wait_for_messages(own.archive_path, session_id, 2)
        own.stop(signal.SIGKILL)
        own.start()
        again = await SessionProbe.connect(http, url(own))
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
    probe = await SessionProbe.connect(http, url(server))
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
    alice = await SessionProbe.connect(http, url(server))
    alice_session = (await alice.hello(credential=ALICE))["session_id"]
    await alice.message("alice's secret", client_id="k-shared")
    await alice.turn()
    bob = await SessionProbe.connect(http, url(server))
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
    probe = await SessionProbe.connect(http, url(server))
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
