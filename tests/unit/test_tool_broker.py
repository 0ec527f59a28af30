"""The client-tool broker without sockets: timeouts of tens of milliseconds."""

from __future__ import annotations

import asyncio
import time

import pytest

from portico.core.events import TurnEvent, TurnToolCall, TurnToolCallTimedOut
from portico.core.tools import TIMED_OUT, TURN_ENDED, ClientToolBroker
from portico.domain.model import Session
from portico.domain.states import ToolCallState
from portico.errors import InvalidMessage
from portico.runtime.base import ToolCall, ToolOutcome
from portico.store.memory import MemoryStore

ACK = 0.05
ANSWER = 0.15
LONG_ANSWER = 30.0  # never reached: the waits that must end first are far shorter


class Client:
    """Collects what the broker emits; `connected=False` models no attached socket."""

    def __init__(self, *, connected: bool = True) -> None:
        self.events: list[TurnEvent] = []
        self.connected = connected

    def __call__(self, event: TurnEvent) -> int:
        if not self.connected:
            return 0
        self.events.append(event)
        return 1


async def setup(
    *, ack: float = ACK, answer: float = ANSWER
) -> tuple[MemoryStore, ClientToolBroker]:
    store = MemoryStore()
    await store.create_session(
        Session(
            id="s1", owner="alice", agent="default", created_at=0, updated_at=0, last_activity_at=0
        )
    )
    broker = ClientToolBroker(store=store, ack_timeout=ack, answer_timeout=answer, clock=time.time)
    return store, broker


def start(
    broker: ClientToolBroker, client: Client, call_id: str = "c1"
) -> asyncio.Task[ToolOutcome]:
    call = ToolCall(id=call_id, name="where", arguments={})
    return asyncio.create_task(broker.call("alice", "s1", "t1", call, client))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_answer_completes_the_call_and_archives_it() -> None:
    store, broker = await setup()
    client = Client()
    task = start(broker, client)
    await settle()
    assert [type(e) for e in client.events] == [TurnToolCall]
    assert (await store.get_tool_call("c1")).state is ToolCallState.SENT  # type: ignore[union-attr]
    await broker.acknowledge("alice", "c1")
    assert (await store.get_tool_call("c1")).state is ToolCallState.EXECUTING  # type: ignore[union-attr]
    broker.answer("alice", "c1", {"ok": True}, None)
    assert await task == ToolOutcome(status="completed", result={"ok": True})
    record = await store.get_tool_call("c1")
    assert record is not None
    assert (record.state, record.result) == (ToolCallState.COMPLETED, {"ok": True})


async def test_error_result_and_nack() -> None:
    store, broker = await setup()
    failing, declined = start(broker, Client(), "c1"), start(broker, Client(), "c2")
    await settle()
    broker.answer("alice", "c1", None, "boom")
    broker.reject("alice", "c2", "")
    assert await failing == ToolOutcome(status="error", error="boom")
    assert await declined == ToolOutcome(status="denied", error="")
    states = {c.id: c.state for c in await store.list_tool_calls("s1")}
    assert states == {"c1": ToolCallState.FAILED, "c2": ToolCallState.REJECTED}


async def test_no_ack_times_out_and_tells_the_client() -> None:
    # The two waits far apart: the denial must come from the ack timeout.
    store, broker = await setup(answer=LONG_ANSWER)
    client = Client()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await start(broker, client) == ToolOutcome(status="denied", error=TIMED_OUT)
    waited = loop.time() - started
    assert ACK <= waited < LONG_ANSWER / 2, waited
    assert client.events[-1] == TurnToolCallTimedOut("s1", "t1", "c1", TIMED_OUT)
    assert (await store.get_tool_call("c1")).state is ToolCallState.TIMEOUT  # type: ignore[union-attr]


async def test_an_undelivered_call_waits_the_answer_timeout_not_the_ack_timeout() -> None:
    # Nobody received the call, so nobody can ack it: the short wait does not apply.
    store, broker = await setup(ack=LONG_ANSWER)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert (await start(broker, Client(connected=False))).error == TIMED_OUT
    assert ANSWER <= loop.time() - started < LONG_ANSWER / 2
    assert (await store.get_tool_call("c1")).state is ToolCallState.TIMEOUT  # type: ignore[union-attr]


async def test_with_an_rpc_client_about_the_whole_call_has_the_answer_timeout() -> None:
    _, broker = await setup(ack=LONG_ANSWER)
    broker.rpc_attached("alice")
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert (await start(broker, Client())).error == TIMED_OUT
    assert ANSWER <= loop.time() - started < LONG_ANSWER / 2


async def test_ack_moves_the_deadline_to_the_answer_timeout() -> None:
    _, broker = await setup()
    task = start(broker, Client())
    await settle()
    await broker.acknowledge("alice", "c1")
    await asyncio.sleep(ACK * 1.5)
    assert not task.done()
    broker.answer("alice", "c1", 1, None)
    assert (await task).status == "completed"


async def test_ack_then_silence_times_out_after_the_answer_timeout() -> None:
    _, broker = await setup()
    task = start(broker, Client())
    await settle()
    started = asyncio.get_running_loop().time()
    await broker.acknowledge("alice", "c1")
    assert (await task).error == TIMED_OUT
    assert asyncio.get_running_loop().time() - started >= ANSWER * 0.9


async def test_undelivered_call_stays_pending_until_it_times_out() -> None:
    store, broker = await setup()
    task = start(broker, Client(connected=False))
    await settle()
    assert (await store.get_tool_call("c1")).state is ToolCallState.PENDING  # type: ignore[union-attr]
    assert (await task).status == "denied"


async def test_replies_to_unknown_ended_or_foreign_calls_are_invalid() -> None:
    _, broker = await setup()
    task = start(broker, Client())
    await settle()
    with pytest.raises(InvalidMessage):
        broker.answer("bob", "c1", "hijack", None)
    with pytest.raises(InvalidMessage):
        await broker.acknowledge("alice", "nope")
    broker.answer("alice", "c1", 1, None)
    await task
    with pytest.raises(InvalidMessage):
        broker.reject("alice", "c1", "late")


async def test_repeated_ack_changes_nothing() -> None:
    _, broker = await setup()
    task = start(broker, Client())
    await settle()
    await broker.acknowledge("alice", "c1")
    await broker.acknowledge("alice", "c1")
    broker.answer("alice", "c1", 1, None)
    assert (await task).status == "completed"


async def test_a_cancelled_turn_ends_its_open_call() -> None:
    store, broker = await setup()
    task = start(broker, Client())
    await settle()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    record = await store.get_tool_call("c1")
    assert record is not None
    assert (record.state, record.error, record.outcome) == (
        ToolCallState.REJECTED,
        TURN_ENDED,
        "denied",
    )
    with pytest.raises(InvalidMessage):
        broker.answer("alice", "c1", 1, None)
