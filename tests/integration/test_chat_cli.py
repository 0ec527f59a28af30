"""`portico chat` as a subprocess, stdin a pipe, against a real server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.archive import assert_ledger
from support.faultproxy import SERVER_TO_CLIENT, FaultProxy, Rule, cut
from support.server import SCRIPT, ServerProcess

SCRIPTED = ("--runtime", "scripted", "--script", str(SCRIPT))
WITHIN = 20.0  # seconds a chat run may take
TOOL = ("--metadata", "mock_scenario=tool")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path_factory.mktemp("chat"), args=SCRIPTED).start()
    yield process
    process.stop()


def chat_command(server: ServerProcess, *args: str) -> list[str]:
    url = f"ws://127.0.0.1:{server.port}/v1/session"
    return [sys.executable, "-m", "portico", "chat", "--url", url, *args]


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


async def test_a_lost_session_ends_the_chat_with_status_1(tmp_path: Path) -> None:
    """A server restart forgets the session: the chat says so instead of starting over."""
    own = ServerProcess(tmp_path / "server", args=SCRIPTED).start()
    try:
        process = await asyncio.create_subprocess_exec(
            *chat_command(own),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=chat_env(),
        )
        assert process.stdin is not None
        assert process.stdout is not None
        async with asyncio.timeout(WITHIN):
            process.stdin.write(b"hi\n")
            await process.stdin.drain()
            assert await process.stdout.readline() == b"Hello world\n"
            await asyncio.to_thread(own.restart)
            _, stderr = await process.communicate()
        assert process.returncode == 1
        assert b"portico chat: the session cannot be resumed" in stderr
    finally:
        own.stop()


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
