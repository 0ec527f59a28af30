"""The engine's link to the other replicas over the Bus port (docs/replicas.md).

- Output: every event of a turn running here is published, in emission order, to the
  session's topic and its owner's topic (one publisher task, so one order).
- Input: while listeners here want a session or an owner, a reader task follows its
  topic and hands the entries other replicas published to those listeners, in topic
  order, each once (`Relay`).
- Control: a stop or a client's tool reply for a turn running elsewhere is a request
  sent to that replica's inbox; it applies it and answers in the asker's inbox.
- One turn per session: `TurnLocks`; its holder is also who control goes to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from portico.bus.port import Bus
from portico.core.events import TurnEvent
from portico.core.periodic import every
from portico.core.replicalink import RemoteSink
from portico.core.tools import ClientReply, RtcStep
from portico.domain.model import ToolCallRecord, Update, new_id
from portico.domain.states import TurnState
from portico.errors import (
    BusUnavailable,
    Forbidden,
    InternalError,
    InvalidMessage,
    PorticoError,
    RtcInvalidTransition,
    TurnReplicaGone,
)
from portico.replication.codec import (
    Reply,
    Request,
    UpdateNotice,
    decode_control,
    decode_event,
    encode_control,
    encode_event,
)
from portico.replication.ordering import UpdateOrder
from portico.replication.relay import Relay, owner_topic, position_key, session_topic
from portico.store.base import Store

if TYPE_CHECKING:  # redis-py, which it imports, is an optional extra (`portico[redis]`)
    from portico.replication.turnlock import TurnLocks

log = logging.getLogger("portico.replication")
CONTROL_TIMEOUT = 5.0  # seconds a replica waits for another one's answer to control
OUTBOX_LIMIT = 100_000  # entries waiting for the bus, at most
RETRY = 1.0  # seconds before a bus read that failed starts again
PUBLISH_BATCH = 512  # entries per round trip to the bus, at most
FLUSH_TIMEOUT = 2.0  # seconds a stopping replica gives its last events to go out
# Seconds a stopping replica waits for its readers and loops to end once cancelled.
STOP_TIMEOUT = 2.0
_UNFINISHED = (TurnState.PENDING, TurnState.RUNNING)
# Errors a replica answers control with, raised again on the asking one as they were.
_REMOTE_ERRORS: dict[str, Callable[[str], PorticoError]] = {
    error.code: error
    for error in (InvalidMessage, TurnReplicaGone, RtcInvalidTransition, Forbidden)
}


class ToolSettler(Protocol):
    async def settle_here(self, principal: str, call_id: str, reply: ClientReply) -> None: ...

    async def rtc_here(self, record: ToolCallRecord, step: RtcStep) -> ToolCallRecord: ...


class CallReleaser(Protocol):
    async def release_here(self, session_id: str, token: str) -> bool: ...


class BusLink:
    def __init__(
        self,
        bus: Bus,
        locks: TurnLocks,
        store: Store,
        *,
        replica_id: str,
        lease: float,
        control_timeout: float = CONTROL_TIMEOUT,
    ) -> None:
        self._bus = bus
        self._locks = locks
        self._store = store
        self.replica_id = replica_id
        self._lease = lease
        self._control_timeout = control_timeout
        self._relay = Relay(replica_id)
        self._sink: RemoteSink | None = None
        self._tools: ToolSettler | None = None
        self._calls: CallReleaser | None = None
        self._updates: Callable[[Update], None] = _no_updates
        self._order = UpdateOrder()
        self._filling: set[str] = set()  # owners whose archive read runs
        self._readers: dict[str, asyncio.Task[None]] = {}
        # Set once a topic's reader knows where it starts (`recent_session_events`).
        self._reading: dict[str, asyncio.Event] = {}
        self._outbox: deque[tuple[str, bytes]] = deque()
        # Turn locks to free (session, value), before the next events go out.
        self._releases: list[tuple[str, str]] = []
        self._queued = asyncio.Event()
        self._idle = asyncio.Event()  # set while nothing waits to be published
        self._idle.set()
        # Entries ever queued, and ever taken from the outbox (published, failed or
        # dropped): a reader of a topic waits for what was queued before it asked, not
        # for an outbox that a busy replica may never empty (`_out_past`).
        self._queued_total = 0
        self._taken_total = 0
        self._taken = asyncio.Event()
        self._asked: dict[str, asyncio.Future[Reply]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False

    def bind(self, sink: RemoteSink) -> None:
        self._sink = sink

    def bind_tools(self, tools: ToolSettler) -> None:
        self._tools = tools

    def bind_calls(self, calls: CallReleaser) -> None:
        """The `/ws` voice calls of this replica, which another one may take over."""
        self._calls = calls

    def bind_updates(self, deliver: Callable[[Update], None]) -> None:
        """Where an owner's updates go on this replica (its RPC connections), in order."""
        self._updates = deliver

    async def start(self) -> None:
        self._started = True
        self._spawn(self._publish_loop(), "bus-publisher")
        self._spawn(self._inbox_loop(), "bus-inbox")
        self._spawn(
            every(self._lease / 3, "turn lock renewal", self._renew, at_once=False), "turn-locks"
        )
        for topic in self._relay.topics():  # watched before the start
            self._start_reader(topic)

    async def close(self) -> None:
        # The turns ended before this (engine shutdown): their last events and lock
        # releases go out first, within a bound, so other replicas' clients get their
        # terminal frame and the sessions are free at once.
        await self._flush(FLUSH_TIMEOUT)
        tasks = [*self._tasks, *self._readers.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: a reader cancelled inside a redis-py read can miss it and read on
            # (seen with redis-py 8.2 on Python 3.11: a stream reader cancelled right
            # after its start waited in its next XREAD past the socket timeout), and a
            # stopping replica must not hang on it. What is left ends with the process.
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT)
        self._readers.clear()
        # The bus is closed by its owner (server/backends.py), after the engine's stop.

    async def _flush(self, within: float) -> None:
        """Until the publisher sent what is queued, lock releases included."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), within)

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- output ---------------------------------------------------------------------------

    def published(self, session_id: str, owner: str, event: TurnEvent) -> None:
        payload = encode_event(self.replica_id, event)
        self._queue(session_topic(session_id), payload)
        self._queue(owner_topic(owner), payload)

    def _queue(self, topic: str, payload: bytes) -> None:
        if len(self._outbox) >= OUTBOX_LIMIT:
            # A bus too slow or away: the oldest go first, memory stays bounded.
            self._outbox.popleft()
            self._taken_total += 1
        self._outbox.append((topic, payload))
        self._queued_total += 1
        self._idle.clear()
        self._queued.set()

    async def _publish_loop(self) -> None:
        failing = 0
        while True:
            await self._queued.wait()
            self._queued.clear()
            while self._outbox or self._releases:
                # Locks first: the events queued before a release include its turn's end.
                await self._release_pending()
                if not self._outbox:
                    continue
                # Whatever queued meanwhile goes in one round trip, in order.
                count = min(len(self._outbox), PUBLISH_BATCH)
                batch = [self._outbox.popleft() for _ in range(count)]
                try:
                    await self._bus.publish_batch(batch)
                except Exception:
                    # The local listeners had the events; the other replicas' miss them.
                    if not failing:
                        log.warning("bus publish failed; not relayed until the bus is back")
                    failing += len(batch)
                    continue
                finally:
                    self._taken_total += count
                    self._taken.set()
                    self._taken = asyncio.Event()
                if failing:
                    log.warning("bus publish back; %d entries were not relayed", failing)
                    failing = 0
            self._idle.set()

    async def _out_past(self, mark: int) -> None:
        """Until the first `mark` entries ever queued have left the outbox."""
        while self._taken_total < mark:
            await self._taken.wait()

    # -- input ----------------------------------------------------------------------------

    def watch_session(self, session_id: str) -> None:
        self._watch(session_topic(session_id))

    def unwatch_session(self, session_id: str) -> None:
        self._unwatch(session_topic(session_id))

    def watch_owner(self, owner: str) -> None:
        if self._relay.watch(owner_topic(owner)):
            self._spawn(self._begin_owner(owner), f"updates-begin-{owner}")
            if self._started:
                self._start_reader(owner_topic(owner))

    def unwatch_owner(self, owner: str) -> None:
        self._unwatch(owner_topic(owner))
        if not self._relay.watched(owner_topic(owner)):
            self._order.end(owner)

    async def _begin_owner(self, owner: str) -> None:
        try:
            head = (await self._store.update_log(owner)).last_offset
        except Exception:
            log.warning("update log head unreadable owner=%s; relaying from the next", owner)
            head = 0
        if self._relay.watched(owner_topic(owner)):
            self._deliver_updates(self._order.begin(owner, head))
            self._fill(owner)

    # -- an owner's updates ---------------------------------------------------------------

    def local_update(self, update: Update) -> None:
        """The archive listener: an update this replica committed."""
        self._queue(owner_topic(update.owner), encode_event(self.replica_id, _notice(update)))
        if self._order.begun(update.owner) or self._relay.watched(owner_topic(update.owner)):
            self._deliver_updates(self._order.offer(update))
            self._fill(update.owner)
        else:
            self._updates(update)  # nobody here orders this owner's updates

    def _on_notice(self, notice: UpdateNotice) -> None:
        self._order.announce(notice.owner, notice.offset)
        self._fill(notice.owner)

    def _fill(self, owner: str) -> None:
        if self._order.missing(owner) is not None and owner not in self._filling:
            self._filling.add(owner)
            self._spawn(self._read_missing(owner), f"updates-fill-{owner}")

    async def _read_missing(self, owner: str) -> None:
        try:
            while (wanted := self._order.missing(owner)) is not None:
                after, limit = wanted
                found = await self._store.list_updates(owner, after_offset=after, limit=limit)
                if not found or found[0].offset > after + 1:
                    # Pruned (or the owner's log was reset): go on from what there is.
                    resume = found[0].offset if found else after + limit + 1
                    self._deliver_updates(self._order.skip_to(owner, resume))
                for update in found:
                    self._deliver_updates(self._order.offer(update))
        except Exception:
            log.warning("reading relayed updates failed owner=%s", owner)
        finally:
            self._filling.discard(owner)

    def _deliver_updates(self, ready: list[Update]) -> None:
        for update in ready:
            self._updates(update)

    def _watch(self, topic: str) -> None:
        if self._relay.watch(topic) and self._started:
            self._start_reader(topic)

    def _unwatch(self, topic: str) -> None:
        if self._relay.unwatch(topic):
            self._reading.pop(topic, None)
            reader = self._readers.pop(topic, None)
            if reader is not None:
                reader.cancel()

    def _start_reader(self, topic: str) -> None:
        if topic not in self._readers:
            self._reading.setdefault(topic, asyncio.Event())
            task = asyncio.create_task(self._read(topic), name=f"bus-read-{topic}")
            self._readers[topic] = task

    async def _read(self, topic: str) -> None:
        while True:
            try:
                after = self._relay.last_position(topic)
                if not after:
                    self._relay.start(topic, await self._bus.last_position(topic))
                    after = self._relay.last_position(topic)
                reading = self._reading.get(topic)
                if reading is not None:
                    reading.set()
                await self._read_from(topic, after)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("bus read failed topic=%s; again in %.0f s", topic, RETRY)
            await asyncio.sleep(RETRY)

    async def _read_from(self, topic: str, after: str) -> None:
        deliver = self._deliverer(topic)
        async for entry in self._bus.subscribe(topic, after):
            try:
                published = decode_event(entry.payload)
            except Exception:
                log.warning("undecodable bus entry topic=%s position=%s", topic, entry.position)
                continue
            if not self._relay.accept(topic, entry.position, published.origin):
                continue
            if isinstance(published.event, UpdateNotice):
                self._on_notice(published.event)
            else:
                deliver(published.event)

    def _deliverer(self, topic: str) -> Callable[[TurnEvent], None]:
        assert self._sink is not None, "bind() the engine first"
        sink = self._sink
        kind, _, key = topic.removeprefix("turns:").partition(":")
        if kind == "session":
            return lambda event: sink.deliver_to_session(key, event)
        return lambda event: sink.deliver_to_owner(key, event)

    async def session_position(self, session_id: str) -> str:
        """The position of the session topic's newest entry (`recent_session_events`).
        Raises `BusUnavailable` when the bus does not answer."""
        try:
            async with asyncio.timeout(self._control_timeout):
                return await self._bus.last_position(session_topic(session_id))
        except Exception as exc:
            raise BusUnavailable() from exc

    async def recent_session_events(
        self, session_id: str, count: int, after: str = ""
    ) -> list[TurnEvent]:
        """The session topic's newest `count` turn events (published after position
        `after`, when given), newest first, whichever replica published them. Read once
        this replica's reader of the topic knows its start and what this replica emitted
        is on the bus: with the events its listeners get from then on, nothing between
        is missed (a takeover replays them, server/session_replay.py). The caller bounds
        the wait: the bus may be away."""
        topic = session_topic(session_id)
        reading = self._reading.get(topic)
        if reading is not None:
            await reading.wait()
        await self._out_past(self._queued_total)
        floor = position_key(after) if after else None
        events: list[TurnEvent] = []
        for entry in await self._bus.recent(topic, count):
            if floor is not None and position_key(entry.position) <= floor:
                break
            try:
                published = decode_event(entry.payload)
            except Exception:
                continue  # logged by the topic's reader
            if not isinstance(published.event, UpdateNotice):
                events.append(published.event)
        return events

    # -- one turn per session -------------------------------------------------------------

    async def claim(self, session_id: str) -> bool:
        return await self._locks.acquire(session_id)

    def holds(self, session_id: str) -> bool:
        return self._locks.holds(session_id)

    async def runs_elsewhere(self, session_id: str) -> bool:
        holder = await self._locks.holder(session_id)
        return holder is not None and holder.replica != self.replica_id

    def release(self, session_id: str) -> None:
        """Free the session's lock before the events queued so far are published: the
        turn's terminal event is queued already, and a client that reads it on another
        replica and sends its next message at once must find the session free there
        (as on one process), not `TURN_IN_PROGRESS`."""
        value = self._locks.forget(session_id)
        if value is not None:
            self._releases.append((session_id, value))
            self._idle.clear()
            self._queued.set()

    async def _release_pending(self) -> None:
        releases, self._releases = self._releases, []
        for session_id, value in releases:
            try:
                await self._locks.release_value(session_id, value)
            except Exception:
                # It lapses by itself within the lease.
                log.warning("turn lock release failed session=%s", session_id)

    async def _renew(self) -> None:
        for session_id in await self._locks.renew_all():
            log.warning("turn lock of session=%s was taken by another replica", session_id)

    # -- control --------------------------------------------------------------------------

    async def stop_elsewhere(self, session_id: str) -> bool:
        holder = await self._locks.holder(session_id)
        if holder is None or holder.replica == self.replica_id:
            return False
        reply = await self._ask(holder.replica, op="stop", session_id=session_id)
        return reply.value

    async def forward_reply(self, principal: str, call_id: str, reply: ClientReply) -> None:
        """A client's tool reply for a call this replica does not hold: to the turn's."""
        record = await self._store.get_tool_call(call_id)
        unknown = InvalidMessage(f"no pending tool call {call_id!r}")
        if record is None:
            raise unknown
        holder = await self._locks.holder(record.session_id)
        if holder is None or holder.replica == self.replica_id:
            turn = await self._store.get_turn(record.turn_id)
            if turn is not None and turn.state in _UNFINISHED and turn.replica != self.replica_id:
                raise TurnReplicaGone()
            raise unknown
        await self._ask(
            holder.replica, op="tool", principal=principal, call_id=call_id, reply=reply
        )

    async def forward_rtc(self, record: ToolCallRecord, step: RtcStep) -> ToolCallRecord | None:
        holder = await self._locks.holder(record.session_id)
        if holder is None or holder.replica == self.replica_id:
            return None  # no live replica runs its turn: the archive alone ends it
        await self._ask(holder.replica, op="rtc", call_id=record.id, rtc=step)
        # Written there before the answer came.
        return await self._store.get_tool_call(record.id) or record

    async def release_call(self, replica: str, session_id: str, token: str) -> bool:
        """A `?resume` here took over the call `replica` runs: it lets go of it."""
        reply = await self._ask(replica, op="call", session_id=session_id, call_id=token)
        return reply.value

    async def _ask(self, replica: str, **fields: Any) -> Reply:
        request = Request(id=new_id("ctl"), reply_to=self.replica_id, **fields)
        answer: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._asked[request.id] = answer
        try:
            try:
                await asyncio.wait_for(
                    self._bus.send(replica, encode_control(request)), self._control_timeout
                )
            except Exception as exc:
                raise BusUnavailable() from exc
            try:
                reply = await asyncio.wait_for(answer, self._control_timeout)
            except TimeoutError:
                raise TurnReplicaGone() from None
        finally:
            self._asked.pop(request.id, None)
        if reply.error_code:
            raise _REMOTE_ERRORS.get(reply.error_code, _internal)(reply.error_message)
        return reply

    async def _inbox_loop(self) -> None:
        while True:
            try:
                await self._read_inbox()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("control inbox read failed; again in %.0f s", RETRY)
            await asyncio.sleep(RETRY)

    async def _read_inbox(self) -> None:
        async for payload in self._bus.inbox(self.replica_id):
            try:
                message = decode_control(payload)
            except Exception:
                log.warning("undecodable control message")
                continue
            if isinstance(message, Reply):
                answer = self._asked.get(message.id)
                if answer is not None and not answer.done():
                    answer.set_result(message)
            else:
                self._spawn(self._apply(message), f"control-{message.op}")

    async def _apply(self, request: Request) -> None:
        try:
            value = await self._apply_here(request)
            reply = Reply(id=request.id, value=value)
        except PorticoError as exc:
            reply = Reply(id=request.id, error_code=exc.code, error_message=exc.message)
        except Exception:
            log.exception("control request failed op=%s", request.op)
            reply = Reply(id=request.id, error_code=InternalError.code, error_message="internal")
        with contextlib.suppress(Exception):
            await self._bus.send(request.reply_to, encode_control(reply))

    async def _apply_here(self, request: Request) -> bool:
        assert self._sink is not None, "bind() the engine first"
        assert self._tools is not None, "bind_tools() first"
        if request.op == "stop":
            return await self._sink.stop_here(request.session_id)
        if request.op == "call":
            return self._calls is not None and await self._calls.release_here(
                request.session_id, request.call_id
            )
        if request.op == "rtc":
            assert request.rtc is not None
            record = await self._store.get_tool_call(request.call_id)
            if record is None:
                raise InvalidMessage(f"no tool call {request.call_id!r}")
            await self._tools.rtc_here(record, request.rtc)
            return True
        assert request.reply is not None
        await self._tools.settle_here(request.principal, request.call_id, request.reply)
        return True


def _notice(update: Update) -> UpdateNotice:
    return UpdateNotice(update.owner, update.offset)


def _no_updates(update: Update) -> None:
    pass


def _internal(message: str) -> PorticoError:
    return InternalError(message)
