"""Async factories of the duplex runtimes built on this branch, for any suite that
drives runtimes at the port (the duplex contract suite includes them).

Each factory yields a `DuplexRuntime` with the fake or process behind it running
until the context ends; the scripting handle comes along for tests that need it.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from portico.config import AgentSettings
from portico.runtime.duplex.base import DuplexRuntime
from portico.runtime.duplex.openai_realtime import build
from support.agent_process import AgentProcess
from support.fake_realtime import KEY, KEY_ENV, FakeRealtime

VOICE_AGENT = "examples.voice_agent.agent"


@asynccontextmanager
async def openai_realtime_runtime() -> AsyncIterator[tuple[DuplexRuntime, FakeRealtime]]:
    """The `openai-realtime` runtime against a fake Realtime API on 127.0.0.1."""
    fake = FakeRealtime()
    await fake.start()
    try:
        yield build(fake.agent(), {KEY_ENV: KEY}), fake
    finally:
        await fake.stop()


def grpc_agent(target: str, **fields: object) -> AgentSettings:
    return AgentSettings(runtime="grpc", grpc_target=target, **fields)  # type: ignore[arg-type]


def voice_agent_process(log_path: Path) -> AgentProcess:
    """`portico agent serve` of the example voice agent (examples/voice_agent)."""
    args = ("--voice", f"{VOICE_AGENT}:voice")
    return AgentProcess(f"{VOICE_AGENT}:handler", log_path, args=args)


@asynccontextmanager
async def grpc_duplex_runtime(
    **fields: object,
) -> AsyncIterator[tuple[DuplexRuntime, AgentProcess]]:
    """The `grpc` duplex runtime dialling the example voice agent in another process."""
    # Imported here: the grpc extra.
    from portico.runtime.duplex.grpc import GrpcDuplexRuntime

    with tempfile.TemporaryDirectory() as tmp:
        agent = voice_agent_process(Path(tmp) / "agent.log")
        await asyncio.to_thread(agent.start)
        runtime = GrpcDuplexRuntime("default", grpc_agent(agent.target, **fields), env={})
        try:
            yield runtime, agent
        finally:
            await runtime.close()
            await asyncio.to_thread(agent.stop)
