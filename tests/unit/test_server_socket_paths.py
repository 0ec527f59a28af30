"""`ServerSocket`'s write and timer paths (server/sockets.py) on fakes, deterministically.

The conformance suites reach these paths only by chance (a peer that vanishes while a
compressed frame is on its way; an ack that went out before its timer fired), so each
rule is pinned here with the event order forced.
"""

from __future__ import annotations

import asyncio
import gc
from collections import deque
from types import SimpleNamespace
from typing import Any

import uvloop

from portico.server.sockets import ServerSocket


class FakeCore:
    def __init__(self, frames: list[bytes], deadline: float = float("inf")) -> None:
        self.frames = deque(frames)
        self.deadline = deadline
        self.overflowed = False

    def next_frame(self) -> bytes | None:
        return self.frames.popleft() if self.frames else None

    def next_deadline(self) -> float:
        return self.deadline


class FakeTransport:
    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.closing = True


class FakeWheel:
    resolution = 1.0

    def add(self, owner: object, deadline: float) -> int:
        raise AssertionError("the tests arm near deadlines only")

    def discard(self, owner: object, key: int) -> None:
        return None

    def starts(self, key: int) -> float:
        raise AssertionError("the tests arm near deadlines only")


class FakeServices(SimpleNamespace):
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()


class Socket(ServerSocket):
    protocol = "test"
    __slots__ = ("_core", "timer_calls")

    def __init__(self, ws: Any, core: FakeCore, transport: FakeTransport) -> None:
        counter = SimpleNamespace(outbound=0)
        services = FakeServices(
            # compression on: frames go through aiohttp's awaited send (`_write_each`)
            settings=SimpleNamespace(ws_compression=True, close_timeout=2.0),
            metrics=SimpleNamespace(frames=SimpleNamespace(of=lambda protocol: counter)),
            deadlines=FakeWheel(),
        )
        request = SimpleNamespace(transport=transport, protocol=SimpleNamespace())
        super().__init__(request, ws, services)  # type: ignore[arg-type]
        self._core = core
        self.timer_calls = 0

    @property
    def core(self) -> FakeCore:
        return self._core

    def describe(self) -> str:
        return "test"

    async def on_text(self, data: str, now: float) -> None:
        return None

    async def on_binary(self, data: bytes, now: float) -> None:
        return None

    async def on_timer(self, now: float) -> None:
        self.timer_calls += 1


class ResettingWs:
    """aiohttp's compressed send: the frame goes out in a shielded task of its own, which
    fails when the transport closed meanwhile (the peer reset the connection)."""

    closed = False

    def __init__(self, transport: FakeTransport) -> None:
        self.transport = transport
        self.sent: list[bytes] = []
        self.inner: asyncio.Task[None] | None = None

    async def send_frame(self, frame: bytes, kind: object) -> None:
        self.inner = asyncio.create_task(self._send(frame))
        await asyncio.shield(self.inner)

    async def _send(self, frame: bytes) -> None:
        await asyncio.sleep(0.01)
        if self.transport.closing:
            raise ConnectionResetError("Cannot write to closing transport")
        self.sent.append(frame)


def run_recording_loop_errors(scenario: Any) -> list[dict[str, Any]]:
    """Run `scenario()` on uvloop; return what reached the loop's exception handler."""
    errors: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        await scenario()
        gc.collect()  # a task's unretrieved exception is reported when it is collected
        await asyncio.sleep(0)

    uvloop.run(main())
    return errors


def test_a_reset_during_a_compressed_send_ends_writing_quietly() -> None:
    transport = FakeTransport()
    ws = ResettingWs(transport)
    socket = Socket(ws, FakeCore([b"one", b"two"]), transport)
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        socket._flush()
        waiter = socket._waiter
        assert waiter is not None
        transport.closing = True  # the peer resets while the first frame is on its way
        await asyncio.wait({waiter}, timeout=2)
        outcome["waiter_error"] = waiter.exception()
        outcome["writing"] = socket._writing
        outcome["waiter_left"] = socket._waiter

    errors = run_recording_loop_errors(scenario)
    assert outcome == {"waiter_error": None, "writing": False, "waiter_left": None}
    assert ws.sent == []
    assert errors == []


def test_stopping_a_socket_whose_peer_is_gone_lets_the_shielded_send_fail_retrieved() -> None:
    transport = FakeTransport()
    ws = ResettingWs(transport)
    socket = Socket(ws, FakeCore([b"one"]), transport)
    outcome: dict[str, Any] = {}

    async def scenario() -> None:
        socket._flush()
        await asyncio.sleep(0)  # the send is under way, in its shielded task
        transport.closing = True
        await socket._stop_background()
        assert ws.inner is not None
        outcome["inner_done"] = ws.inner.done()

    errors = run_recording_loop_errors(scenario)
    # Cancelling the waiter at once would leave the inner send running, and its
    # ConnectionResetError unretrieved: "Task exception was never retrieved".
    assert outcome == {"inner_done": True}
    assert errors == []


def test_a_timer_whose_deadline_moved_later_rearms_without_a_task() -> None:
    async def scenario() -> tuple[bool, float, int]:
        loop = asyncio.get_running_loop()
        core = FakeCore([], deadline=loop.time() + 0.2)
        socket = Socket(ResettingWs(FakeTransport()), core, FakeTransport())
        socket._timer_fired()  # armed for an earlier deadline, met meanwhile (an ack sent)
        rearmed = socket._timer is not None and socket._timer_task is None
        armed_for = socket._armed()
        socket._disarm()
        return rearmed, armed_for - core.deadline, socket.timer_calls

    rearmed, offset, calls = uvloop.run(scenario())
    assert rearmed
    assert abs(offset) < 0.002  # uvloop keeps timers in whole milliseconds
    assert calls == 0


def test_a_timer_whose_deadline_passed_runs_the_hook_and_rearms() -> None:
    async def scenario() -> tuple[int, bool]:
        loop = asyncio.get_running_loop()
        core = FakeCore([], deadline=loop.time() - 0.001)
        socket = Socket(ResettingWs(FakeTransport()), core, FakeTransport())
        socket._timer_fired()
        task = socket._timer_task
        assert task is not None
        core.deadline = loop.time() + 0.5  # the hook's work moved the next deadline on
        await task
        rearmed = socket._timer is not None and socket._timer_task is None
        socket._disarm()
        return socket.timer_calls, rearmed

    calls, rearmed = uvloop.run(scenario())
    assert calls == 1
    assert rearmed
