"""The call side of voice: the event rules, the slots, the parking lot (sans-I/O), and
the call service around a real scripted runtime and a real in-memory archive."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from portico.calls.directory import InProcessCallDirectory
from portico.calls.parking import InProcessParkingLot
from portico.calls.rules import CallRules, VoiceTurnRecord
from portico.calls.service import CallService, LiveCall
from portico.calls.slots import AudioSessionSlots
from portico.domain.model import Message, Session
from portico.domain.states import TurnState
from portico.errors import DuplexError, PorticoError, RateLimited, SessionExpired
from portico.runtime.duplex.base import (
    AgentText,
    AudioFormat,
    AudioIn,
    AudioOut,
    DuplexCall,
    DuplexEvent,
    DuplexFailure,
    DuplexStart,
    Hello,
    Interruption,
    SpokenTurnDone,
    Transcript,
)
from portico.runtime.duplex.scripted import ScriptedDuplexRuntime, VoiceScript, VoiceTurn
from portico.store.memory import MemoryStore

HELLO = Hello(format=AudioFormat())
LOUD = struct.pack("<320h", *([9000] * 320))
QUIET = bytes(640)
WAIT = 5.0  # seconds; a deadline, never a threshold


# -- rules -------------------------------------------------------------------------------


def feed_all(rules: CallRules, events: list[DuplexEvent]) -> tuple[list[object], list[object]]:
    forwarded: list[object] = []
    records: list[object] = []
    for event in events:
        step = rules.feed(event)
        forwarded += step.forward
        records += step.records
    return forwarded, records


def test_a_spoken_exchange_is_one_completed_text_turn() -> None:
    rules = CallRules()
    _, records = feed_all(
        rules,
        [HELLO, Transcript("hel", final=False), Transcript("hello"), AgentText("Hi "),
         AudioOut(data=b"x"), AgentText("you"), SpokenTurnDone()],
    )  # fmt: skip
    assert records == [
        VoiceTurnRecord(user_text="hello", reply_text="Hi you", state=TurnState.COMPLETED)
    ]


def test_partial_transcripts_make_the_utterance_when_the_final_one_is_empty() -> None:
    rules = CallRules()
    _, records = feed_all(
        rules, [HELLO, Transcript("he", final=False), Transcript("y", final=False),
                Transcript("", final=True), AgentText("yo"), SpokenTurnDone()]
    )  # fmt: skip
    assert [r.user_text for r in records] == ["hey"]  # type: ignore[attr-defined]


def test_barge_in_ends_the_turn_cancelled_with_what_was_said() -> None:
    rules = CallRules()
    _, records = feed_all(rules, [HELLO, Transcript("tell me"), AgentText("Once"), Interruption()])
    assert records == [
        VoiceTurnRecord(user_text="tell me", reply_text="Once", state=TurnState.CANCELLED)
    ]


def test_a_greeting_is_a_reply_alone_and_a_call_ending_mid_turn_cancels_it() -> None:
    rules = CallRules()
    _, records = feed_all(rules, [HELLO, AgentText("Welcome"), SpokenTurnDone(), Transcript("bye")])
    assert records == [
        VoiceTurnRecord(user_text="", reply_text="Welcome", state=TurnState.COMPLETED)
    ]
    assert rules.finish() == [
        VoiceTurnRecord(user_text="bye", reply_text="", state=TurnState.CANCELLED)
    ]


# What a runtime may say, and the client's barge-in ("interrupt"), in any order.
rule_inputs = st.lists(
    st.sampled_from(
        [HELLO, AudioOut(data=b"x"), AgentText("a"), Transcript("t"),
         Transcript("p", final=False), SpokenTurnDone(), Interruption(), "interrupt"]
    ),
    max_size=30,
)  # fmt: skip


@given(rule_inputs)
def test_the_agent_audio_shortcut_agrees_with_feeding_it(inputs: list[object]) -> None:
    # LiveCall._take forwards agent audio of a started call with `audio_out` instead of
    # `feed` (per frame, no Step): the same audio forwarded, the same turns archived.
    fed, short = CallRules(), CallRules()
    for item in inputs:
        if item == "interrupt":
            assert fed.interrupt() == short.interrupt()
        elif type(item) is AudioOut and short.hello is not None and not short.ended:
            step = fed.feed(item)
            assert step.forward == ([item] if short.audio_out() else [])
            assert step.records == []
            assert not step.ended
        else:
            assert isinstance(item, DuplexEvent)
            assert fed.feed(item) == short.feed(item)
    assert fed.finish() == short.finish()


def test_hello_comes_first_once_and_speaking_before_it_fails_the_call() -> None:
    rules = CallRules()
    step = rules.feed(AudioOut(data=b"x"))
    assert step.ended
    assert [type(e) for e in step.forward] == [DuplexFailure]
    assert rules.feed(HELLO).forward == []  # nothing after the failure
    rules = CallRules()
    assert rules.feed(HELLO).forward == [HELLO]
    assert rules.feed(HELLO).forward == []


def test_a_video_counter_offer_is_unsatisfiable() -> None:
    step = CallRules().feed(Hello(format=AudioFormat(frame_rate=30)))
    assert step.ended
    (failure,) = step.forward
    assert isinstance(failure, DuplexFailure)
    assert failure.code == "UNSATISFIABLE_FORMAT"


def test_one_failure_ends_the_call_and_fails_the_open_turn() -> None:
    rules = CallRules()
    feed_all(rules, [HELLO, Transcript("hi")])
    step = rules.feed(DuplexFailure("PROVIDER_UNAVAILABLE", "down"))
    assert step.ended
    assert step.records == [
        VoiceTurnRecord(
            user_text="hi",
            reply_text="",
            state=TurnState.FAILED,
            error_code="PROVIDER_UNAVAILABLE",
            error_message="down",
        )
    ]
    assert rules.feed(DuplexFailure("X", "again")).forward == []
    assert rules.finish() == []


# -- slots and parking -------------------------------------------------------------------


def test_audio_session_slots_per_process_and_per_principal() -> None:
    slots = AudioSessionSlots(3, 2)
    assert [slots.take("a"), slots.take("a"), slots.take("a")] == [None, None, "principal"]
    assert slots.take("b") is None
    assert slots.take("c") == "process"
    slots.give("a")
    assert slots.take("c") is None
    slots.give("nobody")  # never below zero
    assert slots.in_use == 3
    unlimited = AudioSessionSlots(10, None)
    assert all(unlimited.take("a") is None for _ in range(10))


def test_the_parking_lot_gives_a_call_back_to_its_owner_within_its_window() -> None:
    lot: InProcessParkingLot[str] = InProcessParkingLot()
    lot.park("s1", "alice", "call-1", until=10.0)
    assert lot.reclaim("s1", "bob", now=1.0) is None  # not bob's: stays parked
    assert lot.reclaim("s1", "alice", now=10.0) is None  # the window is over
    assert lot.reclaim("s1", "alice", now=9.0) == "call-1"
    assert lot.reclaim("s1", "alice", now=9.0) is None  # reclaimed once
    lot.park("s2", "alice", "call-2", until=5.0)
    lot.park("s3", "alice", "call-3", until=7.0)
    assert lot.next_deadline() == 5.0
    assert lot.expired(6.0) == ["call-2"]
    assert lot.discard("s3") == "call-3"
    assert len(lot) == 0
    assert lot.next_deadline() is None


# -- the service -------------------------------------------------------------------------

SCRIPT = VoiceScript(turns=(VoiceTurn(hear_frames=2, transcript="hello", reply="Hi", tone_ms=40),))


class Listener:
    def __init__(self) -> None:
        self.events: list[DuplexEvent | None] = []
        self.changed = asyncio.Event()

    def __call__(self, event: DuplexEvent | None) -> None:
        self.events.append(event)
        self.changed.set()

    async def until(self, kind: type | None) -> None:
        async with asyncio.timeout(WAIT):
            while not any(
                (e is None) if kind is None else isinstance(e, kind) for e in self.events
            ):
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def store() -> AsyncIterator[MemoryStore]:
    store = MemoryStore()
    await store.open()
    yield store
    await store.close()


def service_of(store: MemoryStore, runtime: object, **kw: object) -> CallService:
    async def open_session(*, principal: str, agent: str, session_id: str, binding: str) -> Session:
        return await store.create_session(
            Session(
                id=session_id,
                owner=principal,
                agent=agent,
                created_at=0.0,
                updated_at=0.0,
                last_activity_at=0.0,
                binding=binding,
            )
        )

    options: dict[str, object] = {
        "grace_window": 30.0,
        "max_sessions": 10,
        "max_sessions_per_principal": 2,
    }
    options.update(kw)
    return CallService(
        runtimes={"voice": runtime},  # type: ignore[dict-item]
        store=store,
        open_session=open_session,
        **options,  # type: ignore[arg-type]
    )


async def start(
    service: CallService, listener: Listener, *, principal: str = "alice", session: str = "s1"
) -> LiveCall:
    return await service.start(
        principal=principal,
        binding="",
        agent="voice",
        session_id=session,
        format=AudioFormat(),
        listener=listener,
    )


async def test_a_call_runs_and_archives_its_voice_turn_as_text(store: MemoryStore) -> None:
    service = service_of(store, ScriptedDuplexRuntime(SCRIPT, frame_interval=0))
    listener = Listener()
    call = await start(service, listener)
    for n in range(2):
        await call.send(AudioIn(LOUD, n))
    await listener.until(SpokenTurnDone)
    await call.send(AudioIn(QUIET, 2, is_last=True))
    await listener.until(None)
    assert isinstance(listener.events[0], Hello)
    messages = await store.list_messages("s1", after_offset=0, limit=10)
    assert [(m.role, m.content) for m in messages] == [("user", "hello"), ("assistant", "Hi")]
    (turn,) = await store.list_turns("s1")
    assert turn.state is TurnState.COMPLETED
    assert service.slots.in_use == 0
    assert service.live_count == 0


async def test_calls_past_the_principal_limit_are_rate_limited(store: MemoryStore) -> None:
    service = service_of(store, ScriptedDuplexRuntime(SCRIPT, frame_interval=0))
    first = await start(service, Listener(), session="s1")
    await start(service, Listener(), session="s2")
    with pytest.raises(RateLimited):
        await start(service, Listener(), session="s3")
    await start(service, Listener(), principal="bob", session="s4")
    await first.hangup()
    await first.wait()
    await start(service, Listener(), session="s5")  # the ended call's slot is free
    await service.shutdown()
    assert service.slots.in_use == 0


async def test_another_principals_session_is_refused_and_frees_its_slot(store: MemoryStore) -> None:
    service = service_of(store, ScriptedDuplexRuntime(SCRIPT, frame_interval=0))
    call = await start(service, Listener(), principal="alice", session="s1")
    await call.hangup()
    with pytest.raises(SessionExpired):
        await start(service, Listener(), principal="bob", session="s1")
    assert service.slots.held_by("bob") == 0


class Broken:
    """A runtime that fails where a runtime can: at start, or in the middle of a call."""

    def __init__(self, where: str) -> None:
        self.where = where

    async def start(self, start: DuplexStart) -> DuplexCall:
        if self.where == "start":
            raise OSError("boom")
        return self

    async def send(self, audio: AudioIn) -> None:
        if self.where == "send":
            raise OSError("boom")

    async def events(self) -> AsyncIterator[DuplexEvent]:
        yield HELLO
        if self.where == "events":
            raise OSError("boom")
        await asyncio.sleep(WAIT)

    async def close(self) -> None:
        return None


async def test_a_runtime_that_cannot_start_is_one_duplex_error(store: MemoryStore) -> None:
    service = service_of(store, Broken("start"))
    with pytest.raises(DuplexError):
        await start(service, Listener())
    assert service.slots.in_use == 0


@pytest.mark.parametrize("where", ["events", "send"])
async def test_a_runtime_failing_mid_call_is_one_failure_then_the_end(
    store: MemoryStore, where: str
) -> None:
    service = service_of(store, Broken(where))
    listener = Listener()
    call = await start(service, listener)
    await listener.until(Hello)
    await call.send(AudioIn(LOUD, 0))
    await listener.until(None)
    failures = [e for e in listener.events if isinstance(e, DuplexFailure)]
    assert [f.code for f in failures] == ["DUPLEX_ERROR"]
    assert listener.events[-1] is None
    assert service.slots.in_use == 0


async def test_a_parked_call_is_reclaimed_by_its_owner_only(store: MemoryStore) -> None:
    service = service_of(store, ScriptedDuplexRuntime(SCRIPT, frame_interval=0))
    first = Listener()
    call = await start(service, first)
    await first.until(Hello)
    service.park(call)
    assert await service.reclaim("s1", "bob", "") is None
    assert await service.reclaim("s1", "alice", "") is call
    second = Listener()
    call.attach(second)
    for n in range(2):
        await call.send(AudioIn(LOUD, n))
    await second.until(SpokenTurnDone)
    assert not any(isinstance(e, Transcript) for e in first.events)  # not the old socket's
    await service.shutdown()


async def test_a_parked_call_nobody_reclaims_ends_after_its_window(store: MemoryStore) -> None:
    service = service_of(store, ScriptedDuplexRuntime(SCRIPT, frame_interval=0), grace_window=0.05)
    listener = Listener()
    call = await start(service, listener)
    await listener.until(Hello)
    service.park(call)
    async with asyncio.timeout(WAIT):
        await call.wait()
    assert call.over
    assert service.slots.in_use == 0
    assert len(service.parking) == 0
    assert await service.reclaim("s1", "alice", "") is None


async def test_an_unknown_agent_takes_no_calls(store: MemoryStore) -> None:
    service = service_of(store, ScriptedDuplexRuntime(SCRIPT))
    assert service.takes_calls("voice")
    assert not service.takes_calls("other")
    with pytest.raises(PorticoError) as caught:
        await service.start(
            principal="a", binding="", agent="other", session_id="x", format=AudioFormat(),
            listener=Listener(),
        )  # fmt: skip
    assert caught.value.code == "MEDIA_NOT_ENABLED"


class Recording(ScriptedDuplexRuntime):
    def __init__(self) -> None:
        super().__init__(SCRIPT, frame_interval=0)
        self.starts: list[DuplexStart] = []

    async def start(self, start: DuplexStart) -> DuplexCall:
        self.starts.append(start)
        return await super().start(start)


async def test_a_call_reads_the_sessions_earlier_turns_as_history(store: MemoryStore) -> None:
    runtime = Recording()
    service = service_of(store, runtime)
    listener = Listener()
    call = await start(service, listener)
    for n in range(2):
        await call.send(AudioIn(LOUD, n))
    await listener.until(SpokenTurnDone)
    await call.hangup()
    await call.wait()
    await start(service, Listener())  # the same session, a second call
    reader = runtime.starts[-1].history_reader
    assert reader is not None
    (user, reply) = await reader(messages_probe())
    assert (user.content, reply.content) == ("hello", "Hi")
    await service.shutdown()


def messages_probe() -> Message:
    return Message(id="probe", session_id="s1", role="user", content="", created_at=0, updated_at=0)


class SlowToHear(ScriptedDuplexRuntime):
    """Its calls' `send` suspends (as a runtime writing to a socket does) until let
    through, and records frames going in at once."""

    def __init__(self) -> None:
        super().__init__(SCRIPT, frame_interval=0)
        self.through = asyncio.Event()
        self.heard: list[int] = []
        self.at_once = 0
        self.most_at_once = 0

    async def start(self, start: DuplexStart) -> DuplexCall:
        call = await super().start(start)
        inner = call.send

        async def send(audio: AudioIn) -> None:
            self.at_once += 1
            self.most_at_once = max(self.most_at_once, self.at_once)
            await self.through.wait()
            self.heard.append(audio.sequence)
            self.at_once -= 1
            await inner(audio)

        call.send = send  # type: ignore[method-assign]
        return call


async def test_frames_of_two_holders_of_a_call_go_in_one_at_a_time_in_order(
    store: MemoryStore,
) -> None:
    """A call taken over while the old connection's frame is still going in: the new
    connection's frames wait their turn (calls/turnstile.py)."""
    runtime = SlowToHear()
    service = service_of(store, runtime)
    call = await start(service, Listener())
    sends = [asyncio.ensure_future(call.send(AudioIn(QUIET, n))) for n in range(3)]
    for _ in range(3):
        await asyncio.sleep(0)  # the first is in the runtime, the others wait
    assert runtime.at_once == 1
    runtime.through.set()
    await asyncio.wait_for(asyncio.gather(*sends), WAIT)
    assert runtime.heard == [0, 1, 2]
    assert runtime.most_at_once == 1
    await service.shutdown()


async def test_a_resume_takes_over_a_call_its_owner_still_holds(store: MemoryStore) -> None:
    service = service_of(store, ScriptedDuplexRuntime(SCRIPT, frame_interval=0))
    first, released = Listener(), []
    call = await start(service, first)
    call.attach(first, lambda: released.append(True))
    await first.until(Hello)
    assert await service.reclaim("s1", "bob", "") is None  # not bob's
    assert released == []
    assert await service.reclaim("s1", "alice", "") is call
    assert released == [True]  # the old holder let go
    second = Listener()
    call.attach(second)
    for n in range(2):
        await call.send(AudioIn(LOUD, n))
    await second.until(SpokenTurnDone)
    assert not any(isinstance(e, Transcript) for e in first.events)
    await call.hangup()
    assert await service.reclaim("s1", "alice", "") is None  # hung up: nothing to take over
    await service.shutdown()


async def test_shutdown_hangs_up_every_call_and_archives_its_open_turn(store: MemoryStore) -> None:
    slow = VoiceScript(
        turns=(VoiceTurn(hear_frames=2, transcript="hello", reply="Hi", tone_ms=4000),)
    )
    service = service_of(store, ScriptedDuplexRuntime(slow, frame_interval=0.02))
    listener = Listener()
    call = await start(service, listener)
    for n in range(2):
        await call.send(AudioIn(LOUD, n))
    await listener.until(AudioOut)  # speaking, for seconds
    parked = await start(service, Listener(), session="s2")
    service.park(parked)
    await service.shutdown()
    assert call.over
    assert parked.over
    assert service.slots.in_use == 0
    (turn,) = await store.list_turns("s1")
    assert turn.state is TurnState.CANCELLED
    messages = await store.list_messages("s1", after_offset=0, limit=10)
    assert [(m.role, m.content) for m in messages] == [("user", "hello"), ("assistant", "Hi")]


# -- two replicas sharing one call directory ------------------------------------------------


class Link:
    """The bus's control between two call services: release on the named replica."""

    def __init__(self) -> None:
        self.replicas: dict[str, CallService] = {}
        self.asked: list[tuple[str, str]] = []

    async def release_call(self, replica: str, session_id: str, token: str) -> bool:
        self.asked.append((replica, session_id))
        service = self.replicas.get(replica)
        if service is None:
            raise TimeoutError("the replica is gone")  # as the bus's deadline answers
        return await service.release_here(session_id, token)


def replica_pair(
    store: MemoryStore, directory: InProcessCallDirectory, link: Link, **kw: object
) -> tuple[CallService, CallService]:
    a, b = (
        service_of(
            store,
            ScriptedDuplexRuntime(SCRIPT, frame_interval=0),
            directory=directory,
            replica_id=name,
            handover=link,
            **kw,
        )
        for name in ("rep-a", "rep-b")
    )
    link.replicas.update({"rep-a": a, "rep-b": b})
    return a, b


async def test_a_resume_on_another_replica_continues_the_call_there(store: MemoryStore) -> None:
    directory, link = InProcessCallDirectory(), Link()
    a, b = replica_pair(store, directory, link)
    first = Listener()
    call = await start(a, first)
    await first.until(Hello)
    a.park(call)
    assert await b.reclaim("s1", "bob", "") is None  # another principal's: refused
    continued = await b.reclaim("s1", "alice", "")
    assert isinstance(continued, LiveCall)
    assert continued.session_id == "s1"
    assert continued.agent == "voice"
    second = Listener()
    continued.attach(second)
    async with asyncio.timeout(WAIT):
        await call.wait()  # A let go of its call: it is over there
    assert call.hung_up
    assert len(a.parking) == 0
    assert a.slots.in_use == 0
    for n in range(2):
        await continued.send(AudioIn(LOUD, n))
    await second.until(SpokenTurnDone)
    assert link.asked == [("rep-a", "s1")]
    await a.shutdown()
    await b.shutdown()


async def test_two_racing_resumes_continue_the_call_once(store: MemoryStore) -> None:
    directory, link = InProcessCallDirectory(), Link()
    a, b = replica_pair(store, directory, link)
    call = await start(a, Listener())
    a.park(call)
    await asyncio.sleep(0)  # the park's directory write
    got = await asyncio.gather(b.reclaim("s1", "alice", ""), b.reclaim("s1", "alice", ""))
    # One continuation: the later resume gets nothing, or takes the same call over.
    assert len({id(g) for g in got if isinstance(g, LiveCall)}) == 1
    assert b.live_count == 1
    assert link.asked == [("rep-a", "s1")]
    await a.shutdown()
    await b.shutdown()


async def test_a_parked_call_past_its_window_is_not_continued_elsewhere(
    store: MemoryStore,
) -> None:
    directory, link = InProcessCallDirectory(), Link()
    now = [1000.0]
    a, b = replica_pair(store, directory, link, wall=lambda: now[0])
    call = await start(a, Listener())
    a.park(call)
    await asyncio.sleep(0)
    now[0] += 31.0  # the window (30 s) is over, whatever A's sweep did
    assert await b.reclaim("s1", "alice", "") is None
    assert link.asked == []
    await a.shutdown()
    await b.shutdown()


async def test_a_resume_after_the_holding_replica_died_continues_at_once(
    store: MemoryStore,
) -> None:
    directory, link = InProcessCallDirectory(), Link()
    a, b = replica_pair(store, directory, link)
    call = await start(a, Listener())
    a.park(call)
    await asyncio.sleep(0)
    del link.replicas["rep-a"]  # killed: it answers nothing
    continued = await b.reclaim("s1", "alice", "")
    assert isinstance(continued, LiveCall)  # not waiting on the dead replica
    await b.shutdown()
    await a.shutdown()
