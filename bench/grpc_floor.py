"""The floor of the gRPC hop: bare `grpc.aio` (no Portico), the shape of the `grpc`
workload (bench/run_grpc.py): CLIENTS concurrent `Converse` streams, each turn one
`ClientMessage` answered by 50 `chunk`s and a `done`. Prints one JSON line,
`{"messages_per_s": ...}` (chunks received per second by the client side).
With `--latency RATE`, instead: turns opened at RATE per second (open loop) over
LATENCY_STREAMS streams, and the time from the turn's write to its first chunk, p50/p99
in ms: the hop's own first-chunk cost, which bench/run_grpc.py sets beside Portico's.

    python bench/grpc_floor.py --seconds 2
    python bench/grpc_floor.py --seconds 2 --latency 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import uvloop

from portico.contract import runtime_pb2 as pb
from portico.contract import runtime_pb2_grpc as pb_grpc

CHUNKS = 50
CLIENTS = 100
LATENCY_STREAMS = 32  # as bench/run_grpc.py's latency workload
READY_TIMEOUT = 30.0


class Streamer(pb_grpc.RuntimeServiceServicer):
    async def Converse(  # type: ignore[override]  # noqa: N802 (the contract's name)
        self, requests: AsyncIterator[pb.ClientMessage], context: Any
    ) -> None:
        async for _ in requests:
            for _ in range(CHUNKS):
                await context.write(pb.ServerMessage(chunk=pb.Chunk(content="c ")))
            await context.write(pb.ServerMessage(done=pb.Done()))


def serve(ports: Any) -> None:
    """The runtime's side, in its own process as the SDK agent is (plain asyncio, as it)."""

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_RuntimeServiceServicer_to_server(Streamer(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def drive(port: int, seconds: float) -> float:
    """The facade's side (uvloop, as `portico serve`): chunks read per second."""
    received = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RuntimeServiceStub(channel)
        start = time.monotonic()
        stop = start + seconds

        async def conversation() -> None:
            nonlocal received
            call = stub.Converse()
            while time.monotonic() < stop:
                await call.write(pb.ClientMessage(session_id="s", content="x"))
                while not (await call.read()).HasField("done"):
                    received += 1
            call.cancel()

        await asyncio.gather(*(conversation() for _ in range(CLIENTS)))
        return received / (time.monotonic() - start)


async def first_chunks(port: int, seconds: float, rate: float) -> dict[str, float]:
    """Open loop: a turn every 1/rate s on the next idle stream; write -> first chunk."""
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.RuntimeServiceStub(channel)
        calls = [stub.Converse() for _ in range(LATENCY_STREAMS)]
        idle: asyncio.Queue[Any] = asyncio.Queue()
        for call in calls:
            idle.put_nowait(call)

        async def turn(call: Any, timed: bool = True) -> None:
            sent = time.perf_counter()
            await call.write(pb.ClientMessage(session_id="s", content="x"))
            message = await call.read()
            if timed:
                latencies.append(time.perf_counter() - sent)
            while not message.HasField("done"):
                message = await call.read()
            idle.put_nowait(call)

        # A warm-up turn on each stream: its opening is not the hop's per-turn cost.
        await asyncio.wait_for(
            asyncio.gather(*(turn(idle.get_nowait(), timed=False) for _ in calls)),
            READY_TIMEOUT,
        )
        turns = []
        start = time.perf_counter()
        for n in range(int(seconds * rate)):
            await asyncio.sleep(max(0.0, start + n / rate - time.perf_counter()))
            turns.append(asyncio.ensure_future(turn(await idle.get())))
        await asyncio.wait_for(asyncio.gather(*turns), READY_TIMEOUT)
        for call in calls:
            call.cancel()
    ordered = sorted(latencies)
    return {
        "first_chunk_p50_ms": ordered[len(ordered) // 2] * 1000,
        "first_chunk_p99_ms": ordered[int(len(ordered) * 0.99)] * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--latency", type=float, default=0.0, help="turns per second")
    args = parser.parse_args()
    ports: Any = multiprocessing.Queue()
    runtime = multiprocessing.Process(target=serve, args=(ports,), daemon=True)
    runtime.start()
    try:
        port = ports.get(timeout=READY_TIMEOUT)
        if args.latency:
            figures = uvloop.run(first_chunks(port, args.seconds, args.latency))
        else:
            figures = {"messages_per_s": uvloop.run(drive(port, args.seconds))}
    finally:
        runtime.terminate()
        runtime.join(10)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
