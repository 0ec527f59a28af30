"""Fuzz the `runtime: grpc` adapter over a real gRPC stream (issue 13: no crash, one
terminal frame): an in-process runtime plays a generated sequence of `ServerMessage`s,
bytes that decode as none, an abort or an early end of the stream, and the turn Portico
reads from it ends with exactly one terminal event, last, within its deadlines.

tests/unit/test_grpc_mapping.py fuzzes `TurnReader` alone; this drives `GrpcRuntime`
itself: its stream reader, its tool answers and its deadlines.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import grpc.aio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from portico.config import AgentSettings
from portico.contract import runtime_pb2 as pb
from portico.domain.model import Message
from portico.runtime.base import Done, Failure, RuntimeEvent, ToolCall, ToolOutcome, TurnInput
from portico.runtime.grpc.runtime import GrpcRuntime
from support.grpc_runtime import start_converse_server

Out = pb.ServerMessage
Item = Out | bytes | str  # a message, raw bytes, or "abort"
TURN_DEADLINE = 10.0  # far above the runtime's own 0.3 s timeouts: only a hang reaches it
SESSIONS = itertools.count()


class Replayer:
    """`Converse` plays the script registered for the turn's session, then ends the stream."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[Item]] = {}

    async def converse(self, requests: AsyncIterator[pb.ClientMessage], context: Any) -> None:
        async for request in requests:
            if request.HasField("client_tool_result"):
                continue  # the answer to a generated tool call: the script goes on regardless
            for item in self.scripts.pop(request.session_id, []):
                if item == "abort":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "runtime going away")
                await context.write(item)
            return


async def start(replayer: Replayer) -> tuple[grpc.aio.Server, int]:
    return await start_converse_server(replayer.converse)


@pytest.fixture(scope="module")
def rig() -> Iterator[tuple[asyncio.AbstractEventLoop, Replayer, GrpcRuntime]]:
    loop = asyncio.new_event_loop()
    replayer = Replayer()
    server, port = loop.run_until_complete(start(replayer))
    settings = AgentSettings(
        runtime="grpc",
        grpc_target=f"127.0.0.1:{port}",
        first_token_timeout=0.3,
        stream_idle_timeout=0.3,
        grpc_connect_timeout=2.0,
    )
    runtime = GrpcRuntime("fuzz", settings, env={})
    yield loop, replayer, runtime
    loop.run_until_complete(runtime.close())
    loop.run_until_complete(server.stop(0))
    loop.close()


def turn_input(session_id: str) -> TurnInput:
    message = Message(
        id="m",
        session_id=session_id,
        role="user",
        content="go",
        created_at=1.0,
        updated_at=1.0,
    )
    return TurnInput(
        session_id=session_id, turn_id="t", agent="fuzz", owner="alice", message=message
    )


async def run_turn(runtime: GrpcRuntime, session_id: str) -> list[RuntimeEvent]:
    """Every event of one turn; a client tool call is answered with a rejection."""
    events: list[RuntimeEvent] = []
    stream = runtime.run(turn_input(session_id))
    async with asyncio.timeout(TURN_DEADLINE):
        outcome: ToolOutcome | None = None
        while True:
            try:
                event = await stream.asend(outcome) if events else await anext(stream)
            except StopAsyncIteration:
                return events
            events.append(event)
            denied = ToolOutcome(status="denied", error="fuzz")
            outcome = denied if isinstance(event, ToolCall) else None


texts = st.text(max_size=6)
members = st.one_of(
    st.builds(lambda c: Out(chunk=pb.Chunk(content=c)), texts),
    st.builds(
        lambda i, a, e: Out(tool_call=pb.ToolCall(id=i, name="t", arguments_json=a, execution=e)),
        st.sampled_from(["", "c1"]),
        st.sampled_from(["{}", '{"a": 1}', "[]", "{not json"]),
        st.sampled_from([0, 1]),
    ),
    st.builds(
        lambda t: Out(done=pb.Done(parts=[pb.ContentPart(type=t, text="x")])),
        st.sampled_from(["text", "image", "hologram"]),
    ),
    st.just(Out(done=pb.Done(final_content="fin"))),
    st.builds(lambda c: Out(error=pb.Error(code=c, message="m")), texts),
    st.builds(
        lambda s, last: Out(
            media_chunk=pb.MediaChunk(
                media_id="m1", sequence=s, is_last=last, mime_type="audio/pcm", data=b"a"
            )
        ),
        st.integers(-1, 2),
        st.booleans(),
    ),
    st.just(Out()),
    st.just(Out(interruption=pb.Interruption())),
    st.just(b"\x0f\x00"),  # field 1 with wire type 7: not a ServerMessage
    st.just("abort"),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.lists(members, max_size=6))
def test_any_stream_ends_the_turn_with_exactly_one_terminal_event_last(
    rig: tuple[asyncio.AbstractEventLoop, Replayer, GrpcRuntime], script: list[Item]
) -> None:
    loop, replayer, runtime = rig
    session_id = f"sess-fuzz-{next(SESSIONS)}"
    replayer.scripts[session_id] = script
    events = loop.run_until_complete(run_turn(runtime, session_id))
    terminals = [n for n, event in enumerate(events) if isinstance(event, Done | Failure)]
    assert terminals == [len(events) - 1], (script, events)
