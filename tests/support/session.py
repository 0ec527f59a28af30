"""A frame-level `/v1/session` test client: explicit seqs and acks, strict checking.

Every frame the server sends is decoded with the typed models (unknown fields
forbidden where the models forbid them) and validated against the committed
AsyncAPI document, as the `/ws` test client does.
"""

from __future__ import annotations

import asyncio
import json
from functools import cache
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema

from portico.protocols.omnia.binary import BinaryFrame, decode_frame
from portico.protocols.session.frames import server_frame_decoder

ASYNCAPI = Path(__file__).resolve().parents[2] / "docs" / "asyncapi" / "session.json"
RECEIVE_TIMEOUT = 10.0
UNNUMBERED = ("ack", "pong", "ping", "ready")


@cache
def _validator() -> jsonschema.Draft202012Validator:
    document = json.loads(ASYNCAPI.read_text())
    schema = {"$ref": "#/components/schemas/ServerFrame", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema)


def check_frame(text: str) -> dict[str, Any]:
    server_frame_decoder.decode(text)
    frame: dict[str, Any] = json.loads(text)
    _validator().validate(frame)
    return frame


class Closed(Exception):
    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"closed {code} {reason}")
        self.code = code
        self.reason = reason


class SessionProbe:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.handled = 0  # the last server seq this probe handled
        self.next_seq = 1
        self.received: list[dict[str, Any]] = []
        # Binary (media) frames, decoded, in arrival order; `received_all` interleaves
        # them (as `BinaryFrame`s) with the text frames, for ordering checks.
        self.binary: list[BinaryFrame] = []
        self.received_all: list[dict[str, Any] | BinaryFrame] = []

    @classmethod
    async def connect(cls, http: aiohttp.ClientSession, url: str) -> SessionProbe:
        return cls(await http.ws_connect(url, autoping=True))

    async def send(self, frame: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(frame))

    async def hello(self, **fields: Any) -> dict[str, Any]:
        """Send hello and return the first frame back (ready, or an error)."""
        await self.send({"type": "hello", "protocol": 1, **fields})
        return await self.recv()

    async def message(self, content: str = "hi", *, seq: int | None = None, **fields: Any) -> int:
        """A numbered message; `seq` defaults to the next one and advances the counter."""
        if seq is None:
            seq, self.next_seq = self.next_seq, self.next_seq + 1
        await self.send({"type": "message", "seq": seq, "content": content, **fields})
        return seq

    async def numbered(self, kind: str, *, seq: int | None = None, **fields: Any) -> int:
        if seq is None:
            seq, self.next_seq = self.next_seq, self.next_seq + 1
        await self.send({"type": kind, "seq": seq, **fields})
        return seq

    async def ack(self, seq: int | None = None) -> None:
        await self.send({"type": "ack", "seq": self.handled if seq is None else seq})

    async def recv(self, within: float = RECEIVE_TIMEOUT) -> dict[str, Any]:
        """The next text frame; binary frames on the way are decoded into `binary`."""
        msg = await asyncio.wait_for(self.ws.receive(), within)
        while msg.type is aiohttp.WSMsgType.BINARY:
            frame = decode_frame(msg.data)
            self.binary.append(frame)
            self.received_all.append(frame)
            msg = await asyncio.wait_for(self.ws.receive(), within)
        if msg.type is not aiohttp.WSMsgType.TEXT:
            raise Closed(
                self.ws.close_code if msg.type is not aiohttp.WSMsgType.CLOSE else msg.data,
                str(msg.extra),
            )
        frame = check_frame(msg.data)
        self.received.append(frame)
        self.received_all.append(frame)
        seq = frame.get("seq")
        if isinstance(seq, int) and frame["type"] != "ack":  # an ack's seq is the peer's
            assert seq <= self.handled + 1, f"gap: got {seq} after {self.handled}"
            self.handled = max(self.handled, seq)
        return frame

    async def recv_numbered(self, within: float = RECEIVE_TIMEOUT) -> dict[str, Any]:
        """The next numbered frame, skipping acks and pongs."""
        while True:
            frame = await self.recv(within)
            if frame["type"] not in UNNUMBERED:
                return frame

    async def turn(self, within: float = RECEIVE_TIMEOUT) -> list[dict[str, Any]]:
        """Numbered frames up to and including a `done` or a turn's `error`."""
        frames: list[dict[str, Any]] = []
        while True:
            frame = await self.recv_numbered(within)
            frames.append(frame)
            if frame["type"] == "done" or (frame["type"] == "error" and "turn_id" in frame):
                return frames

    async def closed(self, within: float = RECEIVE_TIMEOUT) -> tuple[int | None, str]:
        """Read until the server closes; its close code and reason."""
        try:
            while True:
                await self.recv(within)
        except Closed as closed:
            return closed.code, closed.reason

    def numbered_seqs(self) -> list[int]:
        return [
            f["seq"] for f in self.received if isinstance(f.get("seq"), int) and f["type"] != "ack"
        ]
