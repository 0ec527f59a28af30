"""`portico serve --runtime echo` end to end, and the README's Python chat snippet."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import aiohttp
import pytest

from support.omnia import OmniaClient
from support.server import ServerProcess

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "ws://127.0.0.1:8080/ws"


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path_factory.mktemp("portico-echo"), args=("--runtime", "echo"))
    yield process.start()
    process.stop()


async def test_echo_runtime_answers_one_done_with_the_text(echo_server: ServerProcess) -> None:
    async with aiohttp.ClientSession() as http:
        client = OmniaClient(await http.ws_connect(echo_server.ws_url))
        session_id = (await client.connected())["session_id"]
        frames = await client.ask("hello there")
        assert frames == [
            {"type": "done", "content": "Echo: hello there", "session_id": session_id}
        ]
        # Text parts count too: they are the message's text.
        await client.send({"type": "message", "parts": [{"type": "text", "text": "a part"}]})
        assert (await client.turn())[-1]["content"] == "Echo: a part"


def readme_python_chat() -> str:
    """The first Python block of `## Talk to it`: the one that chats over /ws."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Talk to it", 1)[1].split("\n## ", 1)[0]
    (snippet,) = re.findall(r"```python\n(.+?)\n```", section, re.DOTALL)
    assert README_URL in snippet
    return snippet


def test_readme_python_snippet_chats_with_a_server(echo_server: ServerProcess) -> None:
    snippet = readme_python_chat().replace(README_URL, echo_server.ws_url)
    result = subprocess.run(
        [sys.executable, "-c", snippet],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    session_id = re.match(r"session (\S+)\n", result.stdout)
    assert session_id is not None, result.stdout
    done = {"type": "done", "content": "Echo: hello", "session_id": session_id[1]}
    # The snippet prints the session, then (no chunks from echo) a newline and `done`.
    head = f"session {session_id[1]}\n\n "
    assert result.stdout.startswith(head)
    printed = ast.literal_eval(result.stdout.removeprefix(head))
    assert datetime.fromisoformat(printed.pop("timestamp")).utcoffset() == timedelta(0)
    assert printed == done
