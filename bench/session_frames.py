"""The server's /v1/session work per 50-chunk turn, in process, without sockets.

    PYTHONPATH=<a checkout>/src python bench/session_frames.py [RUNS [TURNS]]

Two figures, each the fastest of RUNS runs (60) of TURNS turns (200); the minimum holds
still on a shared machine, where throughput does not (there, many short runs catch a
quiet moment more often than a few long ones):

- `ledger`: numbering, the in-process session-state port and the resend buffer, and
  the 4 acks a bench client sends per turn (every 16 messages and at `done`) applied
  to the port directly.
- `socket`: the same turn through the whole adapter: a `SessionSocket` on a stub
  transport, the 4 acks as text frames through `on_text` (decode, dispatch, the port's
  trim), every numbered message written through the sans-I/O core and flushed into the
  transport, as the server does for a real connection; only aiohttp's read is missing.

Run it against two checkouts for an A/B of the per-frame path (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import uvloop

from portico.config import Settings
from portico.core.events import TurnChunk, TurnCompleted
from portico.protocols.session.channel import Channel
from portico.server.metrics import Metrics
from portico.server.session_ledger import SessionLedger
from portico.server.session_ws import LIVE_SESSIONS, LiveSession, SessionSocket
from portico.sessionstate.base import BufferLimits
from portico.sessionstate.memory import InProcessSessionStates

TURNS = int(sys.argv[2]) if len(sys.argv) > 2 else 200


class _Transport:
    """Takes every write (the kernel's part is not measured here)."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def is_closing(self) -> bool:
        return False


async def _session() -> tuple[LiveSession, SessionLedger, int]:
    states = InProcessSessionStates(BufferLimits(max_messages=10000, max_bytes=1 << 26))
    epoch = await states.create("s1", capabilities=b"{}")
    channel = Channel(max_messages=10000, max_bytes=1 << 26)
    ledger = SessionLedger(states, "s1", epoch)
    live = LiveSession(
        session_id="s1",
        owner="o",
        agent="a",
        capabilities=(),
        tools=(),
        context={},
        channel=channel,
        ledger=ledger,
        sessions={},
    )
    return live, ledger, epoch


def _socket(live: LiveSession, epoch: int) -> SessionSocket:
    """A connection that holds `live`, as after a handshake, on a stub transport."""
    engine = SimpleNamespace(is_busy=lambda session_id: False)
    services: Any = SimpleNamespace(
        settings=Settings(), metrics=Metrics(), engine=engine, loop=asyncio.get_running_loop()
    )
    request: Any = SimpleNamespace(
        transport=_Transport(),
        app={LIVE_SESSIONS: {}},
        protocol=SimpleNamespace(writing_paused=False),
    )
    ws: Any = SimpleNamespace(closed=False)
    socket = SessionSocket(request, ws, services)
    socket._live, socket._epoch = live, epoch
    core = socket.core
    core.channel = live.channel
    core.state = type(core.state).OPEN
    live.attach(socket)
    return socket


Turn = Callable[[list[TurnChunk], TurnCompleted], Awaitable[None]]


async def _fastest(turn: Turn, runs: int) -> float:
    """Each turn with an id of its own: a session drops the events of a turn it ended."""
    best, made = float("inf"), 0
    for _ in range(runs):
        turns = [_turn_events(f"turn_{made + n}") for n in range(TURNS)]
        made += TURNS
        t = time.perf_counter()
        for chunks, done in turns:
            await turn(chunks, done)
        best = min(best, (time.perf_counter() - t) / TURNS)
    return best


def _turn_events(turn_id: str) -> tuple[list[TurnChunk], TurnCompleted]:
    chunks = [TurnChunk("s1", turn_id, "c ", "msg_1", i) for i in range(50)]
    return chunks, TurnCompleted("s1", turn_id, "c " * 50, None)


async def ledger_turn(runs: int) -> float:
    live, ledger, epoch = await _session()
    channel = live.channel
    fast = hasattr(ledger, "acknowledged_now")

    async def ack(seq: int) -> None:
        channel.acknowledge(seq)
        if not (fast and ledger.acknowledged_now(epoch, seq)):
            await ledger.acknowledged(epoch, seq)

    async def turn(chunks: list[TurnChunk], done: TurnCompleted) -> None:
        for sent, event in enumerate(chunks, 1):
            live.on_turn_event(event)
            if sent % 16 == 0:
                await ack(channel.next_seq - 1)
        live.on_turn_event(done)
        await ack(channel.next_seq - 1)

    return await _fastest(turn, runs)


async def socket_turn(runs: int) -> float:
    live, _, epoch = await _session()
    socket = _socket(live, epoch)
    channel, loop = live.channel, asyncio.get_running_loop()

    async def ack() -> None:
        await socket.on_text(f'{{"type":"ack","seq":{channel.next_seq - 1}}}', loop.time())

    async def turn(chunks: list[TurnChunk], done: TurnCompleted) -> None:
        for sent, event in enumerate(chunks, 1):
            live.on_turn_event(event)
            await asyncio.sleep(0)  # the socket's flush runs, as between two chunks
            if sent % 16 == 0:
                await ack()
        live.on_turn_event(done)
        await asyncio.sleep(0)
        await ack()

    return await _fastest(turn, runs)


async def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    for name, measure in (("ledger", ledger_turn), ("socket", socket_turn)):
        best = await measure(runs)
        print(f"{name}: {best * 1e6:.1f} us per turn ({best * 1e6 / 51:.2f} us per frame)")


if __name__ == "__main__":
    uvloop.run(main())
