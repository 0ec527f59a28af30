"""The benchmark's SDK agent (bench/run_grpc.py): the `stream50` turn of bench/script.yaml,
50 chunks of "c " and done, for any message, served by `portico agent serve` in its own
process. No sleeps: the benchmark measures the gRPC hop, not a model."""

from __future__ import annotations

from collections.abc import AsyncIterator

from portico.agent import Reply, Turn

CHUNKS = 50
CHUNK = "c "


async def handler(turn: Turn) -> AsyncIterator[Reply]:
    for _ in range(CHUNKS):
        yield CHUNK
