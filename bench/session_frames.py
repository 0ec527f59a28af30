"""The server's /v1/session work per 50-chunk turn, in process, without sockets.

    PYTHONPATH=<a checkout>/src python bench/session_frames.py [RUNS]

Numbering, the in-process session-state port, the resend buffer and the 4 acks a bench
client sends per turn (every 16 messages and at `done`); 200 turns per run, the fastest
run is reported (the minimum holds still on a shared machine, where throughput does not).
Run it against two checkouts for an A/B of the per-frame path (docs/performance.md).
"""

from __future__ import annotations

import sys
import time

import uvloop

from portico.core.events import TurnChunk, TurnCompleted
from portico.protocols.session.channel import Channel
from portico.server.session_ledger import SessionLedger
from portico.server.session_ws import LiveSession
from portico.sessionstate.base import BufferLimits
from portico.sessionstate.memory import InProcessSessionStates


async def main() -> None:
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
    fast = hasattr(ledger, "acknowledged_now")

    async def ack(seq: int) -> None:
        channel.acknowledge(seq)
        if not (fast and ledger.acknowledged_now(epoch, seq)):
            await ledger.acknowledged(epoch, seq)

    chunks = [TurnChunk("s1", "turn_1", "c ", "msg_1", i) for i in range(50)]
    done = TurnCompleted("s1", "turn_1", "c " * 50, None)

    async def turn() -> None:
        for sent, event in enumerate(chunks, 1):
            live.on_turn_event(event)
            if sent % 16 == 0:
                await ack(channel.next_seq - 1)
        live.on_turn_event(done)
        await ack(channel.next_seq - 1)

    best = float("inf")
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 60):
        t = time.perf_counter()
        for _ in range(200):
            await turn()
        best = min(best, (time.perf_counter() - t) / 200)
    kind = "with acknowledged_now" if fast else "without acknowledged_now"
    print(f"{kind}: {best * 1e6:.1f} us per turn ({best * 1e6 / 51:.2f} us per frame)")


if __name__ == "__main__":
    uvloop.run(main())
