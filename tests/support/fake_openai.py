"""A fake OpenAI-compatible `/chat/completions` server, and a small HTTP API for tools.

Real HTTP on 127.0.0.1 and real server-sent events, each server in a thread of
its own with its own event loop: a `portico serve` process reaches it during and
between a test's awaits. A test scripts the replies (a queue: statuses, chunked
deltas, tool calls, pauses, mid-stream drops) and reads every request it got.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from portico.config import AgentSettings
from portico.domain.model import ContentPart, ContentType, MediaContent, Message, Role, new_id
from portico.errors import MediaNotFound
from portico.runtime.base import (
    Chunk,
    ClientTool,
    Runtime,
    RuntimeEvent,
    ToolCall,
    ToolOutcome,
    TurnInput,
)

WITHIN = 10.0


@dataclass(frozen=True)
class Pause:
    """Inside a reply's events: send nothing for this long."""

    seconds: float


@dataclass(frozen=True)
class Gate:
    """Inside a reply's events: send nothing until the test opens the gate."""

    opened: threading.Event = field(default_factory=threading.Event)

    def open(self) -> None:
        self.opened.set()


Event = dict[str, Any] | str | bytes | Pause | Gate


@dataclass(frozen=True)
class Reply:
    """One scripted response. `events` become `data:` lines (dicts as JSON, str as is,
    bytes written raw); `done` ends with `data: [DONE]`; `drop` cuts the connection
    after the events instead of ending the stream."""

    status: int = 200
    events: tuple[Event, ...] = ()
    done: bool = True
    drop: bool = False
    delay: float = 0.0  # before the response headers
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""  # of a non-200 reply
    content_type: str = "text/event-stream"


@dataclass(frozen=True)
class Recorded:
    path: str  # decoded
    raw_path: str  # as sent, with the query
    method: str
    headers: dict[str, str]
    query: dict[str, str]
    body: Any  # JSON when it parsed, else the text


# -- building replies -------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "model": "fake-model",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
    }


def text(*pieces: str, tokens: tuple[int, int] = (10, 5), **reply: Any) -> Reply:
    """A streamed answer, one chunk per piece, then the finish and the usage chunk."""
    events: list[Event] = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": piece}) for piece in pieces]
    events += [chunk({}, "stop"), usage(*tokens)]
    return Reply(events=tuple(events), **reply)


def tool_calls(
    *calls: tuple[str, Any], pieces: int = 3, say: str = "", tokens: tuple[int, int] = (20, 8)
) -> Reply:
    """A response asking for tools; each call's arguments (a dict, or raw text) are
    streamed in `pieces` deltas, as real servers split them."""
    events: list[Event] = [chunk({"role": "assistant", "content": say or None})]
    for index, (name, arguments) in enumerate(calls):
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
        size = max(1, -(-len(raw) // pieces))
        first = {"index": index, "id": f"call_{index}", "type": "function"}
        first["function"] = {"name": name, "arguments": ""}
        events.append(chunk({"tool_calls": [first]}))
        for start in range(0, len(raw), size):
            part = {"index": index, "function": {"arguments": raw[start : start + size]}}
            events.append(chunk({"tool_calls": [part]}))
    events += [chunk({}, "tool_calls"), usage(*tokens)]
    return Reply(events=tuple(events))


SECRET_BODY = '{"error": {"message": "invalid key sk-live-SECRET for org-SECRET"}}'


def failure(
    status: int, *, body: str = SECRET_BODY, headers: dict[str, str] | None = None
) -> Reply:
    return Reply(status=status, body=body, headers=headers or {}, content_type="application/json")


# -- the servers ------------------------------------------------------------------------------


class ThreadedApp:
    """An aiohttp application served on 127.0.0.1 from a thread with its own loop."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        self.port = 0

    def start(self) -> None:
        self._thread.start()
        self.port = self._call(self._serve())

    def stop(self) -> None:
        self._call(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(WITHIN)
        self._loop.close()

    def _call(self, coroutine: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(WITHIN)  # type: ignore[arg-type]

    async def _serve(self) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        port: int = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return port


class Recorder:
    def __init__(self) -> None:
        self.requests: list[Recorded] = []

    async def record(self, request: web.Request) -> Recorded:
        raw = await request.text()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        recorded = Recorded(
            path=request.path,
            raw_path=request.raw_path,
            method=request.method,
            headers=dict(request.headers),
            query=dict(request.query),
            body=body,
        )
        self.requests.append(recorded)
        return recorded

    async def wait_for(self, count: int, within: float = WITHIN) -> list[Recorded]:
        """At least `count` requests (polled: the server runs in another thread)."""
        deadline = time.monotonic() + within
        while len(self.requests) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.requests)} requests, expected {count}")
            await asyncio.sleep(0.01)
        return list(self.requests)


class FakeOpenAI(Recorder):
    """`POST /v1/chat/completions`, answered with the scripted replies in order; an
    unscripted request gets a 500 (a test that sends more than it scripted fails)."""

    def __init__(self) -> None:
        super().__init__()
        self._replies: deque[Reply] = deque()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        self._server = ThreadedApp(app)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}/v1"

    def start(self) -> FakeOpenAI:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def push(self, *replies: Reply) -> None:
        self._replies.extend(replies)

    def reset(self) -> None:
        self._replies.clear()
        self.requests.clear()

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [request.body for request in self.requests]

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        await self.record(request)
        reply = self._replies.popleft() if self._replies else failure(500, body="unscripted")
        if reply.delay:
            await asyncio.sleep(reply.delay)
        if reply.status != 200:
            return web.Response(
                status=reply.status,
                text=reply.body,
                headers=reply.headers,
                content_type=reply.content_type,
            )
        response = web.StreamResponse(headers={"Content-Type": reply.content_type})
        await response.prepare(request)
        await _send_events(response, reply.events)
        if reply.drop:
            assert request.transport is not None
            request.transport.abort()  # no final chunk: the client sees a broken stream
            return response
        if reply.done:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _send_events(response: web.StreamResponse, events: Iterable[Event]) -> None:
    for event in events:
        if isinstance(event, Pause):
            await asyncio.sleep(event.seconds)
        elif isinstance(event, Gate):
            await asyncio.get_running_loop().run_in_executor(None, event.opened.wait, WITHIN)
        elif isinstance(event, bytes):
            await response.write(event)
        else:
            data = event if isinstance(event, str) else json.dumps(event)
            await response.write(f"data: {data}\n\n".encode())


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ToolApi(Recorder):
    """A second local HTTP server, the endpoint of the agents' HTTP tools:
    `GET /weather/{city}` answers JSON, `GET /big` more bytes than a small cap,
    `GET /slow` too late, `POST /notes` echoes its JSON body, `GET /missing` 404."""

    BIG_BYTES = 4096

    def __init__(self) -> None:
        super().__init__()
        app = web.Application()
        routes: list[tuple[str, str, Handler]] = [
            ("GET", "/weather/{city}", self._weather),
            ("GET", "/big", self._big),
            ("GET", "/slow", self._slow),
            ("POST", "/notes", self._notes),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        self._server = ThreadedApp(app)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}"

    def start(self) -> ToolApi:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    async def _weather(self, request: web.Request) -> web.StreamResponse:
        await self.record(request)
        city = request.match_info["city"]
        return web.json_response({"city": city, "celsius": 21, "units": request.query.get("units")})

    async def _big(self, request: web.Request) -> web.StreamResponse:
        await self.record(request)
        return web.Response(text="x" * self.BIG_BYTES)

    async def _slow(self, request: web.Request) -> web.StreamResponse:
        await self.record(request)
        await asyncio.sleep(2.0)
        return web.json_response({"late": True})

    async def _notes(self, request: web.Request) -> web.StreamResponse:
        recorded = await self.record(request)
        return web.json_response({"saved": recorded.body}, status=201)


# -- driving the runtime directly ---------------------------------------------------------------

KEY_ENV = "FAKE_OPENAI_KEY"
KEY = "sk-test-key"
ENV = {KEY_ENV: KEY}
# Short enough for fast tests, long enough for a loaded CI machine to meet.
FAST = {
    "first_token_timeout": 2.0,
    "stream_idle_timeout": 1.0,
    "request_timeout": 10.0,
    "retries": 2,
    "retry_backoff": 0.01,
    "retry_backoff_max": 0.05,
}


def agent_settings(base_url: str, **overrides: Any) -> AgentSettings:
    settings = {
        "runtime": "openai",
        "base_url": base_url,
        "model": "fake-model",
        "provider": "fake",
        "api_key_env": KEY_ENV,
        **FAST,
        **overrides,
    }
    return msgspec.convert(settings, AgentSettings)


def message(
    content: str = "hi",
    *,
    role: Role = "user",
    content_type: ContentType = "text",
    parts: tuple[ContentPart, ...] = (),
    metadata: dict[str, str] | None = None,
) -> Message:
    return Message(
        id=new_id("msg"),
        session_id="sess-1",
        role=role,
        content=content,
        content_type=content_type,
        parts=parts,
        metadata=metadata or {},
        created_at=0.0,
        updated_at=0.0,
    )


class InlineMedia:
    """The media port for inline `data` parts only (what unit tests send)."""

    async def check_part(self, *, principal: str, session_id: str, media: MediaContent) -> None:
        return None

    async def read(self, *, session_id: str, media: MediaContent) -> bytes:
        if media.data is None:
            raise MediaNotFound("only inline data in this test")
        return base64.b64decode(media.data)


def turn_input(
    user: Message | None = None,
    *,
    history: tuple[Message, ...] = (),
    client_tools: tuple[ClientTool, ...] = (),
) -> TurnInput:
    async def read_history(before: Message) -> tuple[Message, ...]:
        return history

    return TurnInput(
        session_id="sess-1",
        turn_id="turn-1",
        agent="default",
        owner="alice",
        message=user or message(),
        history_reader=read_history,
        media=InlineMedia(),
        client_tools=client_tools,
    )


Answer = Callable[[ToolCall], ToolOutcome]


def completed(result: Any) -> Answer:
    return lambda call: ToolOutcome(status="completed", result=result)


async def drive(
    runtime: Runtime, turn: TurnInput, answer: Answer | None = None
) -> tuple[list[RuntimeEvent], list[ToolCall]]:
    """Run a turn as the engine does: every event, and the client tool calls answered."""
    events: list[RuntimeEvent] = []
    calls: list[ToolCall] = []
    stream = runtime.run(turn)
    reply: ToolOutcome | None = None
    try:
        async with asyncio.timeout(WITHIN):
            while True:
                event = await stream.asend(reply)
                events.append(event)
                reply = None
                if isinstance(event, ToolCall):
                    calls.append(event)
                    assert answer is not None, f"unexpected tool call {event.name}"
                    reply = answer(event)
    except StopAsyncIteration:
        pass
    finally:
        await stream.aclose()
    return events, calls


def streamed_text(events: list[RuntimeEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, Chunk))
