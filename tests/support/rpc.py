"""A frame-level `/v1/rpc` test client: requests by id, pushes recorded as they arrive.

Every frame the server sends is validated against the committed AsyncAPI document
(docs/asyncapi/rpc.json), as the `/ws` and `/v1/session` test clients do.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema

RECEIVE_TIMEOUT = 10.0
Frame = dict[str, Any]
ASYNCAPI = Path(__file__).resolve().parents[2] / "docs" / "asyncapi" / "rpc.json"


@cache
def _validator() -> jsonschema.Draft202012Validator:
    document = json.loads(ASYNCAPI.read_text())
    schema = {"$ref": "#/components/schemas/ServerFrame", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema)


class RpcClosed(Exception):
    def __init__(self, code: int | None) -> None:
        super().__init__(f"closed {code}")
        self.code = code


class RpcProbe:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.connected: Frame = {}
        self.updates: list[Frame] = []  # `update` payloads, in arrival order
        self.gaps: list[int] = []
        self.live: list[Frame] = []
        self.errors: list[Frame] = []  # frame-level `error`s
        self.replies: dict[str, Frame] = {}
        self._ids = itertools.count(1)

    @classmethod
    async def open(
        cls,
        http: aiohttp.ClientSession,
        url: str,
        *,
        token: str | None = None,
        offset: int | None = None,
        epoch: str | None = None,
    ) -> RpcProbe:
        probe = cls(await http.ws_connect(url, autoping=True))
        connect: Frame = {"type": "connect"}
        for key, value in (("token", token), ("offset", offset), ("epoch", epoch)):
            if value is not None:
                connect[key] = value
        await probe.send(connect)
        probe.connected = await probe.next_frame()
        return probe

    async def send(self, frame: Frame) -> None:
        await self.ws.send_str(json.dumps(frame))

    async def next_frame(self, within: float = RECEIVE_TIMEOUT) -> Frame:
        """The next frame; pushes and replies are also recorded."""
        msg = await self.ws.receive(timeout=within)
        if msg.type is not aiohttp.WSMsgType.TEXT:
            raise RpcClosed(self.ws.close_code)
        frame: Frame = json.loads(msg.data)
        _validator().validate(frame)
        kind = frame.get("type")
        if kind == "update":
            self.updates.append(frame["update"])
        elif kind == "gap":
            self.gaps.append(frame["offset"])
        elif kind == "live":
            self.live.append(frame["live"])
        elif kind == "error":
            self.errors.append(frame)
        elif "id" in frame:
            self.replies[frame["id"]] = frame
        return frame

    async def request(self, method: str, params: Frame | None = None) -> Frame:
        """Send a request and read until its reply (recording pushes meanwhile)."""
        request_id = f"r-{next(self._ids)}"
        frame: Frame = {"id": request_id, "method": method}
        if params is not None:
            frame["params"] = params
        await self.send(frame)
        while request_id not in self.replies:
            await self.next_frame()
        return self.replies[request_id]

    async def call(self, method: str, params: Frame | None = None) -> Any:
        """The result of a request that must succeed."""
        reply = await self.request(method, params)
        assert "error" not in reply, reply
        return reply["result"]

    async def error(self, method: str, params: Frame | None = None) -> Frame:
        """The error of a request that must fail."""
        reply = await self.request(method, params)
        assert "error" in reply, reply
        error: Frame = reply["error"]
        return error

    async def until(
        self, done: Callable[[RpcProbe], bool], within: float = RECEIVE_TIMEOUT
    ) -> None:
        """Read frames until `done(self)` holds."""
        async with asyncio.timeout(within):
            while not done(self):
                await self.next_frame()

    def offsets(self) -> list[int]:
        return [update["offset"] for update in self.updates]

    def entities(self, kind: str) -> list[Frame]:
        """Every pushed entity of a kind, in order."""
        return [
            data
            for update in self.updates
            for item, data in zip(update["items"], update["data_list"], strict=True)
            if item["entity"] == kind
        ]

    async def wait_turn_end(self, session_id: str) -> Frame:
        """Read until a turn of the session has a terminal state; that turn."""
        terminal = {"completed", "failed", "cancelled", "interrupted"}

        def ended(probe: RpcProbe) -> bool:
            return any(
                t["session_id"] == session_id and t["status"] in terminal
                for t in probe.entities("turn")
            )

        await self.until(ended)
        return next(
            t
            for t in self.entities("turn")
            if t["session_id"] == session_id and t["status"] in terminal
        )

    async def close(self) -> None:
        await self.ws.close()
