"""`SessionClient`'s per-connection link, without a socket: its timer task."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import aiohttp

from portico.client.session import _Link
from portico.protocols.session import frames as f
from portico.protocols.session.channel import Channel
from portico.protocols.session.connection import Role, SessionConnection, State, Timing


def open_core(now: float) -> SessionConnection:
    core = SessionConnection(role=Role.CLIENT, timing=Timing(), now=now)
    core.start(f.Hello(), Channel(max_messages=10, max_bytes=10_000))
    ready = f.Ready(
        session_id="s-1",
        resumed=False,
        last_seq=0,
        capabilities=("resume",),
        heartbeat_ms=15000,
        resume_window_ms=30000,
    )
    core.receive_text(f.encode(ready), now)
    assert core.state is State.OPEN
    return core


async def test_the_timer_task_stops_when_cancelled_as_a_frame_wakes_it() -> None:
    """A frame and then the drop in one read: the read loop wakes the timer task and its
    link cancels it at once. The cancellation must win, or the task (and the link that
    waits for it) would live on until the dead timer, 37.5 s with the defaults."""
    loop = asyncio.get_running_loop()

    def ignore(*_: Any) -> bool:
        return True

    ws = cast(aiohttp.ClientWebSocketResponse, object())
    link = _Link(ws, open_core(loop.time()), ignore, ignore)
    link.start_timers()
    (timer,) = link._tasks
    await asyncio.sleep(0)  # the task now waits to be woken or for the next ping
    link._rearm.set()
    timer.cancel()
    done, _ = await asyncio.wait({timer}, timeout=1.0)
    assert timer in done
    assert timer.cancelled()
