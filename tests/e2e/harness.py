"""What the browser tests share: tool checks, the TCP proxy, page-error capture."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import threading
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path(os.environ.get("PORTICO_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "e2e"
WORD_DELAY = 0.005  # seconds between the demo agent's words: `slow` takes about 4 s
HEARTBEAT = 1.0  # /v1/session pings every second, so a half-open link is found in 2.5 s


USERS = 64  # API keys `key-N` for `user-N`: each test is a user of its own


def missing_tools() -> list[str]:
    missing = []
    if importlib.util.find_spec("playwright") is None:
        missing.append("the playwright package (pip install -e '.[e2e]')")
    if not CHROMIUM.exists():
        missing.append(f"Chromium at {CHROMIUM} (apt-get install chromium)")
    return missing


def require_tools() -> None:
    missing = missing_tools()
    if missing:
        message = "browser tests need " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs them (.ci/run): never skip there
        pytest.skip(message)


class TcpProxy:
    """A byte relay to 127.0.0.1:`upstream`, running its own event loop in a thread."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.port = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> TcpProxy:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._accept, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def cut_all(self) -> int:
        """Abort every open connection (no close frame, no FIN); returns how many."""
        return int(self._call(self._cut()))

    def freeze_all(self) -> int:
        """Open connections stop relaying in both directions and stay open: half-open."""
        return int(self._call(self._freeze()))

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=10)

    async def _cut(self) -> int:
        links = list(self._links)
        for link in links:
            link.abort()
        return len(links)

    async def _freeze(self) -> int:
        for link in self._links:
            link.frozen = True
        return len(self._links)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.transport.abort()
            return
        link = _Link(writer, up_writer)
        self._links.add(link)
        self.connections += 1
        try:
            await asyncio.gather(link.pipe(reader, up_writer), link.pipe(up_reader, writer))
        finally:
            self._links.discard(link)
            link.abort()


class _Link:
    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.writers = (client, upstream)
        self.frozen = False

    async def pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await source.read(65536):
                if self.frozen:
                    continue  # swallowed: the peers hear nothing and are not told
                sink.write(data)
                await sink.drain()
        if not self.frozen:
            self.abort()

    def abort(self) -> None:
        for writer in self.writers:
            writer.transport.abort()


def watch(tab: Any, errors: list[str]) -> None:
    tab.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    tab.on(
        "console",
        lambda message: (
            errors.append(f"console: {message.text}")
            if message.type == "error" and "Content Security Policy" in message.text
            else None
        ),
    )
