"""A `/ws` voice caller for the conformance tests: binary frames in, text and binary
frames out (docs/voice.md), on one server or across replicas."""

from __future__ import annotations

import asyncio
import itertools
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from portico.protocols.omnia.binary import BinaryFrame, BinaryMetadata, decode_frame, encode_frame
from support.omnia import OmniaClient, check_server_frame, without_timestamp
from support.server import FIXTURES, SCRIPT, ServerProcess

WAIT = 10.0  # seconds; a deadline, never a threshold
LOUD = struct.pack("<320h", *([9000] * 320))  # 20 ms of 16 kHz mono pcm16, loud
QUIET = bytes(640)
FORMAT = BinaryMetadata(codec="pcm16", sample_rate=16000, channels=1, mime_type="audio/pcm")

USERS = 60  # principals with an API key: `voice-<n>` is caller `caller-<n>`

_users = itertools.count()


def agent(script: str) -> dict[str, Any]:
    return {
        "runtime": "scripted",
        "script": str(SCRIPT),
        "duplex_runtime": "scripted",
        "duplex_script": str(FIXTURES / script),
    }


def write_voice_config(data_dir: Path, **settings: Any) -> Path:
    """A server's config: API keys, and agents taking calls with the scripted runtime
    (`default`: tests/fixtures/voice.yaml, `long`, `failing`, `video`)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "portico.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "auth": "apikey",
                "api_keys": {f"voice-{n}": f"caller-{n}" for n in range(USERS)},
                "runtime": "scripted",
                "script": str(SCRIPT),
                "agents": {
                    "default": agent("voice.yaml"),
                    "long": agent("voice_long.yaml"),
                    "failing": agent("voice_fail.yaml"),
                    "video": agent("voice_video.yaml"),
                },
                **settings,
            }
        )
    )
    return config


class Caller(OmniaClient):
    """A `/ws` client that speaks: binary frames in, text and binary frames out."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        super().__init__(ws)
        self.sequence = 0
        self.session_id = ""
        self.token = ""
        self.connected_frame: dict[str, Any] = {}

    async def speak(self, *payloads: bytes, is_last: bool = False, first: bool = False) -> None:
        for index, payload in enumerate(payloads):
            last = is_last and index == len(payloads) - 1
            meta = FORMAT if first and index == 0 else BinaryMetadata()
            frame = BinaryFrame(
                sequence=self.sequence, media_id="mic", metadata=meta, payload=payload, is_last=last
            )
            self.sequence += 1
            await self.ws.send_bytes(encode_frame(frame))

    async def next(self, within: float = WAIT) -> dict[str, Any] | BinaryFrame:
        msg = await asyncio.wait_for(self.ws.receive(), within)
        if msg.type is aiohttp.WSMsgType.BINARY:
            return decode_frame(msg.data)
        if msg.type is not aiohttp.WSMsgType.TEXT:
            raise AssertionError(f"the socket ended: {msg.type!r} {msg.data!r}")
        frame = check_server_frame(msg.data)
        self.frames.append(frame)
        return without_timestamp(frame)

    async def until(
        self, done: Callable[[dict[str, Any] | BinaryFrame], bool], within: float = WAIT
    ) -> list[dict[str, Any] | BinaryFrame]:
        """Frames up to and including the first for which `done` holds."""
        seen: list[dict[str, Any] | BinaryFrame] = []
        try:
            async with asyncio.timeout(within):
                while not seen or not done(seen[-1]):
                    seen.append(await self.next())
        except TimeoutError:
            raise AssertionError(f"not there in {within}s; got {texts(seen)}") from None
        return seen

    async def silent(self, seconds: float = 0.4) -> None:
        """Nothing at all arrives for a while (a refused call's frames go unanswered)."""
        try:
            msg = await asyncio.wait_for(self.ws.receive(), seconds)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected frame: {msg.data!r}")


def is_type(kind: str) -> Callable[[dict[str, Any] | BinaryFrame], bool]:
    return lambda frame: isinstance(frame, dict) and frame["type"] == kind


def kinds(frames: list[dict[str, Any] | BinaryFrame]) -> list[str]:
    return ["binary" if isinstance(f, BinaryFrame) else f["type"] for f in frames]


def texts(frames: list[dict[str, Any] | BinaryFrame]) -> list[dict[str, Any]]:
    return [f for f in frames if isinstance(f, dict)]


class Dial:
    def __init__(self, http: aiohttp.ClientSession, server: ServerProcess) -> None:
        self.http, self.server = http, server

    def user(self) -> str:
        return f"voice-{next(_users)}"

    def on(self, server: ServerProcess) -> Dial:
        """The same dialer, to another server (replica)."""
        return Dial(self.http, server)

    async def __call__(self, query: str = "", *, token: str) -> Caller:
        ws = await self.http.ws_connect(
            self.server.ws_url + query, headers={"Authorization": f"Bearer {token}"}
        )
        caller = Caller(ws)
        connected = await caller.next()
        assert isinstance(connected, dict), connected
        assert connected["type"] == "connected", connected
        caller.session_id, caller.token = connected["session_id"], token
        caller.connected_frame = connected
        return caller


async def metric(http: aiohttp.ClientSession, server: ServerProcess, name: str) -> float:
    async with http.get(server.http_url + "/metrics") as response:
        text = await response.text()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0
