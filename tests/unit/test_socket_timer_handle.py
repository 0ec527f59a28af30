"""A socket's loop timer for a deadline already past (server/sockets.py `fires_at`):
uvloop hands back a plain Handle with no `when()`, which once broke a /v1/session
socket mid-call (an AttributeError in the handler, the client saw 1006)."""

from __future__ import annotations

import asyncio
import math

import pytest
import uvloop

from portico.server.sockets import fires_at


def test_a_timer_for_a_time_already_past_fires_at_once_and_a_later_one_when_set() -> None:
    async def armed() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        later = loop.time() + 60
        past = loop.call_at(loop.time() - 1, lambda: None)
        future = loop.call_at(later, lambda: None)
        past.cancel()
        future.cancel()
        return fires_at(past), fires_at(future), later

    past, future, later = uvloop.run(armed())
    assert past == -math.inf
    # uvloop keeps a timer's time in whole milliseconds: `when()` is `later`, rounded.
    assert future == pytest.approx(later, abs=0.001)
