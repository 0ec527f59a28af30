"""`hello.continue`: a new numbering on an archived conversation (docs/session.md).

The resume of a session the server no longer holds fails (`RESUME_FAILED`); a
`hello` with `continue` naming that session then opens a new numbering on the same
conversation: the same id, seq from 1 in both directions, nothing old replayed,
and the agent's history (the archive) kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from support.archive import open_archive, wait_for_messages
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


def start(data_dir: Path) -> ServerProcess:
    return ServerProcess(
        data_dir, args=("--runtime", "scripted", "--script", str(SCRIPT)), env=ENV
    ).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start(tmp_path_factory.mktemp("portico-continue"))
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
