"""The Store port. Every backend passes tests/contract/test_store_contract.py.

Every write also appends to its owner's update log (see `Update`), in the same
transaction, so the RPC protocol can push and replay changes. Which writes log
what:

| write                        | update items                                          |
|------------------------------|-------------------------------------------------------|
| create_session (new id only) | session created                                       |
| touch_session                | session updated                                       |
| update_session               | session updated                                       |
| append_message               | message created                                       |
| update_message               | message updated                                       |
| begin_turn                   | message created, turn created, session updated, and  |
|                              | message created for the reply when given (one update) |
| create_turn / save_turn      | turn created (new id) or turn updated                 |
| end_turn                     | message updated (or created), then turn updated      |
| save_tool_call               | rtc created (new id) or rtc updated                   |
| fork_session                 | session created, then message created per message     |
| interrupt_orphaned_turns     | turn updated per turn, message updated per reply left |
|                              | pending or streaming (one update per owner)           |
| renew_replica                | nothing (no owner's data changes)                     |

The owner of an update is the owner of the session its entities belong to.

Replicas: each turn names the replica running it (`Turn.replica`). A replica renews
its lease (`renew_replica`) while it lives; a turn whose replica let its lease expire
is orphaned, and any live replica interrupts it (`interrupt_orphaned_turns`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol, TypeVar

from portico.domain.memory import MemoryEntry, MemoryKey
from portico.domain.model import Message, Session, ToolCallRecord, Turn, Update, UpdateLog
from portico.domain.trace import TraceEvent
from portico.errors import StoreError
from portico.health import Health

log = logging.getLogger("portico.store")
UpdateListener = Callable[[Update], None]
T = TypeVar("T")

# An RPC action replies with the updates its own writes produced. They are gathered
# through the context rather than returned by every engine call, which would spread
# one protocol's concern over every caller; turn tasks start in a fresh context.
_collector: ContextVar[list[Update] | None] = ContextVar("portico_updates", default=None)


@contextmanager
def collecting_updates() -> Iterator[list[Update]]:
    """Gather the updates of every archive write awaited inside the block."""
    collected: list[Update] = []
    token = _collector.set(collected)
    try:
        yield collected
    finally:
        _collector.reset(token)


def detached(coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
    """A task in a fresh context: what it writes is not reported as the updates of
    the request that happened to start it (a turn, a background write)."""
    return asyncio.create_task(coro, name=name, context=contextvars.Context())


def current_collector() -> list[Update] | None:
    """The list a write made now should report its updates to, if any (read at enqueue)."""
    return _collector.get()


def publish(
    updates: Sequence[Update], collector: list[Update] | None, listener: UpdateListener | None
) -> None:
    """Report a write's committed updates: to the collector of the context that made the
    write (read when it was made), then to the listener, in order."""
    if collector is not None:
        collector.extend(updates)
    if listener is None:
        return
    for update in updates:
        try:
            listener(update)
        except Exception:
            # The update has committed; a broken listener must not fail the write.
            log.exception("update listener failed on update %s", update.id)


def as_store_error(exc: Exception) -> StoreError:
    """A failed write's exception as the StoreError its caller gets."""
    if isinstance(exc, StoreError):  # raised by the write itself, already explained
        return exc
    error = StoreError("archive write failed")
    error.__cause__ = exc
    return error


class Store(Protocol):
    async def open(self) -> None:
        """Connect, create or migrate the schema. Readiness waits on this."""

    async def close(self) -> None: ...

    async def health(self, within: float) -> Health:
        """Readiness: the archive answers a cheap query within `within` seconds."""
        ...

    def set_update_listener(self, listener: UpdateListener | None) -> None:
        """Call `listener` on the event loop with each update once it has committed,
        in offset order per owner."""

    # -- sessions -------------------------------------------------------------------

    async def create_session(self, session: Session) -> Session:
        """Insert unless the id exists; return what is stored under that id either way."""

    async def get_session(self, session_id: str) -> Session | None: ...

    async def list_sessions(
        self, owner: str, *, limit: int, cursor: str = "", include_deleted: bool = True
    ) -> list[Session]:
        """The owner's sessions, newest first by `created_at` (ties: greater id first).

        `cursor` is the id of the last session of the previous page: only sessions
        after it in that order are returned (an unknown cursor gives an empty page).
        """

    async def touch_session(self, session_id: str, now: float) -> None:
        """Record activity: sets `last_activity_at` and `updated_at`."""

    async def update_session(self, session: Session) -> Session:
        """Replace the stored session with this one (same id); `StoreError` when missing."""

    async def fork_session(self, session: Session, messages: Sequence[Message]) -> list[Message]:
        """Create `session` and append `messages` to it in order (offsets 1, 2, ...),
        all or nothing. Returns the stored messages."""

    # -- messages -------------------------------------------------------------------

    async def append_message(self, message: Message) -> Message:
        """Store a message, assigning the session's next `global_offset` (1, 2, ...).

        The session must exist; otherwise `StoreError`.
        """

    async def update_message(self, message: Message) -> Message:
        """Replace a stored message's content, parts, status, metadata and `updated_at`
        (same id; its offsets are kept). Returns the stored message; `StoreError` when
        missing."""

    async def get_message(self, message_id: str) -> Message | None: ...

    async def find_message_by_client_id(self, owner: str, client_id: str) -> Message | None:
        """The owner's message stored with this non-empty `client_id`, if any."""

    async def list_messages(
        self, session_id: str, *, after_offset: int = 0, limit: int | None = None
    ) -> list[Message]:
        """Messages with `global_offset` above `after_offset`, oldest first."""

    # -- turns ----------------------------------------------------------------------

    async def create_turn(self, turn: Turn) -> None: ...

    async def begin_turn(
        self,
        turn: Turn,
        message: Message,
        *,
        reply: Message | None = None,
        unique_client_id: bool = False,
        started: Turn | None = None,
    ) -> Message:
        """Atomically create `turn`, append its user `message` (and, when given, the
        turn's `reply` right after it) and touch the session.

        Returns the stored user message with its `global_offset`; the session must
        exist (otherwise `StoreError`, and nothing is written). With
        `unique_client_id`, a non-empty `client_id` the session's owner already used
        is `DuplicateClientId` (checked in the same transaction, so two racing
        writers cannot both pass).

        `started`: the same turn, started (`running`), saved in the same write after
        the rest, as an update of its own (the turn's `updated`, one offset later): a
        turn that starts at once is archived `pending` then `running` in one commit.
        """

    async def save_turn(self, turn: Turn) -> None:
        """Replace the stored turn with this one (same id)."""

    async def end_turn(self, turn: Turn, reply: Message | None) -> None:
        """Save the turn's last state and, when given, its reply (its content, parts,
        status, metadata and `updated_at` replace the stored reply's, or it is appended
        when none is stored), as one write: one update, the reply's item first."""

    async def get_turn(self, turn_id: str) -> Turn | None: ...

    async def list_turns(self, session_id: str) -> list[Turn]:
        """A session's turns, oldest first."""

    async def page_turns(self, session_id: str, *, limit: int, cursor: str = "") -> list[Turn]:
        """A session's turns newest first (ties: created later first), after `cursor`."""

    # -- tool calls -----------------------------------------------------------------

    async def save_tool_call(self, call: ToolCallRecord) -> None:
        """Insert or replace the stored call with this one (same id)."""

    async def get_tool_call(self, call_id: str) -> ToolCallRecord | None: ...

    async def list_tool_calls(self, session_id: str) -> list[ToolCallRecord]:
        """A session's tool calls, oldest first."""

    async def page_tool_calls(
        self, session_id: str, *, limit: int, cursor: str = ""
    ) -> list[ToolCallRecord]:
        """A session's tool calls newest first (ties: created later first), after `cursor`."""

    # -- replicas -------------------------------------------------------------------

    async def renew_replica(self, replica_id: str, now: float) -> None:
        """Record that the replica is alive at `now` (its lease runs from there)."""

    async def interrupt_orphaned_turns(
        self, now: float, *, replica_id: str, lease: float, include_own: bool = False
    ) -> int:
        """Mark the unfinished turns no live replica runs `interrupted`, and fail open
        replies (`pending` or `streaming`) whose turn is no longer unfinished, keeping
        their content. Returns the number of turns.

        Orphaned (`is_orphaned`): turns of another replica that has not renewed its
        lease for more than `lease` seconds before `now` (or never did), and, with
        `include_own`, `replica_id`'s own (at start-up, when it runs none yet). A store
        that only one process opens (SQLite, memory) forgets every lease on open: the
        turns it holds at start-up are orphans of a stopped server.
        """

    # -- agent memory (domain/memory.py; no update is logged) ---------------------------

    async def save_memory(self, entry: MemoryEntry, *, max_entries: int) -> bool:
        """Store `entry` under its key unless the key already holds `max_entries`
        entries: False then, and nothing is written."""

    async def search_memory(self, key: MemoryKey, query: str, *, limit: int) -> list[MemoryEntry]:
        """The key's entries whose content contains `query` (ASCII letters compared
        case-insensitively; empty: every entry), newest first (ties: greater id first)."""

    async def forget_memory(self, key: MemoryKey, memory_id: str) -> bool:
        """Delete the key's entry with this id; False when the key holds none."""

    # -- session traces (domain/trace.py; no update is logged) --------------------------

    async def append_trace(self, event: TraceEvent) -> None:
        """Append an event to its session's trace (the session need not be stored yet:
        a /ws client may acknowledge the disclosure before its first message)."""

    async def list_trace(self, session_id: str, owner: str, *, limit: int) -> list[TraceEvent]:
        """The session's events recorded for `owner`, in the order appended; at most
        `limit`, the oldest."""

    # -- the update log -------------------------------------------------------------

    async def update_log(self, owner: str) -> UpdateLog:
        """The epoch, the owner's last offset and the oldest retained offset."""

    async def list_updates(self, owner: str, *, after_offset: int, limit: int) -> list[Update]:
        """The owner's retained updates with an offset above `after_offset`, in order."""

    async def prune_updates(self, older_than: float) -> int:
        """Drop updates created before `older_than` (seconds since the epoch)."""


def is_orphaned(
    replica: str,
    last_seen: float | None,
    *,
    replica_id: str,
    lease: float,
    now: float,
    include_own: bool,
) -> bool:
    """Whether an unfinished turn run by `replica` (last seen at `last_seen`, None when
    it holds no lease) is left without a live replica, as `replica_id` judges at `now`."""
    if replica == replica_id:
        return include_own
    return last_seen is None or now - last_seen > lease


class Background:
    """Writes started without waiting for them: each is kept until it ends (so it is
    not collected mid-flight), runs detached from the request's updates, and a
    failure is logged rather than lost."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = detached(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", self._what, exc_info=task.exception())

    async def drain(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
