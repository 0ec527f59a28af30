"""The engine with a real MemoryStore and small in-test runtimes standing in for a model."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from portico.config import AgentSettings
from portico.core.engine import Engine, UserMessage
from portico.core.events import TERMINAL_EVENTS, TurnChunk, TurnCompleted, TurnEvent, TurnFailed
from portico.core.tools import ClientToolBroker
from portico.domain.model import Message, Session, Turn
from portico.domain.states import TurnState
from portico.domain.validation import CLIENT_ID_MAX_LENGTH, check_client_id
from portico.errors import (
    DuplicateMessage,
    InvalidMessage,
    SessionDeclarationRefused,
    SessionExpired,
    StoreError,
    TurnInProgress,
    UnknownAgent,
)
from portico.protocols.session import frames as f
from portico.runtime.base import (
    Chunk,
    Done,
    Failure,
    Runtime,
    RuntimeEvent,
    ToolCall,
    ToolOutcome,
    TurnInput,
    TurnStream,
)
from portico.store.memory import MemoryStore

WAIT = 1.0  # seconds; a generous bound for events that arrive within a few loop steps
TTL = 60.0


# -- runtime doubles ------------------------------------------------------------------


class ListRuntime:
    """Yields the given events; records every turn input and every reply sent back."""

    def __init__(self, *events: RuntimeEvent) -> None:
        self.events = events
        self.inputs: list[TurnInput] = []
        self.replies: list[ToolOutcome | None] = []

    async def run(self, turn: TurnInput) -> TurnStream:
        self.inputs.append(turn)
        for event in self.events:
            self.replies.append((yield event))


class GatedRuntime:
    """Streams one chunk, then waits for `release` before finishing."""

    def __init__(self) -> None:
        self.streaming = asyncio.Event()
        self.release = asyncio.Event()
        self.inputs: list[TurnInput] = []

    async def run(self, turn: TurnInput) -> TurnStream:
        self.inputs.append(turn)
        yield Chunk("partial ")
        self.streaming.set()
        await self.release.wait()
        yield Chunk("rest")
        yield Done()


class RaisingRuntime:
    async def run(self, turn: TurnInput) -> TurnStream:
        yield Chunk("partial")
        raise RuntimeError("password=hunter2 at db.internal")


class ToolRuntime:
    """Calls one client tool and reports the outcome's status as its reply."""

    def __init__(self) -> None:
        self.outcome: ToolOutcome | None = None

    async def run(self, turn: TurnInput) -> TurnStream:
        reply = yield ToolCall(id="call-1", name="get_location", arguments={"q": "here"})
        self.outcome = reply
        yield Done(content=f"tool {reply.status if reply else 'none'}")


# -- helpers --------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Recorder:
    """A listener that keeps every event and signals the terminal one. The events are
    kept without their `step` (compared as the tests build them); `steps` has those."""

    def __init__(self) -> None:
        self.events: list[TurnEvent] = []
        self.steps: list[int] = []
        self.ended = asyncio.Event()

    def __call__(self, event: TurnEvent) -> None:
        self.steps.append(event.step)
        self.events.append(msgspec.structs.replace(event, step=0))
        if isinstance(event, TERMINAL_EVENTS):
            self.ended.set()

    async def terminal(self) -> TurnEvent:
        await asyncio.wait_for(self.ended.wait(), WAIT)
        return self.events[-1]

    def terminals(self) -> list[TurnEvent]:
        return [e for e in self.events if isinstance(e, TERMINAL_EVENTS)]


def make_engine(
    runtime: Runtime,
    *,
    clock: Clock | None = None,
    sandboxes: tuple[str, ...] = (),
    store: MemoryStore | None = None,
) -> Engine:
    return Engine(
        store=store or MemoryStore(),
        runtimes={"default": runtime},
        agents={"default": AgentSettings(sandboxes=sandboxes)},
        context_ttl=TTL,
        clock=clock or Clock(),
    )


def user_message(
    session_id: str = "s1",
    *,
    principal: str = "alice",
    content: str = "hi",
    own_session: bool = False,
    declare: dict[str, Any] | None = None,
    agent: str = "default",
) -> UserMessage:
    return UserMessage(
        principal=principal,
        agent=agent,
        session_id=session_id,
        own_session=own_session,
        content=content,
        declare=declare,
    )


async def run_turn(engine: Engine, message: UserMessage) -> tuple[Turn, Recorder]:
    recorder = Recorder()
    turn = await engine.submit(message, recorder)
    await recorder.terminal()
    assert await engine.wait_idle(WAIT)
    return turn, recorder


async def stored_state(engine: Engine, turn: Turn) -> TurnState:
    stored = await engine.store.get_turn(turn.id)
    assert stored is not None
    return stored.state


async def wait_for(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), WAIT)


# -- a turn's events and archive ------------------------------------------------------


async def test_listener_gets_chunks_then_one_terminal_event() -> None:
    engine = make_engine(ListRuntime(Chunk("Hello "), Chunk("world"), Done()))
    turn, recorder = await run_turn(engine, user_message())
    reply = (await engine.store.list_messages("s1"))[-1]
    assert recorder.events == [
        TurnChunk("s1", turn.id, "Hello ", reply.id, 0),
        TurnChunk("s1", turn.id, "world", reply.id, 1),
        TurnCompleted("s1", turn.id, "Hello world"),
    ]
    assert recorder.steps == [1, 2, 3]  # each event's place in its turn
    # The chunks name the archived reply, opened while streaming and completed at the end.
    assert (reply.role, reply.content, reply.status) == ("assistant", "Hello world", "completed")


async def test_messages_are_archived_with_offsets_one_and_two() -> None:
    engine = make_engine(ListRuntime(Chunk("Hello "), Chunk("world"), Done()))
    turn, _ = await run_turn(engine, user_message(content="hi there"))
    messages = await engine.store.list_messages("s1")
    assert [(m.global_offset, m.role, m.content) for m in messages] == [
        (1, "user", "hi there"),
        (2, "assistant", "Hello world"),
    ]
    assert {m.turn_id for m in messages} == {turn.id}
    assert messages[1].status == "completed"


async def test_done_content_and_parts_replace_the_chunks() -> None:
    engine = make_engine(ListRuntime(Chunk("draft"), Done(content="final")))
    _, recorder = await run_turn(engine, user_message())
    terminal = await recorder.terminal()
    assert isinstance(terminal, TurnCompleted)
    assert terminal.content == "final"
    assert [m.content for m in await engine.store.list_messages("s1")] == ["hi", "final"]


async def test_the_reply_is_split_at_a_tool_call_in_the_order_it_happened() -> None:
    runtime = ListRuntime(
        Chunk("Let me look. "),
        ToolCall(id="call-1", name="get_location", arguments={}),
        Chunk("Found "),
        Chunk("it"),
        Done(content="Let me look. Found it."),
    )
    store = MemoryStore()
    # Nobody answers: the call ends `timeout` at once, the turn goes on.
    tools = ClientToolBroker(store=store, ack_timeout=0.01, answer_timeout=0.01, clock=Clock())
    engine = Engine(
        store=store,
        runtimes={"default": runtime},
        agents={"default": AgentSettings()},
        context_ttl=TTL,
        clock=Clock(),
        tools=tools,
    )
    turn, recorder = await run_turn(engine, user_message())
    messages = await store.list_messages("s1")
    assert [(m.turn_offset, m.content_type, m.status) for m in messages] == [
        (1, "text", "completed"),
        (2, "markdown", "completed"),
        (3, "toolcall_input", "completed"),
        (4, "toolcall_output", "completed"),
        (5, "markdown", "completed"),
    ]
    before, after = messages[1], messages[4]
    # Done.content is the whole answer: the message after the call holds its own part.
    assert (before.content, after.content) == ("Let me look. ", "Found it.")
    chunks = [e for e in recorder.events if isinstance(e, TurnChunk)]
    assert [(c.message_id, c.index) for c in chunks] == [
        (before.id, 0),
        (after.id, 0),
        (after.id, 1),
    ]
    assert recorder.events[-1] == TurnCompleted("s1", turn.id, "Let me look. Found it.")
    # Chunk, tool call, chunk, chunk, end: the tool call counts among the steps too.
    assert recorder.steps == list(range(1, len(recorder.events) + 1))


async def test_a_submitted_turn_is_archived_running_then_completed() -> None:
    # It starts at once, so it is archived running (no pending record, one write less);
    # RPC turns that wait are archived pending (test_enqueued_messages_wait...).
    runtime = GatedRuntime()
    engine = make_engine(runtime)
    recorder = Recorder()
    turn = await engine.submit(user_message(), recorder)
    assert turn.state is TurnState.RUNNING
    await wait_for(runtime.streaming)
    assert await stored_state(engine, turn) is TurnState.RUNNING
    runtime.release.set()
    await recorder.terminal()
    await engine.wait_idle(WAIT)
    stored = await engine.store.get_turn(turn.id)
    assert stored is not None
    assert stored.state is TurnState.COMPLETED
    assert stored.started_at is not None
    assert stored.ended_at is not None


async def test_a_stream_that_just_ends_completes_with_its_chunks() -> None:
    engine = make_engine(ListRuntime(Chunk("a"), Chunk("b")))
    turn, recorder = await run_turn(engine, user_message())
    assert recorder.terminals() == [TurnCompleted("s1", turn.id, "ab")]
    assert await stored_state(engine, turn) is TurnState.COMPLETED


async def test_runtime_gets_history_of_earlier_turns() -> None:
    runtime = ListRuntime(Chunk("reply"), Done())
    engine = make_engine(runtime)
    await run_turn(engine, user_message(content="first"))
    await run_turn(engine, user_message(content="second"))
    second = runtime.inputs[1]
    assert second.message.content == "second"
    assert [(m.role, m.content) for m in await second.history()] == [
        ("user", "first"),
        ("assistant", "reply"),
    ]


async def test_a_listener_may_submit_again_as_soon_as_the_turn_ends() -> None:
    engine = make_engine(ListRuntime(Chunk("x"), Done()))
    recorder = Recorder()
    await engine.submit(user_message(), recorder)
    # A bare wait resumes in the very next loop step after the terminal event (no
    # wait_for, no wait_idle): a client answering `done` at once must not see
    # TURN_IN_PROGRESS.
    await recorder.ended.wait()
    assert not engine.is_busy("s1")
    await engine.submit(user_message(content="again"), Recorder())
    await engine.wait_idle(WAIT)
    assert len(await engine.store.list_messages("s1")) == 4


async def test_a_failing_listener_does_not_break_the_turn() -> None:
    engine = make_engine(ListRuntime(Chunk("x"), Done()))

    def broken(event: TurnEvent) -> None:
        raise ValueError("listener bug")

    engine.attach("s1", broken)
    turn, recorder = await run_turn(engine, user_message())
    assert recorder.terminals() == [TurnCompleted("s1", turn.id, "x")]


# -- one turn at a time ---------------------------------------------------------------


async def test_second_submit_while_running_is_refused_and_archives_nothing() -> None:
    runtime = GatedRuntime()
    engine = make_engine(runtime)
    await engine.submit(user_message(content="first"), Recorder())
    await wait_for(runtime.streaming)
    with pytest.raises(TurnInProgress):
        await engine.submit(user_message(content="second"), Recorder())
    messages = await engine.store.list_messages("s1")
    assert [m.content for m in messages if m.role == "user"] == ["first"]
    assert len(await engine.store.list_turns("s1")) == 1
    runtime.release.set()
    assert await engine.wait_idle(WAIT)


async def test_other_sessions_run_in_parallel() -> None:
    runtime = GatedRuntime()
    engine = make_engine(runtime)
    await engine.submit(user_message("s1"), Recorder())
    await wait_for(runtime.streaming)
    await engine.submit(user_message("s2"), Recorder())
    assert engine.is_busy("s1")
    assert engine.is_busy("s2")
    runtime.release.set()
    assert await engine.wait_idle(WAIT)


# -- failures -------------------------------------------------------------------------


async def test_runtime_exception_ends_the_turn_with_a_generic_internal_error() -> None:
    engine = make_engine(RaisingRuntime())
    turn, recorder = await run_turn(engine, user_message())
    terminals = recorder.terminals()
    assert len(terminals) == 1
    failed = terminals[0]
    assert isinstance(failed, TurnFailed)
    assert failed.code == "INTERNAL_ERROR"
    assert "hunter2" not in failed.message
    assert "db.internal" not in failed.message
    stored = await engine.store.get_turn(turn.id)
    assert stored is not None
    assert stored.state is TurnState.FAILED
    assert "hunter2" not in stored.error_message
    reply = (await engine.store.list_messages("s1"))[-1]
    assert (reply.role, reply.content, reply.status) == ("assistant", "partial", "failed")


async def test_non_spec_failure_code_becomes_internal_error() -> None:
    leaky = Failure(code="DATABASE_EXPLODED", message="password=hunter2")
    engine = make_engine(ListRuntime(Chunk("x"), leaky))
    turn, recorder = await run_turn(engine, user_message())
    failed = await recorder.terminal()
    assert isinstance(failed, TurnFailed)
    assert failed.code == "INTERNAL_ERROR"
    assert "hunter2" not in failed.message
    assert await stored_state(engine, turn) is TurnState.FAILED
    assert len(recorder.terminals()) == 1


async def test_spec_failure_code_passes_through() -> None:
    failure = Failure(code="PROVIDER_UNAVAILABLE", message="model endpoint unavailable")
    engine = make_engine(ListRuntime(failure))
    turn, recorder = await run_turn(engine, user_message())
    assert recorder.terminals() == [
        TurnFailed("s1", turn.id, "PROVIDER_UNAVAILABLE", "model endpoint unavailable")
    ]
    stored = await engine.store.get_turn(turn.id)
    assert stored is not None
    assert (stored.state, stored.error_code) == (TurnState.FAILED, "PROVIDER_UNAVAILABLE")
    # The reply was created with the turn; nothing was said, so it ends empty and failed.
    messages = await engine.store.list_messages("s1")
    assert [(m.role, m.content, m.status) for m in messages] == [
        ("user", "hi", "completed"),
        ("assistant", "", "failed"),
    ]


# -- turns outlive listeners; cancel and shutdown -------------------------------------------


async def test_turn_finishes_and_is_archived_after_its_listener_detaches() -> None:
    runtime = GatedRuntime()
    engine = make_engine(runtime)
    recorder = Recorder()
    turn = await engine.submit(user_message(), recorder)
    await wait_for(runtime.streaming)
    engine.detach("s1", recorder)
    runtime.release.set()
    assert await engine.wait_idle(WAIT)
    reply = (await engine.store.list_messages("s1"))[-1]
    assert recorder.events == [TurnChunk("s1", turn.id, "partial ", reply.id, 0)]
    assert await stored_state(engine, turn) is TurnState.COMPLETED
    assert (reply.global_offset, reply.content) == (2, "partial rest")


async def test_cancel_ends_a_running_turn_with_partial_content() -> None:
    runtime = GatedRuntime()
    engine = make_engine(runtime)
    recorder = Recorder()
    turn = await engine.submit(user_message(), recorder)
    await wait_for(runtime.streaming)
    assert await engine.cancel("s1") is True
    assert recorder.terminals() == [TurnCompleted("s1", turn.id, "partial ", None, cancelled=True)]
    assert await stored_state(engine, turn) is TurnState.CANCELLED
    assert (await engine.store.list_messages("s1"))[-1].content == "partial "
    assert not engine.is_busy("s1")
    assert await engine.cancel("s1") is False


async def test_cancel_before_the_turn_starts_still_ends_it_once() -> None:
    runtime = ListRuntime(Chunk("never"), Done())
    engine = make_engine(runtime)
    recorder = Recorder()
    turn = await engine.submit(user_message(), recorder)
    assert await engine.cancel("s1") is True
    assert recorder.terminals() == [TurnCompleted("s1", turn.id, "", None, cancelled=True)]
    assert await stored_state(engine, turn) is TurnState.CANCELLED
    assert runtime.inputs == []
    assert not engine.is_busy("s1")


async def test_cancel_without_a_turn_is_false() -> None:
    engine = make_engine(ListRuntime(Done()))
    assert await engine.cancel("s1") is False


async def test_shutdown_interrupts_running_turns() -> None:
    runtime = GatedRuntime()
    engine = make_engine(runtime)
    recorder = Recorder()
    turn = await engine.submit(user_message(), recorder)
    await wait_for(runtime.streaming)
    await engine.shutdown()
    assert await stored_state(engine, turn) is TurnState.INTERRUPTED
    terminals = recorder.terminals()
    assert len(terminals) == 1
    assert isinstance(terminals[0], TurnFailed)
    assert terminals[0].code == "INTERNAL_ERROR"
    assert (await engine.store.list_messages("s1"))[-1].content == "partial "


async def test_start_interrupts_turns_left_unfinished_in_the_archive() -> None:
    engine = make_engine(ListRuntime(Done()))
    await engine.open_session(principal="alice", agent="default", session_id="s0")
    turn = Turn(id="old", session_id="s0", state=TurnState.RUNNING, created_at=1.0)
    await engine.store.create_turn(turn)
    await engine.start()
    stored = await engine.store.get_turn("old")
    assert stored is not None
    assert (stored.state, stored.ended_at) == (TurnState.INTERRUPTED, 1000.0)
    await engine.shutdown()


def make_replica(
    runtime: Runtime, store: MemoryStore, clock: Clock, *, replica_id: str = "", lease: float = 30.0
) -> Engine:
    return Engine(
        store=store,
        runtimes={"default": runtime},
        agents={"default": AgentSettings()},
        context_ttl=TTL,
        clock=clock,
        replica_id=replica_id,
        replica_lease=lease,
    )


async def running_turn_of(store: MemoryStore, turn_id: str, replica: str) -> None:
    if await store.get_session("s0") is None:
        await store.create_session(
            Session(
                id="s0",
                owner="bob",
                agent="default",
                created_at=1,
                updated_at=1,
                last_activity_at=1,
            )
        )
    await store.create_turn(
        Turn(id=turn_id, session_id="s0", state=TurnState.RUNNING, created_at=1.0, replica=replica)
    )


async def test_turns_carry_the_replica_that_runs_them() -> None:
    store, clock = MemoryStore(), Clock()
    engine = make_replica(ListRuntime(Done()), store, clock, replica_id="rep-1")
    turn, _ = await run_turn(engine, user_message())
    assert turn.replica == "rep-1"
    assert (await engine.store.list_turns("s1"))[0].replica == "rep-1"
    # Without a configured id, each engine draws its own.
    assert make_engine(ListRuntime(Done())).replica_id.startswith("rep-")
    assert (
        make_engine(ListRuntime(Done())).replica_id != make_engine(ListRuntime(Done())).replica_id
    )


async def test_start_spares_the_turns_of_a_live_replica() -> None:
    store, clock = MemoryStore(), Clock()
    await running_turn_of(store, "theirs", "rep-live")
    await running_turn_of(store, "dead", "rep-dead")
    await running_turn_of(store, "mine", "rep-1")  # left by this replica's earlier run
    await store.renew_replica("rep-live", clock() - 1)
    await store.renew_replica("rep-dead", clock() - 31)
    engine = make_replica(ListRuntime(Done()), store, clock, replica_id="rep-1")
    await engine.start()
    try:
        states = {t.id: t.state for t in await store.list_turns("s0")}
        assert states == {
            "theirs": TurnState.RUNNING,
            "dead": TurnState.INTERRUPTED,
            "mine": TurnState.INTERRUPTED,
        }
    finally:
        await engine.shutdown()


async def test_a_serving_replica_renews_its_lease_and_sweeps_orphans() -> None:
    store, clock = MemoryStore(), Clock()
    engine = make_replica(ListRuntime(Done()), store, clock, replica_id="rep-1", lease=0.06)
    await engine.start()
    try:
        await running_turn_of(store, "theirs", "rep-2")
        await store.renew_replica("rep-2", clock())
        clock.now += 1.0  # rep-2 stops renewing; rep-1 goes on
        for _ in range(100):
            turn = await store.get_turn("theirs")
            assert turn is not None
            if turn.state is TurnState.INTERRUPTED:
                break
            await asyncio.sleep(0.01)
        assert turn.state is TurnState.INTERRUPTED
        for _ in range(100):  # rep-1 renews with the clock
            if store._replicas.get("rep-1") == clock():
                break
            await asyncio.sleep(0.01)
        # So its own turns are safe from another replica's sweep.
        await running_turn_of(store, "mine", "rep-1")
        swept = await store.interrupt_orphaned_turns(clock(), replica_id="rep-3", lease=0.06)
        assert swept == 0
    finally:
        await engine.shutdown()
    assert engine._leasing is not None
    assert engine._leasing.done()


# -- ownership and expiry -------------------------------------------------------------


@pytest.mark.parametrize("own_session", [False, True])
async def test_foreign_session_looks_expired(own_session: bool) -> None:
    engine = make_engine(ListRuntime(Done(content="ok")))
    await run_turn(engine, user_message(principal="alice"))
    intruder = user_message(principal="mallory", own_session=own_session, content="steal")
    with pytest.raises(SessionExpired):
        await engine.submit(intruder, Recorder())
    assert [m.content for m in await engine.store.list_messages("s1")] == ["hi", "ok"]
    session = await engine.store.get_session("s1")
    assert session is not None
    assert session.owner == "alice"


async def test_expired_session_is_refused() -> None:
    clock = Clock(1000.0)
    engine = make_engine(ListRuntime(Done(content="ok")), clock=clock)
    await run_turn(engine, user_message())
    clock.now += TTL + 1
    with pytest.raises(SessionExpired):
        await engine.submit(user_message(content="late"), Recorder())
    assert len(await engine.store.list_messages("s1")) == 2


async def test_expired_own_session_is_accepted() -> None:
    clock = Clock(1000.0)
    engine = make_engine(ListRuntime(Done(content="ok")), clock=clock)
    await run_turn(engine, user_message())
    clock.now += TTL + 1
    await run_turn(engine, user_message(own_session=True, content="late"))
    assert len(await engine.store.list_messages("s1")) == 4


async def test_activity_keeps_a_session_alive() -> None:
    clock = Clock(1000.0)
    engine = make_engine(ListRuntime(Done(content="ok")), clock=clock)
    await run_turn(engine, user_message())
    clock.now += TTL - 1
    await run_turn(engine, user_message(content="again"))
    clock.now += TTL - 1
    await run_turn(engine, user_message(content="still here"))
    assert len(await engine.store.list_messages("s1")) == 6


async def test_unknown_agent_is_refused_for_a_new_session() -> None:
    engine = make_engine(ListRuntime(Done()))
    with pytest.raises(UnknownAgent):
        await engine.submit(user_message(agent="nobody"), Recorder())
    assert await engine.store.get_session("s1") is None


# -- declarations ---------------------------------------------------------------------


async def assert_refused(engine: Engine, declare: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(SessionDeclarationRefused) as caught:
        await engine.submit(user_message(declare=declare), Recorder())
    assert await engine.store.get_session("s1") is None
    assert await engine.store.list_messages("s1") == []
    assert not engine.is_busy("s1")
    assert caught.value.code == "SESSION_DECLARATION_REFUSED"
    details = caught.value.details
    assert details is not None
    return details


async def test_unknown_declaration_type_is_refused() -> None:
    engine = make_engine(ListRuntime(Done()), sandboxes=("code",))
    details = await assert_refused(engine, {"mcp_servers": {}})
    assert details["reason"] == "UnknownDeclarationType"
    assert details["type"] == "mcp_servers"


async def test_unknown_sandbox_is_refused() -> None:
    engine = make_engine(ListRuntime(Done()), sandboxes=("code",))
    details = await assert_refused(engine, {"sandboxes": {"browser/main": {}}})
    assert set(details) == {"type", "handle", "reason", "message"}
    assert (details["type"], details["handle"], details["reason"]) == (
        "sandbox",
        "browser/main",
        "UnknownSandbox",
    )
    assert "browser" in details["message"]


async def test_declared_known_sandbox_is_stored_and_given_to_the_runtime() -> None:
    runtime = ListRuntime(Done())
    engine = make_engine(runtime, sandboxes=("code",))
    declare = {"sandboxes": {"code/main": {"image": "python"}}}
    await run_turn(engine, user_message(declare=declare))
    session = await engine.store.get_session("s1")
    assert session is not None
    assert session.declare == declare
    assert runtime.inputs[0].declare == declare


# -- client tools ---------------------------------------------------------------------


async def test_tool_call_is_denied_by_the_default_broker() -> None:
    runtime = ToolRuntime()
    engine = make_engine(runtime)
    turn, recorder = await run_turn(engine, user_message())
    assert runtime.outcome is not None
    assert runtime.outcome.status == "denied"
    assert recorder.terminals() == [TurnCompleted("s1", turn.id, "tool denied")]


# -- compaction and the RPC backlog ------------------------------------------------------------


async def summary_of(engine: Engine, session_id: str, nth: int = 1) -> Message:
    """The session's `nth` summary, once the compaction has written it."""
    async with asyncio.timeout(WAIT):
        while True:
            messages = await engine.store.list_messages(session_id)
            summaries = [m for m in messages if m.content_type == "summary"]
            if len(summaries) >= nth:
                return summaries[nth - 1]
            await asyncio.sleep(0.01)


async def test_history_after_a_compaction_starts_at_the_summary() -> None:
    runtime = ListRuntime(Chunk("reply"), Done())
    engine = make_engine(runtime)
    await run_turn(engine, user_message(content="first"))
    session = await engine.store.get_session("s1")
    assert session is not None
    assert engine.compact(session, "") is True
    summary = await summary_of(engine, "s1")
    assert msgspec.json.decode(summary.content) == [
        {"role": "user", "text": "first"},
        {"role": "assistant", "text": "reply"},
    ]
    await run_turn(engine, user_message(content="second"))
    history = await runtime.inputs[-1].history()
    assert [m.content_type for m in history] == ["summary"]
    # A second compaction folds the first summary's items into the new one.
    assert engine.compact(session, "keep it short") is True
    newer = await summary_of(engine, "s1", nth=2)
    items = msgspec.json.decode(newer.content)
    assert items[0] == {"role": "instruction", "text": "keep it short"}
    assert items[1:3] == [{"role": "user", "text": "first"}, {"role": "assistant", "text": "reply"}]
    assert items[-2:] == [
        {"role": "user", "text": "second"},
        {"role": "assistant", "text": "reply"},
    ]


async def test_enqueued_messages_wait_for_the_running_turn_and_merge() -> None:
    runtime = GatedRuntime()
    engine = make_engine(runtime)
    session = await engine.open_session(principal="alice", agent="default", session_id="s1")
    await engine.enqueue(session, user_message(content="one"))
    await wait_for(runtime.streaming)
    second = await engine.enqueue(session, user_message(content="two"))
    third = await engine.enqueue(session, user_message(content="three"))
    runtime.release.set()
    while engine.is_busy("s1"):  # the first turn, then the one the others joined
        assert await engine.wait_idle(WAIT)
    turns = {t.id: t for t in await engine.store.list_turns("s1")}
    merged = [t for t in turns.values() if t.state is TurnState.MERGED]
    assert len(merged) == 1
    assert merged[0].id == third.turn_id
    assert merged[0].merged_into == second.turn_id
    assert turns[second.turn_id].state is TurnState.COMPLETED
    # The turn that ran answered the newest message; the others are in its history.
    answered = runtime.inputs[-1]
    assert (answered.turn_id, answered.message.content) == (second.turn_id, "three")
    history = [m.content for m in await answered.history() if m.role == "user"]
    assert history == ["one", "two"]


@pytest.mark.parametrize("yields_before_stop", range(8))
async def test_a_stop_racing_the_turns_end_leaves_exactly_one_terminal_state(
    yields_before_stop: int,
) -> None:
    # The turn ends on its own within a few loop steps; the stop lands before, during
    # or after that end depending on the parameter. Either way: one terminal event, and
    # the archive agrees with it.
    engine = make_engine(ListRuntime(Chunk("a"), Chunk("b"), Done()))
    session = await engine.open_session(principal="alice", agent="default", session_id="s1")
    recorder = Recorder()
    engine.attach("s1", recorder)
    await engine.enqueue(session, user_message(content="go"))
    for _ in range(yields_before_stop):
        await asyncio.sleep(0)
    await engine.stop("s1")
    assert await engine.wait_idle(WAIT)
    terminals = recorder.terminals()
    assert len(terminals) == 1
    (turn,) = await engine.store.list_turns("s1")
    expected = (
        TurnState.CANCELLED if getattr(terminals[0], "cancelled", False) else TurnState.COMPLETED
    )
    assert turn.state is expected


class LosingStore(MemoryStore):
    """An archive that cannot take a turn's user message."""

    async def begin_turn(
        self,
        turn: Turn,
        message: Message,
        *,
        reply: Message | None = None,
        unique_client_id: bool = False,
        started: Turn | None = None,
    ) -> Message:
        raise StoreError("disk full")


async def test_the_runtime_starts_before_the_message_is_archived_and_a_lost_message_fails_it() -> (
    None
):
    runtime = ListRuntime(Chunk("a"), Done())
    engine = make_engine(runtime, store=LosingStore())
    turn, recorder = await run_turn(engine, user_message())
    # The chunk went out (the archive is not waited for), but the turn cannot end as
    # answered without its message: one terminal event, a failure that hides the cause.
    (chunk,) = [e for e in recorder.events if isinstance(e, TurnChunk)]
    assert (chunk.text, chunk.index) == ("a", 0)
    assert recorder.terminals() == [TurnFailed("s1", turn.id, "INTERNAL_ERROR", "internal error")]
    assert await stored_state(engine, turn) is TurnState.FAILED


async def test_history_waits_for_the_message_to_be_archived() -> None:
    runtime = ListRuntime(Done())
    engine = make_engine(runtime)
    await run_turn(engine, user_message(content="first"))
    await run_turn(engine, user_message(content="second"))
    second = runtime.inputs[-1]
    history = [(m.role, m.content) for m in await second.history()]
    assert history == [("user", "first"), ("assistant", "")]  # the first turn said nothing


# -- /v1/session idempotency keys (message.client_id) --------------------------------


def keyed(key: str, *, principal: str = "alice", session_id: str = "s1") -> UserMessage:
    return UserMessage(
        principal=principal,
        agent="default",
        session_id=session_id,
        own_session=True,
        content="hi",
        client_id=key,
        unique_client_id=True,
    )


def test_the_message_frame_carries_its_key_both_ways() -> None:
    frame = f.client_frame_decoder.decode(
        b'{"type":"message","seq":1,"content":"hi","client_id":"cm-1"}'
    )
    assert isinstance(frame, f.Message)
    assert frame.client_id == "cm-1"
    assert b'"client_id":"cm-1"' in f.encode(frame)


def test_a_key_is_bounded() -> None:
    check_client_id("k" * CLIENT_ID_MAX_LENGTH)
    with pytest.raises(InvalidMessage):
        check_client_id("k" * (CLIENT_ID_MAX_LENGTH + 1))


async def test_a_repeated_key_is_not_archived_or_run_again() -> None:
    runtime = ListRuntime(Chunk("Hello "), Chunk("world"), Done())
    engine = make_engine(runtime)
    turn, _ = await run_turn(engine, keyed("cm-1"))
    with pytest.raises(DuplicateMessage) as refused:
        await engine.submit(keyed("cm-1"), Recorder())
    messages = await engine.store.list_messages("s1")
    assert [(m.role, m.content) for m in messages] == [("user", "hi"), ("assistant", "Hello world")]
    assert len(runtime.inputs) == 1
    assert refused.value.code == "DUPLICATE_MESSAGE"
    assert refused.value.details == {
        "client_id": "cm-1",
        "session_id": "s1",
        "message_id": messages[0].id,
        "turn_id": turn.id,
        "turn_state": "completed",
        "reply": "Hello world",
    }
    assert not engine.is_busy("s1")  # the refusal left the session free


async def test_keys_are_scoped_per_principal_and_unkeyed_messages_never_deduplicated() -> None:
    runtime = ListRuntime(Done(content="ok"))
    engine = make_engine(runtime)
    await run_turn(engine, keyed("cm-1"))
    await run_turn(engine, keyed("cm-1", principal="bob", session_id="s2"))  # bob's own
    with pytest.raises(DuplicateMessage):
        await engine.submit(keyed("cm-1"), Recorder())  # alice's, again
    await run_turn(engine, keyed(""))
    await run_turn(engine, keyed(""))
    assert len(runtime.inputs) == 4
    assert [m.role for m in await engine.store.list_messages("s2")] == ["user", "assistant"]


async def test_a_key_sent_again_while_its_turn_runs_names_the_running_turn() -> None:
    runtime = GatedRuntime()
    engine = make_engine(runtime)
    turn = await engine.submit(keyed("cm-1"), Recorder())
    await wait_for(runtime.streaming)
    with pytest.raises(DuplicateMessage) as refused:
        await engine.submit(keyed("cm-1"), Recorder())
    assert refused.value.details is not None
    assert (refused.value.details["turn_id"], refused.value.details["turn_state"]) == (
        turn.id,
        "running",
    )
    with pytest.raises(TurnInProgress):  # another key: the usual refusal
        await engine.submit(keyed("cm-2"), Recorder())
    runtime.release.set()
    assert await engine.wait_idle(WAIT)
    assert len(runtime.inputs) == 1


class FifoGatedStore(MemoryStore):
    """An archive whose `begin_turn` writes wait to be let through one by one, in the
    order they were made (as the SQL stores' one writer commits them)."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: list[asyncio.Event] = []
        self.holding = True

    async def begin_turn(self, turn: Turn, message: Message, **options: Any) -> Message:
        if self.holding:
            gate = asyncio.Event()
            self.gates.append(gate)
            await gate.wait()
        return await super().begin_turn(turn, message, **options)

    async def let_through(self) -> None:
        gate = self.gates.pop(0)
        gate.set()
        for _ in range(5):  # the write lands, the enqueue after it runs
            await asyncio.sleep(0)


class TurnByTurnRuntime:
    """Each turn streams a chunk and waits until the test releases that turn."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.releases: dict[str, asyncio.Event] = {}

    async def run(self, turn: TurnInput) -> TurnStream:
        self.started.append(turn.turn_id)
        release = self.releases.setdefault(turn.turn_id, asyncio.Event())
        yield Chunk("x")
        await release.wait()
        yield Done()

    def release(self, turn_id: str) -> None:
        self.releases.setdefault(turn_id, asyncio.Event()).set()


async def test_a_message_sent_while_earlier_ones_are_being_archived_waits_behind_them() -> None:
    # The bench's RPC fill found it: a send that found the session free while earlier
    # sends were still being archived started at once (archived `running`), landed in the
    # backlog behind them, and was then absorbed into one of them: a running turn cannot
    # merge, so that backlog was dropped, its turns pending for good.
    runtime = TurnByTurnRuntime()
    store = FifoGatedStore()
    engine = make_engine(runtime, store=store)
    session = await engine.open_session(principal="alice", agent="default", session_id="s1")
    first = asyncio.create_task(engine.enqueue(session, user_message(content="one")))
    await asyncio.sleep(0)
    await store.let_through()
    running = (await first).turn_id
    sends = [
        asyncio.create_task(engine.enqueue(session, user_message(content=text)))
        for text in ("two", "three")
    ]
    await asyncio.sleep(0)
    runtime.release(running)  # the first turn ends while "two" and "three" are archived
    assert await engine.wait_idle(WAIT)
    sends.append(asyncio.create_task(engine.enqueue(session, user_message(content="four"))))
    await asyncio.sleep(0)
    while store.gates:
        await store.let_through()
    messages = await asyncio.gather(*sends)
    store.holding = False
    while engine.is_busy("s1"):
        for turn_id in runtime.started:
            runtime.release(turn_id)
        await asyncio.sleep(0.01)
    states = {t.id: t.state for t in await engine.store.list_turns("s1")}
    # Every turn ended: "two" ran (the oldest waiting), "three" joined it or ran next,
    # and "four" too; none is left pending or running.
    assert set(states.values()) <= {TurnState.COMPLETED, TurnState.MERGED}, states
    assert {m.turn_id for m in messages} <= set(states)
