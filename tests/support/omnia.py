"""A strict `/ws` test client: every frame the server sends is checked twice,
against the typed models (msgspec, unknown fields forbidden) and against the
committed AsyncAPI document (JSON Schema)."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema

from portico.protocols.omnia.frames import server_frame_decoder

ASYNCAPI = Path(__file__).resolve().parents[2] / "docs" / "asyncapi" / "omnia.json"
RECEIVE_TIMEOUT = 10.0
TERMINAL_TYPES = ("done", "error")


@cache
def server_frame_validator() -> jsonschema.Draft202012Validator:
    document = json.loads(ASYNCAPI.read_text())
    schema = {"$ref": "#/components/schemas/ServerFrame", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema)


def check_server_frame(text: str) -> dict[str, Any]:
    server_frame_decoder.decode(text)  # raises on any shape the models do not allow
    frame: dict[str, Any] = json.loads(text)
    server_frame_validator().validate(frame)
    # Omnia's dashboard dates every message from it ("Invalid Date" otherwise).
    assert datetime.fromisoformat(frame["timestamp"]).utcoffset() == timedelta(0), frame
    return frame


def without_timestamp(frame: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in frame.items() if key != "timestamp"}


class OmniaClient:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        # Every frame received, as sent; `recv` returns it without its (checked) `timestamp`.
        self.frames: list[dict[str, Any]] = []

    async def send(self, frame: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(frame))

    async def send_raw(self, text: str) -> None:
        await self.ws.send_str(text)

    async def recv(self, within: float = RECEIVE_TIMEOUT) -> dict[str, Any]:
        msg = await asyncio.wait_for(self.ws.receive(), within)
        if msg.type is not aiohttp.WSMsgType.TEXT:
            raise AssertionError(f"expected a text frame, got {msg.type!r} {msg.data!r}")
        frame = check_server_frame(msg.data)
        self.frames.append(frame)
        return without_timestamp(frame)

    async def connected(self) -> dict[str, Any]:
        frame = await self.recv()
        assert frame["type"] == "connected", frame
        return frame

    async def turn(self, within: float = RECEIVE_TIMEOUT) -> list[dict[str, Any]]:
        """Frames up to and including the next terminal frame."""
        frames: list[dict[str, Any]] = []
        while not frames or frames[-1]["type"] not in TERMINAL_TYPES:
            frames.append(await self.recv(within))
        return frames

    async def ask(self, content: str = "hi", **fields: Any) -> list[dict[str, Any]]:
        await self.send({"type": "message", "content": content, **fields})
        return await self.turn()

    async def expect_silence(self, seconds: float = 0.3) -> None:
        """Nothing arrives for a short while (used after a terminal frame)."""
        try:
            # wait_for, not receive(timeout=): aiohttp restarts that timeout on every ping.
            msg = await asyncio.wait_for(self.ws.receive(), seconds)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected frame after the terminal one: {msg.data!r}")


def scenario(name: str) -> dict[str, Any]:
    return {"metadata": {"mock_scenario": name}}


__all__ = ["OmniaClient", "check_server_frame", "scenario"]
