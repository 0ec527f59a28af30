"""The floor of the gRPC hop: bare `grpc.aio` (no Portico), the shape of the `grpc`
workload (bench/run_grpc.py): CLIENTS concurrent `Converse` streams, each turn one
`ClientMessage` answered by 50 `chunk`s and a `done`. Prints one JSON line,
`{"messages_per_s": ...}` (chunks received per second by the client side).

    python bench/grpc_floor.py --seconds 2
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    ports: Any = multiprocessing.Queue()
    runtime = multiprocessing.Process(target=serve, args=(ports,), daemon=True)
    runtime.start()
    try:
        port = ports.get(timeout=READY_TIMEOUT)
        rate = uvloop.run(drive(port, args.seconds))
    finally:
        runtime.terminate()
        runtime.join(10)
    print(json.dumps({"messages_per_s": rate}))


if __name__ == "__main__":
    main()
