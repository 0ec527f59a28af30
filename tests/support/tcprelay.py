"""A TCP relay in front of a real server that a test can stall: a backend gone silent.

    async with TcpRelay(port) as relay:      # relay.port forwards to 127.0.0.1:port
        ...
        relay.stall()                        # every connection, open or new, goes quiet
        relay.resume()
        relay.sent                           # every byte clients sent upstream so far

Stalled, the relay accepts connections and reads what arrives but forwards nothing in
either direction, as a backend does that hangs without closing its sockets.
"""

from __future__ import annotations

import asyncio
import contextlib

READ_BYTES = 64 * 1024


class TcpRelay:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self._target = (host, target_port)
        self._server: asyncio.Server | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.sent = bytearray()  # what clients sent towards the server, in order

    def stall(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    async def __aenter__(self) -> TcpRelay:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, self.sent)),
            asyncio.create_task(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pumps, return_exceptions=True)
        self._tasks.difference_update(pumps)
        for side in (writer, up_writer):
            side.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        record: bytearray | None = None,
    ) -> None:
        while data := await reader.read(READ_BYTES):
            if record is not None:
                record += data
            await self._open.wait()  # stalled: hold the bytes, send nothing
            writer.write(data)
            await writer.drain()
        # One side closed: so does the relay towards the other (a client waiting for
        # the server to hang up, as asyncpg's close does, would wait for ever).
        writer.close()
