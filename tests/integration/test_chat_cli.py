"""`portico chat` as a subprocess, stdin a pipe, against a real server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.archive import assert_ledger, open_archive, wait_for_messages
from support.faultproxy import SERVER_TO_CLIENT, FaultProxy, Rule, cut, suppress
from support.server import SCRIPT, ServerProcess

SCRIPTED = ("--runtime", "scripted", "--script", str(SCRIPT))
WITHIN = 20.0  # seconds a chat run may take
TOOL = ("--metadata", "mock_scenario=tool")
CONTINUED = "(reconnected: the server restarted; the conversation goes on)"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path_factory.mktemp("chat"), args=SCRIPTED).start()
    yield process
    process.stop()


def session_url(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/session"


def chat_command(server: ServerProcess, *args: str) -> list[str]:
    return [sys.executable, "-m", "portico", "chat", "--url", session_url(server), *args]


def chat_env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith("PORTICO_")}


def chat(server: ServerProcess, stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        chat_command(server, *args),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=WITHIN,
        env=chat_env(),
        check=False,
    )


def test_a_line_is_sent_and_the_reply_streams_to_stdout(server: ServerProcess) -> None:
    result = chat(server, "hi\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Hello world\n"


def test_quit_ends_the_session_before_later_lines(server: ServerProcess) -> None:
    result = chat(server, "hi\n/quit\nnever sent\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Hello world\n"


def test_a_tool_call_asks_for_consent_and_yes_runs_the_demo_tool(server: ServerProcess) -> None:
    result = chat(server, "where am I?\ny\n", *TOOL)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "[tool] get_location query='current'"
    assert "Allow location access?" in lines[1]
    assert "categories: location" in lines[2]
    assert lines[3] == "allow? [y/N] y"
    assert lines[4].startswith('status=completed result={"timezone":')
    assert lines[4].endswith('"accuracy":"time zone only"} error=')


def test_no_declines_the_tool_call(server: ServerProcess) -> None:
    result = chat(server, "where am I?\nn\n", *TOOL)
    assert result.returncode == 0, result.stderr
    assert "status=denied result= error=declined by the user" in result.stdout


def test_end_of_input_at_the_consent_prompt_declines(server: ServerProcess) -> None:
    result = chat(server, "where am I?\n", *TOOL)
    assert result.returncode == 0, result.stderr
    assert "(end of input: declined)" in result.stdout
    assert "status=denied" in result.stdout


def test_an_unreachable_server_exits_1_with_a_message(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "portico", "chat", "--url", "ws://127.0.0.1:9/v1/session"],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=WITHIN,
        env=chat_env(),
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("portico chat: could not open the session")


async def terminal_chat(url: str, *args: str) -> asyncio.subprocess.Process:
    """`portico chat` with stdout and stderr in one stream, as a terminal shows them."""
    process = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "portico", "chat", "--url", url, *args],
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=chat_env(),
    )
    assert process.stdin is not None
    assert process.stdout is not None
    return process


async def read_until(stream: asyncio.StreamReader, text: bytes) -> bytes:
    """What `stream` gives up to and including `text` (callers bound the wait)."""
    return await stream.readuntil(text)


async def only_session(archive: Path) -> str:
    async with open_archive(archive) as store:
        (session,) = await store.list_sessions("local", limit=10, include_deleted=False)
    return session.id


async def test_a_server_restart_while_the_user_types_continues_the_conversation(
    tmp_path: Path,
) -> None:
    """The server is killed; a line typed during the outage is answered once it is back,
    in the same conversation, with one notice on a line of its own."""
    own = ServerProcess(tmp_path / "server", args=SCRIPTED).start()
    try:
        process = await terminal_chat(session_url(own))
        assert process.stdin is not None
        assert process.stdout is not None
        async with asyncio.timeout(WITHIN):
            process.stdin.write(b"hi\n")
            await process.stdin.drain()
            assert await process.stdout.readline() == b"Hello world\n"
            await asyncio.to_thread(own.stop, signal.SIGKILL)
            process.stdin.write(b"typed during the outage\n")
            await process.stdin.drain()
            await asyncio.to_thread(own.start)
            assert await read_until(process.stdout, b"Hello world\n")
            rest, _ = await process.communicate(b"and after\n")
        assert process.returncode == 0, rest
        session_id = await only_session(own.archive_path)
        await assert_ledger(
            own.archive_path,
            session_id,
            [
                ("user", "hi"),
                ("assistant", "Hello world"),
                ("user", "typed during the outage"),
                ("assistant", "Hello world"),
                ("user", "and after"),
                ("assistant", "Hello world"),
            ],
        )
    finally:
        own.stop()


async def test_a_line_the_server_archived_before_dying_is_answered_once(tmp_path: Path) -> None:
    """The server archives and answers a line, but its ack and reply never reach the
    chat, and it is killed: the chat sends the line again with its key after the
    restart and prints the archived answer; the archive holds the line once."""
    own = ServerProcess(tmp_path / "server", args=SCRIPTED).start()
    try:
        async with FaultProxy(own.http_url) as proxy:
            hidden = proxy.add_rule(
                Rule(
                    suppress(),
                    direction=SERVER_TO_CLIENT,
                    type={"ack", "chunk", "done"},
                    times=None,
                )
            )
            process = await terminal_chat(proxy.url("/v1/session"))
            assert process.stdin is not None
            assert process.stdout is not None
            async with asyncio.timeout(WITHIN):
                process.stdin.write(b"only once\n")
                await process.stdin.drain()
                ready = await proxy.events.wait_for_frame(SERVER_TO_CLIENT, type="ready")
                session_id = ready.json["session_id"]
                await wait_for_messages(own.archive_path, session_id, 2)
                await asyncio.to_thread(own.stop, signal.SIGKILL)
                proxy.remove_rule(hidden)
                await asyncio.to_thread(own.start)
                output, _ = await process.communicate(b"and after\n")
        assert process.returncode == 0, output
        assert output.decode().splitlines() == [CONTINUED, "Hello world", "Hello world"]
        await assert_ledger(
            own.archive_path,
            session_id,
            [
                ("user", "only once"),
                ("assistant", "Hello world"),
                ("user", "and after"),
                ("assistant", "Hello world"),
            ],
        )
    finally:
        own.stop()


async def test_the_restart_notice_is_printed_once_on_its_own_line(tmp_path: Path) -> None:
    own = ServerProcess(tmp_path / "server", args=SCRIPTED).start()
    try:
        process = await terminal_chat(session_url(own))
        assert process.stdin is not None
        assert process.stdout is not None
        async with asyncio.timeout(WITHIN):
            process.stdin.write(b"hi\n")
            await process.stdin.drain()
            assert await process.stdout.readline() == b"Hello world\n"
            await asyncio.to_thread(own.stop, signal.SIGKILL)
            await asyncio.to_thread(own.start)
            output, _ = await process.communicate(b"back?\n")
        assert process.returncode == 0, output
        assert output.decode().splitlines() == [CONTINUED, "Hello world"]
    finally:
        own.stop()


async def session_with(archive: Path, content: str) -> tuple[str, int]:
    """The session holding a user message `content`, and how many sessions there are."""
    async with open_archive(archive) as store:
        sessions = await store.list_sessions("local", limit=1000, include_deleted=False)
        for session in sessions:
            if any(m.content == content for m in await store.list_messages(session.id)):
                return session.id, len(sessions)
    raise AssertionError(f"no session holds {content!r}")


async def test_session_continues_an_archived_conversation(server: ServerProcess) -> None:
    first = await asyncio.to_thread(chat, server, "first of two\n")
    assert first.returncode == 0, first.stderr
    session_id, count = await session_with(server.archive_path, "first of two")
    second = await asyncio.to_thread(chat, server, "second of two\n", "--session", session_id)
    assert second.returncode == 0, second.stderr
    # The conversation so far, then the new line's reply.
    assert second.stdout == "> first of two\nHello world\nHello world\n"
    assert second.stderr == ""  # continuing at the start is no reconnect
    assert await session_with(server.archive_path, "second of two") == (session_id, count)


async def test_session_prints_the_conversation_so_far_as_the_live_view_did(
    server: ServerProcess,
) -> None:
    """Lines after `> `, the tool call as its prompt showed it, the text either side of
    it; the result (never shown live) and the empty reply before the call are not."""
    first = await asyncio.to_thread(chat, server, "where am I?\ny\n", *TOOL)
    assert first.returncode == 0, first.stderr
    session_id, _ = await session_with(server.archive_path, "where am I?")
    second = await asyncio.to_thread(chat, server, "", "--session", session_id)
    assert second.returncode == 0, second.stderr
    live = first.stdout.splitlines()
    history = second.stdout.splitlines()
    assert history[0] == "> where am I?"
    assert history[1] == live[0] == "[tool] get_location query='current'"
    assert history[2:] == live[4:]  # the reply after the call, as it streamed
    assert all(line.strip() for line in history)  # no empty message printed


def test_session_of_an_unknown_id_exits_1_with_a_message(server: ServerProcess) -> None:
    result = chat(server, "hi\n", "--session", "sess-unknown")
    assert result.returncode == 1
    assert result.stderr.startswith("portico chat: could not open the session")


async def test_a_reply_cut_mid_stream_is_shown_once_after_a_silent_reconnect(
    server: ServerProcess,
) -> None:
    """Through the fault proxy: the connection drops after the reply's first chunk."""
    async with FaultProxy(server.http_url) as proxy:
        proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, type="chunk", nth=2))
        url = proxy.url("/v1/session")
        process = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "portico", "chat", "--url", url],
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=chat_env(),
        )
        async with asyncio.timeout(WITHIN):
            stdout, stderr = await process.communicate(b"hi\n")
        assert process.returncode == 0, stderr
        assert len(proxy.connections) == 2  # cut once, resumed once
        session_ids = {e.json.get("session_id") for e in proxy.events.frames(type="ready")}
    assert stdout == b"Hello world\n"
    assert stderr.decode().splitlines() == ["(reconnected)"]
    (session_id,) = session_ids
    await assert_ledger(
        server.archive_path, session_id, [("user", "hi"), ("assistant", "Hello world")]
    )


async def test_the_reconnected_notice_never_lands_inside_a_streamed_line(
    server: ServerProcess,
) -> None:
    """stdout and stderr in one stream, as on a terminal; the connection is cut after the
    reply's first chunk, while the agent still works on the rest (`slow`)."""
    async with FaultProxy(server.http_url) as proxy:
        process = await terminal_chat(proxy.url("/v1/session"), "--metadata", "mock_scenario=slow")
        assert process.stdin is not None
        assert process.stdout is not None
        async with asyncio.timeout(WITHIN):
            process.stdin.write(b"hi\n")
            await process.stdin.drain()
            assert await process.stdout.readexactly(1) == b"a"  # the line is open now
            await proxy.cut(0)
            await proxy.wait_connection(1)
            output, _ = await process.communicate(b"")
    assert process.returncode == 0, output
    assert ("a" + output.decode()).splitlines() == ["a", "(reconnected)"]


def test_media_parts_are_printed_by_kind_name_and_length(tmp_path: Path) -> None:
    demo = ServerProcess(
        tmp_path / "demo", args=("--runtime", "demo"), env={"PORTICO_DEMO_WORD_DELAY": "0"}
    ).start()
    try:
        result = chat(demo, "draw\nbeep\n")
    finally:
        demo.stop()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Here is a picture")
    assert lines[1] == "[image: portico-demo.png]"
    assert lines[2].startswith("Here is a short sound")
    assert lines[3] == "[audio: 0.5 s]"
    assert len(lines) == 4
