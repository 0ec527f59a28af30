"""A fake OpenAI Realtime API: a real aiohttp WebSocket on 127.0.0.1.

It runs in the test's own event loop (the runtime under test is driven there
too, at the port level). A test scripts it from outside: `push()` sends server
events down the current call's socket, `received()` waits for a client event
of a type, `drop()` closes the socket mid-call. The handshake checks the bearer
key (401 when wrong) and records the query and headers.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from aiohttp import WSMsgType, web

from portico.config import AgentSettings

WITHIN = 10.0
KEY = "sk-fake-realtime"
KEY_ENV = "FAKE_REALTIME_KEY"


class FakeRealtime:
    def __init__(self) -> None:
        self.client_events: list[dict[str, Any]] = []
        self.handshakes: list[dict[str, str]] = []
        self.refuse_status: int | None = None  # answer the handshake with this status
        self.stall = asyncio.Event()  # until set (by stop), a stalling handshake waits
        self.stalling = False  # hold every handshake until `stall` is set
        self._socket: web.WebSocketResponse | None = None
        self._connected = asyncio.Event()
        self._arrived = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def agent(self, **overrides: Any) -> AgentSettings:
        fields: dict[str, Any] = {
            "runtime": "openai-realtime",
            "base_url": self.base_url,
            "model": "gpt-realtime-test",
            "api_key_env": KEY_ENV,
            "first_token_timeout": WITHIN,
        }
        return AgentSettings(**(fields | overrides))

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/realtime", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        self.stall.set()
        if self._socket is not None:
            await self._socket.close()  # else cleanup waits out a call left open
        if self._runner is not None:
            await self._runner.cleanup()

    async def push(self, *events: dict[str, Any]) -> None:
        await asyncio.wait_for(self._connected.wait(), WITHIN)
        assert self._socket is not None
        for event in events:
            await self._socket.send_json(event)

    async def push_audio(self, pcm: bytes, item_id: str = "item_1") -> None:
        delta = base64.b64encode(pcm).decode("ascii")
        await self.push({"type": "response.audio.delta", "item_id": item_id, "delta": delta})

    async def drop(self) -> None:
        await asyncio.wait_for(self._connected.wait(), WITHIN)
        assert self._socket is not None
        await self._socket.close()

    async def received(self, kind: str, count: int = 1) -> list[dict[str, Any]]:
        """The client events of `kind`, once at least `count` arrived."""

        def of_kind() -> list[dict[str, Any]]:
            return [e for e in self.client_events if e.get("type") == kind]

        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(lambda: len(of_kind()) >= count), WITHIN)
        return of_kind()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.handshakes.append(
            {
                "model": request.query.get("model", ""),
                "authorization": request.headers.get("Authorization", ""),
                "beta": request.headers.get("OpenAI-Beta", ""),
            }
        )
        if self.stalling:
            await self.stall.wait()
        if self.refuse_status is not None:
            return web.Response(status=self.refuse_status)
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": {"code": "invalid_api_key"}}, status=401)
        socket = web.WebSocketResponse()
        await socket.prepare(request)
        self._socket = socket
        self._connected.set()
        await socket.send_json({"type": "session.created", "session": {}})
        async for message in socket:
            if message.type == WSMsgType.TEXT:
                async with self._arrived:
                    self.client_events.append(message.json())
                    self._arrived.notify_all()
        return socket
