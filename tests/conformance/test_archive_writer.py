"""The SQLite archive's writer process beside a real server: it goes when the server
goes, even by kill -9, and a writer that dies is started again while the server serves on
(docs/performance.md, "The archive writer (SQLite)")."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from support.omnia import OmniaClient
from support.server import SCRIPT, ServerProcess

WAIT = 20.0  # deadline for a process to exit, or a probe to change its answer
WRITER_MODULE = "portico.store.sqlite_process"


def scripted(tmp_path: Path) -> ServerProcess:
    return ServerProcess(
        tmp_path / "data",
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={"PORTICO_SQLITE_WRITER": "process"},
    )


def writer_of(server: ServerProcess) -> int:
    """The server's archive writer: its child process running the writer module."""
    assert server.process is not None
    parent = server.process.pid
    children = [
        int(pid)
        for task in Path(f"/proc/{parent}/task").iterdir()
        for pid in (task / "children").read_text().split()
    ]
    (writer,) = [pid for pid in children if WRITER_MODULE in command_line(pid)]
    return writer


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


async def until_exited(pid: int) -> None:
    """Returns once `pid` has exited (its pidfd turns readable then)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    loop.add_reader(pidfd, exited.set)
    try:
        async with asyncio.timeout(WAIT):
            await exited.wait()
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


@contextlib.asynccontextmanager
async def after_a_turn(
    http: aiohttp.ClientSession, tmp_path: Path
) -> AsyncIterator[tuple[ServerProcess, OmniaClient]]:
    """A scripted server whose writer has written one turn, and its client."""
    server = scripted(tmp_path).start()
    try:
        client = OmniaClient(await http.ws_connect(server.ws_url))
        await client.connected()
        await client.ask("hi")
        yield server, client
    finally:
        server.stop()


async def test_a_server_killed_with_sigkill_leaves_no_writer_behind(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with after_a_turn(http, tmp_path) as (server, _):
        writer = writer_of(server)
        server.stop(signal.SIGKILL)
        await until_exited(writer)  # its pipe closed: it exits by itself


async def test_a_writer_that_dies_is_started_again_and_turns_go_on(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    async with after_a_turn(http, tmp_path) as (server, client):
        async with http.get(server.http_url + "/readyz") as ready:
            assert ready.status == 200
        writer = writer_of(server)
        os.kill(writer, signal.SIGKILL)
        await until_exited(writer)
        # Meanwhile writes fail at once and /readyz says the archive is down (the store's
        # contract tests hold the writer dead to see it); within its second a new one runs.
        async with asyncio.timeout(WAIT):  # a deadline: the new writer is polled for
            while not (await ready_now(http, server)) or not has_writer(server):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert writer_of(server) != writer
        *_, last = await client.ask("again")
        assert last["type"] == "done", last
        assert "the archive writer process started again" in server.log_path.read_text()


async def ready_now(http: aiohttp.ClientSession, server: ServerProcess) -> bool:
    async with http.get(server.http_url + "/readyz") as probe:
        return probe.status == 200


def has_writer(server: ServerProcess) -> bool:
    try:
        writer_of(server)
    except ValueError:  # none (or, for a moment, two)
        return False
    return True
