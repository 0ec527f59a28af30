"""A voice call whose stream grpc.aio ends with its own `INTERNAL` "Internal error from
Core" (a write that lost the race to the runtime's refusal of the token) is logged with
the refusal a `Health` probe names, as a text turn is (tests/unit/test_grpc_final_cause.py).

The race is seen only under load against a real runtime
(tests/integration/test_grpc_duplex.py, the refused-token test), so the rule is pinned
here with a stream that answers as grpc.aio's does in that case."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import grpc.aio
import pytest

from portico.runtime.duplex.base import AudioFormat, DuplexEvent, DuplexFailure, DuplexStart
from portico.runtime.duplex.grpc import GrpcDuplexCall
from portico.runtime.duplex.grpc_mapping import BROKEN, DUPLEX_ERROR
from portico.runtime.grpc.channel import CORE_ERROR
from support.duplex_runtimes import grpc_agent

START = DuplexStart(
    session_id="call-1", agent="default", owner="alice", format=AudioFormat(sample_rate=16000)
)


class RefusedStream:
    """A `Converse` stream grpc.aio has ended with its own INTERNAL."""

    def __init__(self, details: str) -> None:
        self._details = details

    def _error(self) -> grpc.aio.AioRpcError:
        empty = grpc.aio.Metadata()
        return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, empty, empty, self._details)

    async def write(self, message: Any) -> None:
        raise self._error()

    async def read(self) -> Any:
        raise self._error()

    async def done_writing(self) -> None:
        return None

    def cancel(self) -> bool:
        return True

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INTERNAL

    async def details(self) -> str:
        return self._details


async def refused() -> str | None:
    return "unauthenticated"


async def events_of(details: str) -> list[DuplexEvent]:
    stream: Any = RefusedStream(details)
    call = GrpcDuplexCall(stream, START, grpc_agent("127.0.0.1:1"), ("a", "t", "s"), probe=refused)
    await call.open(START)

    async def everything() -> list[DuplexEvent]:
        return [event async for event in call.events()]

    return await asyncio.wait_for(everything(), 5.0)


async def test_a_lost_write_race_is_logged_as_the_probes_refusal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "portico.runtime.grpc"):
        assert await events_of(CORE_ERROR) == [DuplexFailure(DUPLEX_ERROR, BROKEN)]
    assert "stream broken: unauthenticated" in caplog.text


async def test_a_runtimes_own_internal_error_is_not_probed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "portico.runtime.grpc"):
        assert await events_of("handler crashed") == [DuplexFailure(DUPLEX_ERROR, BROKEN)]
    assert "stream broken: internal" in caplog.text
