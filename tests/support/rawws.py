"""A minimal WebSocket client on a raw socket, for a peer that truly stops reading.

Library clients buffer eagerly in user space, so "not calling receive()" does not
stop the bytes flowing; a small SO_RCVBUF and no reads does.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct

OPCODE_TEXT = 0x1
OPCODE_CLOSE = 0x8


class RawWebSocket:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(
        cls,
        port: int,
        path: str = "/ws",
        *,
        rcvbuf: int = 4096,
        limit: int = 2**24,
        headers: dict[str, str] | None = None,
    ) -> RawWebSocket:
        """`limit`: the reader stops taking bytes off the socket once about twice this
        much waits unread (asyncio's flow control), so a small one stalls for real.
        `headers`: more request headers (with a `Sec-WebSocket-Extensions` offer the
        frames read back are compressed: only their count and opcodes mean anything)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
        key = base64.b64encode(os.urandom(16)).decode()
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\n{extra}\r\n".encode()
        )
        status = await reader.readuntil(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 101"), status
        return cls(reader, writer)

    async def send_text(self, text: str) -> None:
        payload = text.encode()
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        if len(payload) < 126:
            header = struct.pack("!BB", 0x80 | OPCODE_TEXT, 0x80 | len(payload))
        else:
            header = struct.pack("!BBH", 0x80 | OPCODE_TEXT, 0x80 | 126, len(payload))
        self.writer.write(header + mask + masked)
        await self.writer.drain()

    async def read_frame(self) -> tuple[int, bytes]:
        """One server frame (never masked, never fragmented by Portico)."""
        first, second = await self.reader.readexactly(2)
        length = second & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", await self.reader.readexactly(2))
        elif length == 127:
            (length,) = struct.unpack("!Q", await self.reader.readexactly(8))
        return first & 0x0F, await self.reader.readexactly(length)

    async def read_until_close(self) -> tuple[int, int]:
        """Read to the close frame: (its code, how many text frames came before it)."""
        texts = 0
        while True:
            opcode, payload = await self.read_frame()
            if opcode == OPCODE_CLOSE:
                return struct.unpack("!H", payload[:2])[0], texts
            texts += opcode == OPCODE_TEXT

    def close(self) -> None:
        self.writer.close()

    def reset(self) -> None:
        """Hang up with a TCP reset (SO_LINGER 0), as a crashed client or a cut network
        does: the server's next writes find the connection gone."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()
