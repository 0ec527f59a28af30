"""The engine: owns conversations, not sockets.

Protocol adapters call `submit` with a validated user message; the engine
checks ownership and expiry, archives the message, and starts the turn in a
task it owns, so the turn finishes and is archived after the client is gone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import msgspec

from portico.config import AgentSettings, ClientToolSettings
from portico.core.compaction import SUMMARY_THROUGH, compose_summary, since_latest_summary
from portico.core.duplicates import earlier_send, running_duplicate
from portico.core.events import Listener, TurnCompleted, TurnEvent, TurnFailed
from portico.core.periodic import every
from portico.core.replicalink import ReplicaLink
from portico.core.reservations import SessionReservations
from portico.core.telemetry import NoTelemetry, Telemetry
from portico.core.tools import NoClientTools, ToolBroker
from portico.core.turns import EndRetry, StreamedSoFar, TurnRunner
from portico.domain.memory import NO_FACET, AgentMemory, MemoryKey, MemoryLimits
from portico.domain.model import ContentPart, Message, Session, Turn, new_id
from portico.domain.states import TurnState, TurnTrigger, next_turn_state
from portico.domain.trace import MESSAGE_METADATA, SessionTraces
from portico.errors import (
    DuplicateMessage,
    InternalError,
    InvalidMessage,
    MediaNotEnabled,
    PorticoError,
    SessionDeclarationRefused,
    SessionExpired,
    TurnInProgress,
    UnknownAgent,
)
from portico.runtime.base import (
    ClientTool,
    Closable,
    ConversationKeeper,
    ConversationReleaser,
    HistoryReader,
    MediaAccess,
    Runtime,
    Summarizer,
    TurnInput,
)
from portico.store.base import Background, Store, detached

log = logging.getLogger("portico.engine")

# How many archived messages a runtime is given as history.
HISTORY_LIMIT = 1000
REPLICA_LEASE = 30.0  # seconds; the `replica_lease` setting's default
# How often a replica retries taking the turn lock of a session whose turn runs on
# another replica while RPC messages wait for it here.
CLAIM_RETRY = 0.1
# Sessions whose owner this replica remembers (a turn's lock is claimed while their
# session is read, "One turn per session" in docs/replicas.md); the oldest go first.
KNOWN_OWNERS = 10_000


class UserMessage(msgspec.Struct, frozen=True, kw_only=True):
    """A validated user message, as every protocol hands it to the engine."""

    principal: str
    agent: str
    session_id: str
    # The caller's session-binding value: a session opened here records it, and one
    # recorded with another value is foreign (`SessionExpired`).
    binding: str = ""
    # True when the connection minted this session id itself (Omnia `connected`):
    # such a session is the caller's own and is never "resumed".
    own_session: bool = False
    content: str = ""
    parts: tuple[ContentPart, ...] = ()
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    directives: dict[str, str] = msgspec.field(default_factory=dict)
    declare: dict[str, Any] | None = None
    client_id: str = ""
    # The client id must be new for the principal. RPC `message.send`: the archive
    # checks it in the message's own transaction (`DuplicateClientId` otherwise);
    # `submit` (`/v1/session`) checks it first (`DuplicateMessage` otherwise).
    unique_client_id: bool = False
    client_tools: tuple[ClientTool, ...] = ()
    context: dict[str, Any] = msgspec.field(default_factory=dict)
    # Scopes the turn's agent memory (with the session's owner and agent).
    memory_facet: str = NO_FACET


def check_declaration(declare: dict[str, Any], agent: AgentSettings) -> None:
    """Refuse a `declare` the agent cannot satisfy, the way the Omnia runtime does."""
    for kind, value in declare.items():
        if kind != "sandboxes":
            raise SessionDeclarationRefused(
                f"unknown declaration type {kind!r}",
                details={
                    "type": kind,
                    "handle": "",
                    "reason": "UnknownDeclarationType",
                    "message": f"declaration type {kind!r} is not supported",
                },
            )
        if not isinstance(value, dict):
            raise SessionDeclarationRefused(
                "sandboxes must be an object",
                details={
                    "type": "sandbox",
                    "handle": "",
                    "reason": "InvalidSandboxDeclaration",
                    "message": "sandboxes must be an object keyed by handle",
                },
            )
        for handle in value:
            sandbox = str(handle).split("/", 1)[0]
            if sandbox not in agent.sandboxes:
                raise SessionDeclarationRefused(
                    f"unknown sandbox {sandbox!r}",
                    details={
                        "type": "sandbox",
                        "handle": handle,
                        "reason": "UnknownSandbox",
                        "message": f"the agent has no sandbox named {sandbox!r}",
                    },
                )


class OpenReply(NamedTuple):
    """A turn's reply, created `pending` with the turn so that its `created` update is
    out before the first chunk (RPC live chunks wait for it), and the write doing so."""

    message: Message
    written: asyncio.Future[Any]


class Queued(NamedTuple):
    session: Session
    turn: Turn
    turn_input: TurnInput
    reply: OpenReply | None


class Engine:
    def __init__(
        self,
        *,
        store: Store,
        runtimes: Mapping[str, Runtime],
        agents: Mapping[str, AgentSettings],
        context_ttl: float,
        tools: ToolBroker | None = None,
        telemetry: Telemetry | None = None,
        media: MediaAccess | None = None,
        clock: Callable[[], float] = time.time,
        replica_id: str = "",
        replica_lease: float = REPLICA_LEASE,
        reservations: SessionReservations | None = None,
        memory_limits: MemoryLimits | None = None,
        link: ReplicaLink | None = None,
        end_retry: EndRetry | None = None,
    ) -> None:
        """`replica_id` names this process among the replicas sharing the archive (empty:
        a fresh one); `replica_lease`: seconds without renewal after which a replica
        counts as dead and its turns are interrupted (docs/storage.md). `link`: the
        other replicas (docs/replicas.md); None runs as the only process. `end_retry`:
        how a turn's end the archive refused is written again."""
        self._media = media
        self.reservations = reservations or SessionReservations()
        self._telemetry = telemetry or NoTelemetry()
        self.store = store
        self.traces = SessionTraces(store, clock)
        self._memory_limits = memory_limits or MemoryLimits()
        self._runtimes = dict(runtimes)
        self._agents = dict(agents)
        self._context_ttl = context_ttl
        self._tools = tools or NoClientTools()
        self._clock = clock
        # Session id -> its running turn. A key without a runner is a reservation
        # taken synchronously so two racing messages cannot both start a turn.
        self._running: dict[str, TurnRunner | None] = {}
        self._tasks: dict[str, asyncio.Task[Turn]] = {}
        self._listeners: dict[str, tuple[Listener, ...]] = {}
        self._owner_listeners: dict[str, tuple[Listener, ...]] = {}
        # Sessions of an owner whose turn another replica streams (its relayed events
        # seen here, its terminal one not yet): what an RPC credential close waits for.
        self._streamed_elsewhere: dict[str, set[str]] = {}
        # RPC messages waiting for the session's running turn to end, oldest first.
        self._backlog: dict[str, list[Queued]] = {}
        self._background = Background("archiving in the background")
        self._stopping = False  # shutting down: waiting turns stay pending
        self._compacting: set[str] = set()  # sessions with a compaction queued
        # RPC messages being archived, per session: a turn may start at once only when
        # none is, or it would overtake an earlier message still on its way to the backlog.
        self._archiving: Counter[str] = Counter()
        self.replica_id = replica_id or new_id("rep")
        self._lease = replica_lease
        self._leasing: asyncio.Task[None] | None = None
        self._link = link
        self._end_retry = end_retry or EndRetry()
        self._claiming: set[str] = set()  # sessions whose backlog waits for the turn lock
        # Session id -> (owner, binding) of the sessions whose messages this replica
        # accepted: neither changes once a session exists.
        self._owners: dict[str, tuple[str, str]] = {}
        if link is not None:
            link.bind(self)

    async def start(self) -> None:
        """Take the lease, interrupt the turns left without a live replica (this one's
        too: it runs none yet), then keep the lease and sweep while serving."""
        await self.store.renew_replica(self.replica_id, self._clock())
        await self._interrupt_orphans(include_own=True)
        self._leasing = detached(self._keep_lease(), name="replica-lease")
        if self._link is not None:
            await self._link.start()

    async def _keep_lease(self) -> None:
        # Renewed three times per lease, so one or two slow writes do not let it lapse;
        # swept twice per lease, so a dead replica's turns end at most one and a half
        # leases after its last renewal.
        await asyncio.gather(
            # Not at once: start() has just done both.
            every(self._lease / 3, "lease renewal", self._renew, at_once=False),
            every(self._lease / 2, "orphan sweep", self._interrupt_orphans, at_once=False),
        )

    async def _renew(self) -> None:
        await self.store.renew_replica(self.replica_id, self._clock())

    async def _interrupt_orphans(self, *, include_own: bool = False) -> None:
        interrupted = await self.store.interrupt_orphaned_turns(
            self._clock(), replica_id=self.replica_id, lease=self._lease, include_own=include_own
        )
        if interrupted:
            log.info("marked %d turns interrupted: their replica stopped", interrupted)

    def has_agent(self, name: str) -> bool:
        return name in self._agents and name in self._runtimes

    def ai_disclosure(self, agent: str) -> bool | None:
        """The agent's `requires_ai_disclosure`; None when it declares nothing."""
        settings = self._agents.get(agent)
        return None if settings is None else settings.requires_ai_disclosure

    def fixed_facet(self, agent: str) -> str | None:
        """The memory facet the agent fixes for every connection, if any."""
        settings = self._agents.get(agent)
        return None if settings is None else settings.memory_facet

    def is_busy(self, session_id: str) -> bool:
        return session_id in self._running

    # -- listeners ----------------------------------------------------------------

    def attach(self, session_id: str, listener: Listener) -> None:
        """`listener` gets the events of the session's turns, wherever they run."""
        first = session_id not in self._listeners
        _add_listener(self._listeners, session_id, listener)
        if first and self._link is not None:
            self._link.watch_session(session_id)

    def detach(self, session_id: str, listener: Listener) -> None:
        had = session_id in self._listeners
        _remove_listener(self._listeners, session_id, listener)
        if had and session_id not in self._listeners and self._link is not None:
            self._link.unwatch_session(session_id)

    def attach_owner(self, principal: str, listener: Listener) -> None:
        """`listener` gets the events of every turn of the principal's sessions (RPC)."""
        first = principal not in self._owner_listeners
        _add_listener(self._owner_listeners, principal, listener)
        if first and self._link is not None:
            self._link.watch_owner(principal)

    def detach_owner(self, principal: str, listener: Listener) -> None:
        had = principal in self._owner_listeners
        _remove_listener(self._owner_listeners, principal, listener)
        if had and principal not in self._owner_listeners and self._link is not None:
            self._link.unwatch_owner(principal)

    # Events of turns another replica runs, relayed by the link (`RemoteSink`).
    def deliver_to_session(self, session_id: str, event: TurnEvent) -> None:
        _deliver(self._listeners.get(session_id, ()), event)

    def deliver_to_owner(self, owner: str, event: TurnEvent) -> None:
        if isinstance(event, TurnCompleted | TurnFailed):
            sessions = self._streamed_elsewhere.get(owner)
            if sessions is not None:
                sessions.discard(event.session_id)
                if not sessions:
                    del self._streamed_elsewhere[owner]
        else:
            self._streamed_elsewhere.setdefault(owner, set()).add(event.session_id)
        _deliver(self._owner_listeners.get(owner, ()), event)

    async def session_position(self, session_id: str) -> str:
        """Where the session's relayed turn events stand now ("" without replicas)."""
        return "" if self._link is None else await self._link.session_position(session_id)

    async def recent_events(self, session_id: str, count: int, after: str = "") -> list[TurnEvent]:
        """The session's newest `count` turn events since position `after`, from every
        replica, newest first (none without replicas: one process has them all)."""
        if self._link is None:
            return []
        return await self._link.recent_session_events(session_id, count, after)

    async def runs_elsewhere(self, session_ids: Iterable[str]) -> bool:
        """Whether another replica runs a turn of one of these sessions now (its turn
        lock says so; a dead replica's lapses within the lease). False without replicas
        or while the bus is unreachable: a credential close is then not held off."""
        if self._link is None:
            return False
        for session_id in session_ids:
            if session_id in self._running:
                continue
            try:
                if await self._link.runs_elsewhere(session_id):
                    return True
            except PorticoError:
                return False
        return False

    async def runs_a_turn_elsewhere_for(self, owner: str) -> bool:
        """`runs_elsewhere` for the owner's sessions whose turn output another replica
        streams to this one (a turn that has sent nothing yet is not seen). A session
        whose lock no other replica holds is forgotten (its terminal event was lost)."""
        sessions = self._streamed_elsewhere.get(owner)
        for session_id in list(sessions or ()):
            if await self.runs_elsewhere((session_id,)):
                return True
            sessions.discard(session_id)  # type: ignore[union-attr]
        if sessions is not None and not sessions:
            self._streamed_elsewhere.pop(owner, None)
        return False

    def _listeners_of(self, session_id: str, owner: str) -> tuple[Listener, ...]:
        listeners = self._listeners.get(session_id, ())
        if owner in self._owner_listeners:
            return listeners + self._owner_listeners[owner]
        return listeners

    def streaming_replies(self, owner: str) -> list[str]:
        """Ids of the owner's replies being streamed now and already archived as such."""
        return [
            runner.reply_id
            for runner in self._running.values()
            if runner is not None and runner.owner == owner and runner.reply_archived
        ]

    def runs_a_turn_for(self, owner: str) -> bool:
        """Whether a turn runs in any of the owner's sessions (an RPC connection sees
        them all, so its credential close waits for them)."""
        return any(r is not None and r.owner == owner for r in self._running.values())

    def streamed_so_far(self, session_id: str) -> StreamedSoFar | None:
        """The session's reply being streamed by this process now, as far as it got."""
        runner = self._running.get(session_id)
        return None if runner is None else runner.streamed_so_far()

    # -- turns --------------------------------------------------------------------

    async def submit(self, message: UserMessage, listener: Listener | None = None) -> Turn:
        """Archive a user message and start its turn; raises the protocol's refusal."""
        await self._check_media(message)
        ahead = self._claim_ahead(message)
        try:
            # Ownership first: a foreign session must look expired, never busy.
            session = await self._session_for(message)
        except BaseException:
            if ahead is not None:
                await self._abandon(message.session_id, ahead)
            raise
        if ahead is None:
            if session.id in self._running:
                raise self._running_duplicate(session.id, message) or TurnInProgress(session.id)
            self._running[session.id] = None
        self._known_owner(session)
        try:
            await self._refuse_repeated_key(message)
            if ahead is None:
                await self._claim(session.id)
            else:
                await ahead
            turn, turn_input, reply = self._archive_behind(session, message)
        except BaseException:
            await self._abandon(session.id, ahead)
            raise
        if listener is not None:
            self.attach(session.id, listener)
        self._start_runner(session, turn, turn_input, reply)
        return turn

    async def _claim(self, session_id: str) -> None:
        """Take the session's turn across replicas; another replica's turn is busy."""
        if self._link is not None and not await self._link.claim(session_id):
            raise TurnInProgress(session_id)

    def _claim_ahead(self, message: UserMessage) -> asyncio.Future[None] | None:
        """With replicas: the turn lock's round trip started now, beside the session's
        read, when this replica knows the sender as the session's owner and runs no
        turn in it (the slot is taken at once, as after the read). Anyone else's
        message is read first and claims after: a foreign sender never holds the
        lock, even for a round trip, and gets `SessionExpired` as before."""
        session_id = message.session_id
        if self._link is None or session_id in self._running:
            return None
        if self._owners.get(session_id) != (message.principal, message.binding):
            return None
        self._running[session_id] = None
        return asyncio.ensure_future(self._claim(session_id))

    def _known_owner(self, session: Session) -> None:
        if self._link is None:
            return  # one process: nothing is claimed ahead
        self._owners.pop(session.id, None)  # the newest last: the oldest go first
        self._owners[session.id] = (session.owner, session.binding)
        if len(self._owners) > KNOWN_OWNERS:
            del self._owners[next(iter(self._owners))]

    async def _abandon(self, session_id: str, ahead: asyncio.Future[None] | None) -> None:
        """A submit refused after it took the session's slot: the slot and the lock go,
        once a claim started ahead has answered (a lock granted after would stay)."""
        if ahead is not None:
            await asyncio.wait({ahead})
            if not ahead.cancelled():
                ahead.exception()  # the refusal raised is the caller's, not the claim's
        del self._running[session_id]
        if self._link is not None and self._link.holds(session_id):
            self._link.release(session_id)

    def _running_duplicate(self, session_id: str, message: UserMessage) -> DuplicateMessage | None:
        """The running turn answers this very message (sent again with its key)."""
        runner = self._running.get(session_id)
        if runner is None or not message.unique_client_id or not message.client_id:
            return None
        earlier = runner.message
        if earlier.client_id != message.client_id:
            return None
        return running_duplicate(earlier, runner.turn.id)

    async def _refuse_repeated_key(self, message: UserMessage) -> None:
        """`/v1/session` keys: checked while the session's slot is held, so an earlier
        message of this session with the key is archived by now (a turn ends only once
        its user message is written)."""
        if message.unique_client_id and message.client_id:
            duplicate = await earlier_send(self.store, message.principal, message.client_id)
            if duplicate is not None:
                raise duplicate

    async def enqueue(self, session: Session, message: UserMessage) -> Message:
        """RPC: archive the message with a pending turn that runs once the session is free.

        Messages that arrive while a turn runs wait; when it ends, the oldest waiting
        turn runs, answering the newest message (the others are in its history), and
        absorbs the rest, which end `merged` into it. The caller checked ownership.
        """
        await self._check_media(message)
        # Only a turn that will start at once gets its reply (and its start) with its
        # first write: one that waits may end merged, and its reply would stay empty. A
        # message still being archived counts as waiting: the writes land in order, so
        # this turn would reach the backlog behind it, archived `running` but absorbed
        # into it (a running turn cannot be merged: the backlog was lost with it).
        starts_now = not self._busy_or_archiving(session.id)
        self._archiving[session.id] += 1
        try:
            turn, turn_input, reply = await self._archive_user_message(
                session, message, with_reply=starts_now
            )
        finally:
            self._archiving[session.id] -= 1
            if not self._archiving[session.id]:
                del self._archiving[session.id]
        self._backlog.setdefault(session.id, []).append(Queued(session, turn, turn_input, reply))
        self._start_waiting(session.id)
        return turn_input.message

    def _busy_or_archiving(self, session_id: str) -> bool:
        return (
            session_id in self._running
            or bool(self._backlog.get(session_id))
            or session_id in self._archiving
        )

    def _start_waiting(self, session_id: str) -> None:
        if session_id in self._running or self._stopping:
            return
        if self._link is not None and not self._link.holds(session_id):
            if self._backlog.get(session_id) and session_id not in self._claiming:
                self._claiming.add(session_id)
                self._background.spawn(self._claim_for_backlog(session_id))
            return
        waiting = self._backlog.pop(session_id, None)
        if not waiting:
            return
        first, latest = waiting[0], waiting[-1]
        for absorbed in waiting[1:]:
            self._end_waiting(absorbed, TurnTrigger.MERGE, merged_into=first.turn.id)
        turn_input = msgspec.structs.replace(latest.turn_input, turn_id=first.turn.id)
        self._start_runner(first.session, first.turn, turn_input, first.reply)

    async def _claim_for_backlog(self, session_id: str) -> None:
        """RPC messages wait here while another replica runs the session's turn: retry
        its lock until this replica has it, then run them (the backlog's merge rule)."""
        assert self._link is not None
        try:
            while self._backlog.get(session_id) and not self._stopping:
                if session_id not in self._running:
                    self._running[session_id] = None  # a local submit now is busy
                    try:
                        won = await self._link.claim(session_id)
                    except PorticoError:
                        won = False  # the bus is down: they keep waiting, pending
                    finally:
                        if self._running.get(session_id, self) is None:
                            del self._running[session_id]
                    if won:
                        break
                await asyncio.sleep(CLAIM_RETRY)
        finally:
            self._claiming.discard(session_id)
        if self._link.holds(session_id):
            if self._backlog.get(session_id) and session_id not in self._running:
                self._start_waiting(session_id)
            elif session_id not in self._running:
                self._link.release(session_id)

    def _end_waiting(self, queued: Queued, trigger: TurnTrigger, *, merged_into: str = "") -> None:
        turn = queued.turn
        ended = msgspec.structs.replace(
            turn,
            state=next_turn_state(turn.state, trigger),
            merged_into=merged_into,
            ended_at=self._clock(),
        )
        # Not awaited: the caller is starting or stopping a turn right now; the write is
        # queued behind the turn's own and tracked so it is neither lost nor unlogged.
        self._background.spawn(self.store.save_turn(ended))
        if queued.reply is not None:  # it never ran: its reply ends empty
            done = msgspec.structs.replace(queued.reply.message, status="completed")
            self._background.spawn(self._update_message(done))

    async def _update_message(self, message: Message) -> None:
        await self.store.update_message(message)

    def compact(self, session: Session, instruction: str) -> bool:
        """Queue a compaction of the session's history; False when one is queued already
        (it is absorbed). It runs when no turn runs, so it summarises a settled history."""
        if session.id in self._compacting:
            return False
        self._compacting.add(session.id)
        self._background.spawn(self._compact(session, instruction))
        return True

    async def _compact(self, session: Session, instruction: str) -> None:
        try:
            await self._until_free(session.id)
            recent = await self.store.list_messages(session.id)
            history = since_latest_summary(recent[-HISTORY_LIMIT:])
            if not history:
                return
            runtime = self._runtimes.get(session.agent)
            summarizer = runtime if isinstance(runtime, Summarizer) else None
            items = await compose_summary(history, instruction, summarizer)
            now = self._clock()
            await self.store.append_message(
                Message(
                    id=new_id("msg"),
                    session_id=session.id,
                    role="system",
                    content=msgspec.json.encode(items).decode(),
                    content_type="summary",
                    metadata={SUMMARY_THROUGH: str(history[-1].global_offset)},
                    created_at=now,
                    updated_at=now,
                )
            )
        finally:
            self._compacting.discard(session.id)

    async def _until_free(self, session_id: str) -> None:
        while session_id in self._running or session_id in self._backlog:
            task = self._tasks.get(session_id)
            if task is None:
                await asyncio.sleep(0.01)  # a turn is being archived; it starts next
            else:
                await asyncio.wait({task})

    async def stop(self, session_id: str) -> bool:
        """RPC `turn.stop`: cancel the running turn and every waiting one, on whichever
        replica they are; False if none."""
        stopped = await self.stop_here(session_id)
        if not stopped and self._link is not None:
            stopped = await self._link.stop_elsewhere(session_id)
        return stopped

    async def stop_here(self, session_id: str) -> bool:
        """`stop`, for what runs and waits in this process only."""
        waiting = self._backlog.pop(session_id, [])
        for queued in waiting:
            self._end_waiting(queued, TurnTrigger.CANCEL)
        return await self._stop(session_id, TurnTrigger.CANCEL) or bool(waiting)

    async def _check_media(self, message: UserMessage) -> None:
        """Refuse media the runtime could not read, before anything is stored."""
        for index, part in enumerate(message.parts):
            if part.media is None:
                continue
            if self._media is None:
                raise MediaNotEnabled()
            try:
                await self._media.check_part(
                    principal=message.principal, session_id=message.session_id, media=part.media
                )
            except InvalidMessage as exc:
                raise InvalidMessage(f"parts[{index}]: {exc.message}") from exc

    async def _session_for(self, message: UserMessage) -> Session:
        now = self._clock()
        session = await self.store.get_session(message.session_id)
        resumed = session is not None and not message.own_session
        if session is None:
            if self.reservations.foreign(message.session_id, message.principal):
                raise SessionExpired()
            session = await self.open_session(
                principal=message.principal,
                agent=message.agent,
                session_id=message.session_id,
                declare=message.declare,
                binding=message.binding,
            )
        if session.owner != message.principal or session.binding != message.binding:
            raise SessionExpired()
        expired = now - session.last_activity_at > self._context_ttl
        if expired and not message.own_session:
            raise SessionExpired()
        if resumed:
            await self._check_resume(session)
        return session

    async def _check_resume(self, session: Session) -> None:
        """A runtime that owns the context decides whether the session resumes
        (runtime-contract.md: `HasConversation`)."""
        agent = self._agents.get(session.agent)
        runtime = self._runtimes.get(session.agent)
        if agent is None or not agent.runtime_owns_context:
            return
        if not isinstance(runtime, ConversationKeeper):
            return
        verdict = await runtime.has_conversation(session.id)
        if verdict == "not_found":
            raise SessionExpired()
        if verdict == "unavailable":
            raise InternalError()

    async def open_session(
        self,
        *,
        principal: str,
        agent: str,
        session_id: str,
        declare: dict[str, Any] | None = None,
        client_session_id: str = "",
        binding: str = "",
    ) -> Session:
        """Create the session unless it exists; return what is stored under the id."""
        settings = self._agents.get(agent)
        if settings is None or agent not in self._runtimes:
            raise UnknownAgent(agent)
        if declare:
            check_declaration(declare, settings)
        now = self._clock()
        return await self.store.create_session(
            Session(
                id=session_id,
                owner=principal,
                agent=agent,
                created_at=now,
                updated_at=now,
                last_activity_at=now,
                root_session_id=session_id,
                client_session_id=client_session_id,
                binding=binding,
                declare=declare,
            )
        )

    async def _archive_user_message(
        self, session: Session, message: UserMessage, *, with_reply: bool
    ) -> tuple[Turn, TurnInput, OpenReply | None]:
        """`with_reply`: the turn starts as soon as this write is in. Then its start is
        in the same write too (`pending`, then `running`: two updates, one commit), not
        a write of the runner's after it, one batch of the archive writer later. Not
        with replicas: there the turn starts only once this replica holds the session."""
        turn, unsaved = self._new_turn(session, message)
        reply = _pending_reply(turn) if with_reply else None
        started = _started(turn) if with_reply and self._link is None else None
        stored = await self.store.begin_turn(
            turn, unsaved, reply=reply, unique_client_id=message.unique_client_id, started=started
        )
        turn_input = self._turn_input(session, message, stored, self._history_before)
        opened = None if reply is None else OpenReply(reply, _done_future())
        return started or turn, turn_input, opened

    def _new_turn(self, session: Session, message: UserMessage) -> tuple[Turn, Message]:
        """A pending turn and its user message, not archived yet."""
        now = self._clock()
        turn = Turn(
            id=new_id("turn"),
            session_id=session.id,
            state=TurnState.PENDING,
            created_at=now,
            replica=self.replica_id,
        )
        return turn, Message(
            id=new_id("msg"),
            session_id=session.id,
            turn_id=turn.id,
            client_id=message.client_id,
            role="user",
            content=message.content,
            content_type="text",
            parts=message.parts,
            metadata=message.metadata,
            created_at=now,
            updated_at=now,
            turn_offset=1,
        )

    def _turn_input(
        self, session: Session, message: UserMessage, stored: Message, reader: HistoryReader
    ) -> TurnInput:
        if message.metadata:  # what the client forwarded with the message, for its owner
            self.traces.record(
                session.id,
                session.owner,
                MESSAGE_METADATA,
                message_id=stored.id,
                metadata=message.metadata,
            )
        return TurnInput(
            session_id=session.id,
            turn_id=stored.turn_id,
            agent=session.agent,
            owner=session.owner,
            message=stored,
            history_reader=reader,
            directives=message.directives,
            declare=session.declare,
            media=self._media,
            client_tools=_with_agent_tools(self._agents.get(session.agent), message.client_tools),
            context=message.context,
            memory=AgentMemory(
                self.store,
                MemoryKey(
                    principal=session.owner,
                    agent=session.agent,
                    # /ws resolved it at the upgrade; other protocols name none.
                    facet=message.memory_facet or self.fixed_facet(session.agent) or NO_FACET,
                ),
                self._memory_limits,
                self._clock,
            ),
            tool_outcome=functools.partial(self.traces.tool_outcome, session.id, session.owner),
        )

    def _archive_behind(
        self, session: Session, message: UserMessage
    ) -> tuple[Turn, TurnInput, OpenReply]:
        """Archive the message and its turn without waiting: the runtime starts at once.

        Archive writes are queued in order, so the turn's own writes land after these;
        the runner waits for this write before the turn ends, and a history read waits
        for it too (the message's `global_offset` is known only then).
        """
        pending, unsaved = self._new_turn(session, message)
        # It starts now: archived as running at once, one write fewer per turn.
        turn = _started(pending)
        reply = _pending_reply(turn)
        archived = asyncio.ensure_future(self.store.begin_turn(turn, unsaved, reply=reply))

        async def history_before(before: Message) -> tuple[Message, ...]:
            return await self._history_before(await archived)

        turn_input = self._turn_input(session, message, unsaved, history_before)
        turn_input = msgspec.structs.replace(turn_input, archived=archived)
        return turn, turn_input, OpenReply(reply, archived)

    async def _history_before(self, before: Message) -> tuple[Message, ...]:
        """At most HISTORY_LIMIT messages before `before`, from the latest summary on."""
        earlier = before.global_offset - 1
        if not earlier:
            return ()
        start = max(0, earlier - HISTORY_LIMIT)
        found = await self.store.list_messages(
            before.session_id, after_offset=start, limit=earlier - start
        )
        return tuple(since_latest_summary(found))

    def _start_runner(
        self, session: Session, turn: Turn, turn_input: TurnInput, reply: OpenReply | None
    ) -> None:
        runner = TurnRunner(
            turn=turn,
            turn_input=turn_input,
            reply=None if reply is None else reply.message,
            reply_written=None if reply is None else reply.written,
            runtime=self._runtimes[session.agent],
            store=self.store,
            tools=self._tools,
            listeners=functools.partial(self._listeners_of, session.id, session.owner),
            tap=None
            if self._link is None
            else functools.partial(self._link.published, session.id, session.owner),
            clock=self._clock,
            telemetry=self._telemetry,
            traces=self.traces,
            end_retry=self._end_retry,
        )
        self._running[session.id] = runner
        task = detached(self._run_turn(session, runner), name=f"turn-{turn.id}")
        self._tasks[session.id] = task
        task.add_done_callback(lambda _: self._turn_done(session.id, runner))

    async def _run_turn(self, session: Session, runner: TurnRunner) -> Turn:
        try:
            turn = await runner.run()
        finally:
            # Free the session in the same step as the terminal event, so a client
            # that answers `done` at once is not told a turn is still in progress.
            self._turn_done(session.id, runner)
        agent = self._agents.get(session.agent)
        budget = agent.compact_after_tokens if agent is not None else None
        if budget is not None and turn.input_tokens > budget and not self._stopping:
            self.compact(session, "")  # automatic compaction: the history outgrew the budget
        return turn

    def _turn_done(self, session_id: str, runner: TurnRunner) -> None:
        if self._running.get(session_id) is runner:
            del self._running[session_id]
            self._tasks.pop(session_id, None)
            if self._link is not None and not self._backlog.get(session_id):
                self._link.release(session_id)  # else the backlog's turn keeps it
            self._start_waiting(session_id)

    def session_ended(self, session_id: str, agent: str) -> None:
        """The session ended (`/v1/session` `end`, RPC `session.close`): its runtime may
        free what it keeps for the conversation."""
        runtime = self._runtimes.get(agent)
        if isinstance(runtime, ConversationReleaser):
            runtime.release(session_id)

    async def cancel(self, session_id: str) -> bool:
        """Stop the session's running turn (a user's stop), on whichever replica it
        runs; False when none runs."""
        if await self._stop(session_id, TurnTrigger.CANCEL):
            return True
        return self._link is not None and await self._link.stop_elsewhere(session_id)

    async def _stop(self, session_id: str, trigger: TurnTrigger) -> bool:
        runner, task = self._running.get(session_id), self._tasks.get(session_id)
        if runner is None or task is None:
            return False
        runner.request_stop(trigger)
        await asyncio.gather(task, return_exceptions=True)
        return True

    async def wait_idle(self, within: float | None = None) -> bool:
        """Wait until no turn runs; True when that happened within `within` seconds."""
        tasks = list(self._tasks.values())
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=within)
        return not pending

    @property
    def running_turns(self) -> int:
        """Turns running here, and RPC messages accepted here whose turn is about to
        start (archived, or taking the session's turn lock): the drain waits for them
        too, or they would stay pending until this replica's next start ends them
        `interrupted`, unanswered."""
        return len(self._tasks.keys() | self._claiming | self._archiving.keys())

    async def wait_turn_end(self, within: float) -> None:
        """Until one of the running turns ends, or `within` seconds passed."""
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=within, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(within)

    async def interrupt_all(self) -> None:
        """Interrupt every running turn (each still archives what it had and sends its
        one terminal event); waiting RPC messages stay pending."""
        self._stopping = True
        await asyncio.gather(
            *(self._stop(session_id, TurnTrigger.INTERRUPT) for session_id in list(self._tasks))
        )

    async def shutdown(self) -> None:
        """Interrupt every running turn; each still archives what it had."""
        self._stopping = True
        if self._leasing is not None:
            # The archive closes after shutdown: no renewal or sweep may still be due.
            # The lease is left to expire; the turns end archived, so nothing is orphaned.
            self._leasing.cancel()
            await asyncio.gather(self._leasing, return_exceptions=True)
        await self.interrupt_all()
        await self._background.drain()
        if self._link is not None:
            await self._link.close()
        for runtime in self._runtimes.values():
            if isinstance(runtime, Closable):
                await runtime.close()


def _with_agent_tools(
    agent: AgentSettings | None, offered: tuple[ClientTool, ...]
) -> tuple[ClientTool, ...]:
    """The client tools the agent's config declares, then the client's own (`hello.tools`)."""
    declared = [
        ClientTool(name=tool.name, description=tool.description, parameters=tool.parameters)
        for tool in (agent.tools if agent is not None else ())
        if isinstance(tool, ClientToolSettings)
    ]
    if not declared:
        return offered
    names = {tool.name for tool in declared}
    return (*declared, *(tool for tool in offered if tool.name not in names))


# Listener tables hold tuples, replaced (never changed) on attach and detach: a turn
# iterates the tuple it read, so a listener may detach while events go out, and no
# event pays for a copy.
def _add_listener(table: dict[str, tuple[Listener, ...]], key: str, listener: Listener) -> None:
    listeners = table.get(key, ())
    if listener not in listeners:
        table[key] = (*listeners, listener)


def _deliver(listeners: tuple[Listener, ...], event: TurnEvent) -> None:
    for listener in listeners:
        try:
            listener(event)
        except Exception:
            log.exception("turn listener failed (relayed event)")


def _remove_listener(table: dict[str, tuple[Listener, ...]], key: str, listener: Listener) -> None:
    listeners = table.get(key, ())
    if listener in listeners:
        remaining = tuple(other for other in listeners if other != listener)
        if remaining:
            table[key] = remaining
        else:
            del table[key]


def _started(turn: Turn) -> Turn:
    """A pending turn, started when it was created."""
    return msgspec.structs.replace(
        turn, state=next_turn_state(turn.state, TurnTrigger.START), started_at=turn.created_at
    )


def _pending_reply(turn: Turn) -> Message:
    """The turn's reply before its first word: `pending`, empty, the turn's second message."""
    return Message(
        id=new_id("msg"),
        session_id=turn.session_id,
        turn_id=turn.id,
        role="assistant",
        content="",
        content_type="markdown",
        status="pending",
        created_at=turn.created_at,
        updated_at=turn.created_at,
        turn_offset=2,
    )


def _done_future() -> asyncio.Future[Any]:
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done
