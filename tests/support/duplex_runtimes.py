"""Async factories of the duplex runtimes built on this branch, for any suite that
drives runtimes at the port (the duplex contract suite includes them).

Each factory yields a `DuplexRuntime` with the fake or process behind it running
until the context ends; the scripting handle comes along for tests that need it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from portico.runtime.duplex.base import DuplexRuntime
from portico.runtime.duplex.openai_realtime import build
from support.fake_realtime import KEY, KEY_ENV, FakeRealtime


@asynccontextmanager
async def openai_realtime_runtime() -> AsyncIterator[tuple[DuplexRuntime, FakeRealtime]]:
    """The `openai-realtime` runtime against a fake Realtime API on 127.0.0.1."""
    fake = FakeRealtime()
    await fake.start()
    try:
        yield build(fake.agent(), {KEY_ENV: KEY}), fake
    finally:
        await fake.stop()
