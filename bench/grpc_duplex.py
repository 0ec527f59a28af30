"""A small bounded benchmark of the gRPC duplex hop: Portico's `grpc` duplex runtime
calling an SDK voice agent (`portico agent serve --voice`, the test agent's `echo`
scenario: every caller frame comes straight back) in another process.

Per run: CALLS concurrent calls of FRAMES 20 ms frames (640 bytes, 16 kHz mono),
sent at the real-time pace or as fast as the hop takes them. Reports the call setup
(`start()` to `Hello`) and each frame's echo round trip (`send()` to its `AudioOut`),
median and p99, and frames per second through the hop. Prints one JSON line per run.

    .venv/bin/python bench/grpc_duplex.py [--calls 1 10 50] [--frames 250]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from portico.runtime.duplex.base import AudioFormat, AudioIn, AudioOut, DuplexStart, Hello
from portico.runtime.duplex.grpc import GrpcDuplexRuntime
from support.agent_process import AgentProcess
from support.duplex_runtimes import grpc_agent

FRAME = bytes(640)
DEADLINE = 120.0  # seconds one run may take


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def one_call(
    runtime: GrpcDuplexRuntime, index: int, frames: int, pace: float
) -> tuple[float, list[float]]:
    began = time.perf_counter()
    start = DuplexStart(
        session_id=f"bench-{index}",
        agent="default",
        owner="bench",
        format=AudioFormat(),
        system_instruction="echo",
    )
    call = await runtime.start(start)
    events = call.events()
    assert isinstance(await anext(events), Hello)
    setup = time.perf_counter() - began
    sent: list[float] = []
    trips: list[float] = []

    async def listen() -> None:
        async for event in events:
            if isinstance(event, AudioOut):
                trips.append(time.perf_counter() - sent[len(trips)])
                if len(trips) == frames:
                    return

    listener = asyncio.ensure_future(listen())
    for sequence in range(frames):
        sent.append(time.perf_counter())
        await call.send(AudioIn(FRAME, sequence))
        if pace:
            await asyncio.sleep(pace)
    await listener
    await call.close()
    return setup, trips


async def run(calls: int, frames: int, pace: float, target: str) -> dict[str, float | int]:
    runtime = GrpcDuplexRuntime("default", grpc_agent(target), env={})
    began = time.perf_counter()
    results = await asyncio.wait_for(
        asyncio.gather(*(one_call(runtime, n, frames, pace) for n in range(calls))), DEADLINE
    )
    elapsed = time.perf_counter() - began
    await runtime.close()
    setups = [setup for setup, _ in results]
    trips = [trip for _, call_trips in results for trip in call_trips]
    return {
        "calls": calls,
        "frames_per_call": frames,
        "paced": bool(pace),
        "setup_ms_p50": round(statistics.median(setups) * 1000, 2),
        "setup_ms_p99": round(percentile(setups, 0.99) * 1000, 2),
        "echo_ms_p50": round(statistics.median(trips) * 1000, 2),
        "echo_ms_p99": round(percentile(trips, 0.99) * 1000, 2),
        "frames_per_s": round(len(trips) / elapsed),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--frames", type=int, default=250)  # 5 s of audio per call
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentProcess(
            "support.agents:handler",
            Path(tmp) / "agent.log",
            args=("--voice", "support.voice_agents:voice"),
        ).start()
        try:
            for calls in args.calls:
                for pace in (0.02, 0.0):
                    print(json.dumps(asyncio.run(run(calls, args.frames, pace, agent.target))))
        finally:
            agent.stop()


if __name__ == "__main__":
    main()
