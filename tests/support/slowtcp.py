"""A TCP relay that delays every request: a backend reached slowly (Redis across a
busy network), in a thread of its own so it serves while the test blocks."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType

START_TIMEOUT = 5.0


class SlowRelay:
    """Relays 127.0.0.1:`port` to `upstream`; bytes going there wait `delay` seconds
    (so a command takes effect that much later, not only its answer)."""

    def __init__(self, upstream: tuple[str, int], *, delay: float) -> None:
        self.upstream = upstream
        self.delay = delay
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> SlowRelay:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT):
            raise RuntimeError("the relay did not start")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        await asyncio.gather(_delayed(reader, up_writer, self.delay), _pipe(up_reader, writer))


async def _delayed(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float
) -> None:
    """Forward what arrives `delay` seconds later, in order; what is still on its way
    when the sender goes away is lost with it (as a dying host's unsent data)."""
    loop = asyncio.get_running_loop()
    gone = False

    def forward(data: bytes) -> None:
        if not gone and not writer.is_closing():
            writer.write(data)

    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            loop.call_later(delay, forward, data)
    gone = True
    writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()
