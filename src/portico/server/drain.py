"""The drain's adapter: feeds core/lifecycle.py the connections and the engine's turns,
closes the sockets it names with 1001 and interrupts the turns when it says so.

Each connection's client moves as soon as no turn runs on it (the spec's answer to
1001: `/ws` continues by session id, `/v1/session` resumes, `/v1/rpc` recovers from its
offset), so a replica holding a long turn does not hold every idle client too.
"""

from __future__ import annotations

import asyncio
import logging

from portico.core.lifecycle import Phase
from portico.server.services import Services

log = logging.getLogger("portico.server")
# A turn's end wakes the drain at once; this bounds how late it notices a connection
# whose last request finished (RPC) or a second stop signal.
POLL_INTERVAL = 0.1


async def drain(services: Services) -> None:
    """Run the drain the stop signal started, to its end (`Phase.STOPPED`)."""
    lifecycle, engine = services.lifecycle, services.engine
    loop = asyncio.get_running_loop()
    log.info("draining: up to %.1fs for running turns", lifecycle.drain_timeout)
    closing: list[asyncio.Task[None]] = []
    while True:
        now = loop.time()
        busy = {connection: connection.busy() for connection in list(services.connections)}
        step = lifecycle.step(now, busy, engine.running_turns)
        closing.extend(asyncio.create_task(c.going_away()) for c in step.close)
        if step.interrupt:
            log.info("drain timeout: interrupting %d running turns", engine.running_turns)
            await engine.interrupt_all()
            continue
        if lifecycle.phase is Phase.STOPPED:
            break
        await engine.wait_turn_end(max(0.0, min(step.wake_at - now, POLL_INTERVAL)))
    # Each close is bounded by close_timeout (ServerSocket._close).
    await asyncio.gather(*closing, return_exceptions=True)
    log.info("drained: %d connections closed with 1001", len(closing))
