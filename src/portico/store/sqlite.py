"""SQLite archive, the embedded default.

One writing connection, owned by one thread of the server, or with
`sqlite_writer: inline` used on the event loop's own thread (`InlineWriter`), or with
`sqlite_writer: process` owned by a writer process (store/sqlite_process.py; each
write is a `Write` struct, so it can cross as data). Writes are grouped: every write queued
while the previous batch was committing goes into the next single transaction
(group commit), so hundreds of concurrent turns cost a handful of fsyncs, not
one each. Each write runs inside its own SAVEPOINT, so one failing write fails
alone. We use sqlite3 on a dedicated thread rather than aiosqlite because a
batch must run many statements in one thread hop; aiosqlite hops per statement.

Each write appends its updates to the owner's log inside its own savepoint, so
a write that rolls back leaves no update and takes no offset. The updates are
handed to the caller's collector and to the listener only after the commit.

The writes, their batches and the schema are in store/sqlite_writes.py, which every
writer runs; this module is the store: its queue, its readers and where batches run.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import os
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from msgspec.structs import astuple

from portico.domain.memory import MemoryEntry, MemoryKey
from portico.domain.model import Message, Session, ToolCallRecord, Turn, Update, UpdateLog
from portico.domain.trace import TraceEvent
from portico.errors import StoreError
from portico.health import IN_PROCESS, Health
from portico.store import rows, sql
from portico.store.base import UpdateListener, current_collector, publish
from portico.store.sqlite_process import ProcessWriter
from portico.store.sqlite_writes import (
    LAST_OFFSET_OF,
    SQL,
    WRITER_BUSY_TIMEOUT_MS,
    AppendMessage,
    AppendTrace,
    Archive,
    BeginTurn,
    CreateSession,
    CreateTurn,
    EndTurn,
    ForgetMemory,
    ForkSession,
    InterruptOrphanedTurns,
    Outcome,
    PruneUpdates,
    RenewReplica,
    SaveMemory,
    SaveToolCall,
    SaveTurn,
    TouchSession,
    UpdateMessage,
    UpdateSession,
    Write,
    checkpoint,
    commit_batch,
    connect_writer,
    message_from_row,
    restart_wal,
    row_dict,
    session_from_row,
)

if TYPE_CHECKING:  # a type only: config loads its schema's validator (jsonschema)
    from portico.config import SqliteWriter

log = logging.getLogger("portico.store")

T = TypeVar("T")

_UPDATE_LOG = (
    f"SELECT {LAST_OFFSET_OF.format('?1')}, (SELECT MIN(log_offset) FROM updates WHERE owner = ?1)"
)


def _turn_from_row(row: sqlite3.Row) -> Turn:
    return rows.turn_from_data(row_dict(row))


def _tool_call_from_row(row: sqlite3.Row) -> ToolCallRecord:
    return rows.tool_call_from_data(row_dict(row))


Pending = tuple[Write, asyncio.Future[Any], list[Update] | None]


SESSION_CACHE_SIZE = 10_000  # sessions kept in memory (most recently used)
CHECKPOINT_INTERVAL = 1.0  # seconds between WAL checkpoints
# WAL frames (one page, 4 KiB, each) past which a checkpoint also restarts the WAL.
WAL_RESTART_FRAMES = 4096
# Bytes a restarted WAL file is cut back to (it is reused from its start, not grown).
WAL_SIZE_LIMIT = 64 * 1024 * 1024
# Reads of a file archive that may run at once, each on a connection and thread of its
# own (`Readers`, opened as reads overlap): two long reads (a big session's page, seconds)
# still leave the others a thread. Not more: reads build their rows in Python, so more
# threads add no throughput, only contenders for the event loop's GIL (docs/performance.md).
READERS = 4


def _lock_archive(path: str) -> IO[bytes]:
    """Hold `<archive>.lock` for as long as the store is open.

    The store assumes it is the archive's one writer (it caches sessions and numbers
    messages itself): a second server on the same data dir is refused, not let in.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    lock = open(f"{path}.lock", "wb")  # noqa: SIM115 - held open until close()
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        raise StoreError(f"the archive at {path} is in use by another Portico process") from None
    return lock


class _SessionCache:
    """Sessions as last committed, so a message does not cost a read of its session.

    One process owns the archive file, and every write that changes a session logs
    the stored session in its update: the cache learns from the committed updates.
    A read that raced a session write (the generation moved) is not cached.
    """

    def __init__(self, size: int) -> None:
        self._size = size
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.generation = 0

    def get(self, session_id: str) -> Session | None:
        session = self._sessions.get(session_id)
        if session is not None:
            self._sessions.move_to_end(session_id)
        return session

    def learn(self, updates: list[Update]) -> None:
        for update in updates:
            for entity in update.data_list:
                if isinstance(entity, Session):
                    self.generation += 1
                    self._put(entity)

    def offer(self, session: Session, generation: int) -> None:
        if generation == self.generation:
            self._put(session)

    def _put(self, session: Session) -> None:
        self._sessions[session.id] = session
        self._sessions.move_to_end(session.id)
        if len(self._sessions) > self._size:
            self._sessions.popitem(last=False)


DEFAULT_WRITER: SqliteWriter = "auto"
# Seconds between a writer process's death and the start of the next one (and between
# two failed starts): writes fail at once meanwhile, none waits for it.
RESPAWN_DELAY = 1.0


def writer_for(kind: SqliteWriter) -> Literal["inline", "process", "thread"]:
    """Where writes run. `auto`: a process of its own when this server may run on two
    CPUs or more, where the writer's Python (rows, updates, statements) then runs
    beside the event loop instead of taking its GIL (stream throughput +20 % on a quiet
    2-core machine, docs/performance.md); on one CPU the thread, where a process would
    only add a pipe's round trip to every batch."""
    if kind != "auto":
        return kind
    return "process" if usable_cpus() >= 2 else "thread"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def connect_reader(path: str) -> Archive:
    """A read-only connection: a reader beside the owner, or the owner's own reads
    while its writer is a process (WAL lets readers run beside the writer)."""
    uri = f"{Path(path).absolute().as_uri()}?mode=ro"
    conn = sqlite3.connect(
        uri, uri=True, isolation_level=None, check_same_thread=False, factory=Archive
    )
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout={WRITER_BUSY_TIMEOUT_MS}")
    return conn


class Readers:
    """Where the store's reads run: read-only connections of their own, one per thread
    of a small pool, opened on a thread's first read (WAL lets them read beside the one
    writer and beside each other). Every writer reads this way, so a long read (a page
    of a big session) holds neither the writes, whose `done` waits for a COMMIT, nor
    more than one reading thread. Each read statement takes a fresh snapshot: it sees
    every commit acknowledged before it started, so a caller reads its own writes.

    An in-memory archive cannot be shared with a second connection: its reads run on
    the writing connection and thread, between batches (`shared`).
    """

    def __init__(
        self, executor: ThreadPoolExecutor, connect: Callable[[], Archive], *, owned: bool
    ) -> None:
        self._executor = executor
        self._connect = connect
        self._owned = owned  # the pool's own threads and connections, closed with it
        self._local = threading.local()
        self._opened: list[Archive] = []

    @classmethod
    def pool(cls, path: str, size: int) -> Readers:
        executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="portico-read")
        return cls(executor, functools.partial(connect_reader, path), owned=True)

    @classmethod
    def shared(cls, conn: Archive, executor: ThreadPoolExecutor) -> Readers:
        return cls(executor, lambda: conn, owned=False)

    def _connection(self) -> Archive:
        """The calling thread's connection: a connection is used by one thread only."""
        conn: Archive | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
            self._opened.append(conn)
        return conn

    async def run(self, fn: Callable[[Archive], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: fn(self._connection())
        )

    async def close(self) -> None:
        """Once the reads running have ended (a cancelled read runs to its end)."""
        if self._owned:
            await asyncio.to_thread(self._executor.shutdown)
            for conn in self._opened:
                conn.close()
        self._opened.clear()


class BatchWriter(Protocol):
    """Where the store's batches run: its own thread, or a writer process."""

    @property
    def pid(self) -> int | None:
        """The writer process's id; None for the thread."""

    async def run_batch(self, writes: list[Write]) -> list[Outcome]:
        """Each write's outcome, in order; raises StoreError when it cannot run any."""

    async def restart_wal(self) -> None:
        """Restart the WAL from the writing connection, between two batches."""

    async def close(self) -> None: ...

    def health(self) -> Health: ...


class ThreadWriter:
    """Batches on a thread of the store's, on the writing connection (reads run beside
    it, on connections of their own: `Readers`)."""

    def __init__(self, conn: Archive, executor: ThreadPoolExecutor, read_only: bool) -> None:
        self._conn = conn
        self._executor = executor
        self._read_only = read_only

    @property
    def pid(self) -> int | None:
        return None

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def run_batch(self, writes: list[Write]) -> list[Outcome]:
        return await self._in_thread(functools.partial(commit_batch, self._conn, writes))

    async def restart_wal(self) -> None:
        await self._in_thread(functools.partial(restart_wal, self._conn))

    async def close(self) -> None:
        if not self._read_only:
            # The owner, closing, checkpoints the WAL into the database file.
            await self._in_thread(functools.partial(checkpoint, self._conn, "TRUNCATE"))
        await self._in_thread(self._conn.close)

    def health(self) -> Health:
        return IN_PROCESS


class InlineWriter(ThreadWriter):
    """Batches on the event loop's own thread, on a writing connection of their own.

    A batch of the usual writes is a few statements and a COMMIT without fsync (WAL,
    `synchronous=NORMAL`): tens of microseconds, less than the hand-off to a thread
    and back (the submit, the thread's wake-up, its wait for the GIL while the loop
    runs Python, `call_soon_threadsafe` home). Group commit is unchanged: the store's
    committer runs once per loop pass, so every write queued before it shares its
    transaction. What may take long stays off the loop, on the store's thread with
    this connection: the WAL restart and the TRUNCATE at close (a checkpoint copies
    pages and syncs), and any batch holding a write whose time grows with the archive
    (`Write.OFF_LOOP`). They run on a thread of the writer's own, and no batch runs on
    the loop meanwhile (`_on_thread`). Reads run on the store's `Readers`.
    """

    def __init__(self, conn: Archive) -> None:
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portico-writer")
        super().__init__(conn, executor, read_only=False)
        self._on_thread = asyncio.Lock()

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        async with self._on_thread:
            return await super()._in_thread(fn)

    async def run_batch(self, writes: list[Write]) -> list[Outcome]:
        if any(write.OFF_LOOP for write in writes):
            return await super().run_batch(writes)
        # Uncontended, the lock is taken without a yield: the batch runs now.
        async with self._on_thread:
            return commit_batch(self._conn, writes)

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=True)


class SqliteStore:
    def __init__(
        self,
        path: str | Path,
        *,
        checkpoint_interval: float = CHECKPOINT_INTERVAL,
        wal_restart_frames: int = WAL_RESTART_FRAMES,
        wal_size_limit: int = WAL_SIZE_LIMIT,
        read_only: bool = False,
        writer: SqliteWriter = DEFAULT_WRITER,
        readers: int = READERS,
        respawn_delay: float = RESPAWN_DELAY,
    ) -> None:
        """`read_only`: a reader beside the server that owns the archive (it takes no
        lock, runs no migration or checkpoint; writes fail). `writer`: where writes run,
        the store's thread, the event loop's thread or a process of their own (an
        in-memory archive and a reader always use the store's thread: neither can be
        shared with a second connection). `readers`: how many reads may run at once,
        each on a connection and thread of its own (`Readers`). `respawn_delay`: seconds
        before a writer process that died is started again."""
        self._path = str(path)
        self._read_only = read_only
        self._wal_size_limit = wal_size_limit
        self._checkpoint_interval = checkpoint_interval
        self._wal_restart_frames = wal_restart_frames
        in_file = self._path != ":memory:" and not read_only
        self._writer_kind = writer_for(writer) if in_file else "thread"
        self._respawn_delay = respawn_delay
        self._readers_size = readers
        # Opens the archive; with the thread writer, runs its batches.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portico-sqlite")
        self._readers: Readers | None = None
        self._writer: BatchWriter | None = None
        self._epoch = ""
        self._pending: list[Pending] = []
        self._committer: asyncio.Task[None] | None = None
        self._listener: UpdateListener | None = None
        self._sessions = _SessionCache(SESSION_CACHE_SIZE)
        self._checkpointer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portico-wal")
        self._checkpoints: asyncio.Task[None] | None = None
        self._supervisor: asyncio.Task[None] | None = None  # the writer process's
        self._lock: IO[bytes] | None = None

    # -- plumbing ---------------------------------------------------------------

    def _connect(self) -> Archive:
        if self._read_only:
            return connect_reader(self._path)
        return connect_writer(self._path, self._wal_size_limit)

    def _checkpoint_connection(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout=1000")
        return conn

    async def _checkpoint_periodically(self) -> None:
        loop = asyncio.get_running_loop()
        conn = await loop.run_in_executor(self._checkpointer, self._checkpoint_connection)
        try:
            while True:
                await asyncio.sleep(self._checkpoint_interval)
                try:
                    await self._checkpoint_once(conn)
                except (sqlite3.Error, StoreError):
                    log.exception("archive checkpoint failed; tried again in a moment")
        finally:
            await loop.run_in_executor(self._checkpointer, conn.close)

    async def _checkpoint_once(self, conn: sqlite3.Connection) -> None:
        """PASSIVE copies what it can without waiting for (or blocking) the writer. But
        a writer that never pauses never lets it restart the WAL, which then grows
        without end (GBs under load, every page lookup slower): once the WAL is long,
        the writing connection runs a RESTART between two batches (no other writer,
        no reader to wait for), copies the few frames PASSIVE left, and the next write
        starts the WAL from its beginning."""
        loop = asyncio.get_running_loop()
        frames = await loop.run_in_executor(self._checkpointer, checkpoint, conn, "PASSIVE")
        if frames > self._wal_restart_frames:
            # The RESTART holds the writer while it fsyncs the frames written since the
            # last PASSIVE: up to an interval of them (10-20 ms on a slow disk, and every
            # `done` waits). A second PASSIVE first copies and syncs what came in during
            # the first one's fsync, beside the writer, so the RESTART syncs only the
            # frames of the last few milliseconds (docs/performance.md, "The WAL's fsyncs").
            await loop.run_in_executor(self._checkpointer, checkpoint, conn, "PASSIVE")
            await self._batch_writer().restart_wal()

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _read(self, fn: Callable[[Archive], T]) -> T:
        if self._readers is None:
            raise StoreError("the archive is not open")
        try:
            return await self._readers.run(fn)
        except sqlite3.Error as exc:
            raise StoreError("archive read failed") from exc

    async def _write(self, write: Write) -> Any:
        """`write`'s result once its batch committed (and its updates were published).
        Typed by the caller: the store's methods name what each write returns."""
        self._batch_writer()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # The collector is read here, in the caller's context: the committer task
        # runs in a context of its own.
        self._pending.append((write, future, current_collector()))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.create_task(self._commit_pending())
        return await future

    def _batch_writer(self) -> BatchWriter:
        if self._writer is None:
            raise StoreError("the archive is not open")
        return self._writer

    async def _commit_pending(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            writes = [write for write, _, _ in batch]
            try:
                outcomes = await self._batch_writer().run_batch(writes)
            except StoreError as exc:
                outcomes = [(exc, [])] * len(batch)
            for (_, future, collector), (outcome, updates) in zip(batch, outcomes, strict=True):
                if updates:
                    # Before the future resolves: the caller reads its collector
                    # as soon as the write it awaited returns.
                    self._publish(updates, collector)
                if future.done():
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    def _publish(self, updates: list[Update], collector: list[Update] | None) -> None:
        self._sessions.learn(updates)
        publish(updates, collector, self._listener)

    def set_update_listener(self, listener: UpdateListener | None) -> None:
        self._listener = listener

    # -- lifecycle --------------------------------------------------------------

    async def open(self) -> None:
        if self._path != ":memory:" and not self._read_only:
            self._lock = _lock_archive(self._path)
        try:
            self._writer, self._readers = await self._start_writer()
            # The first read, which opens the first reading connection.
            self._epoch = await self._read(
                lambda conn: str(conn.execute("SELECT epoch FROM meta").fetchone()[0])
            )
        except (sqlite3.Error, StoreError) as exc:
            await self._close_connections()
            self._unlock()
            raise StoreError(f"cannot open the archive at {self._path}: {exc}") from exc
        if self._path != ":memory:" and not self._read_only:
            self._checkpoints = asyncio.create_task(self._checkpoint_periodically())

    async def _start_writer(self) -> tuple[BatchWriter, Readers]:
        """The writer (its schema migrated), and where reads run."""
        if self._writer_kind == "process":
            process = await self._start_process()
            self._supervisor = asyncio.create_task(self._supervise(process))
            writer: BatchWriter = process
        else:
            # Opened (and migrated) on the store's thread; inline, used on the loop after.
            conn = await self._in_thread(self._connect)
            if self._writer_kind == "inline":
                writer = InlineWriter(conn)
            else:
                writer = ThreadWriter(conn, self._executor, self._read_only)
            if self._path == ":memory:":
                return writer, Readers.shared(conn, self._executor)
        return writer, Readers.pool(self._path, self._readers_size)

    async def _start_process(self) -> ProcessWriter:
        return await ProcessWriter.start(self._path, self._wal_size_limit)

    async def _supervise(self, writer: ProcessWriter) -> None:
        """Start the writer process again whenever it dies (OOM-killed, say): the writes
        it had not answered failed with StoreError, as do those sent until the next one
        greets; none waits. Each write is one transaction, so a write that failed was
        either committed whole or not at all (the client's retry of a message finds it
        by its client id)."""
        while True:
            reason = await writer.stopped()
            log.error("%s; a new one starts in %.1f s", reason, self._respawn_delay)
            writer = await self._restarted_process()
            self._writer = writer
            log.info("the archive writer process started again pid=%d", writer.pid)

    async def _restarted_process(self) -> ProcessWriter:
        """A new writer process, tried every `respawn_delay` until one starts."""
        while True:
            await asyncio.sleep(self._respawn_delay)
            try:
                return await self._start_process()
            except (StoreError, OSError) as exc:
                log.error("%s; tried again in %.1f s", exc, self._respawn_delay)

    @property
    def writer_pid(self) -> int | None:
        """The writer process's id while open (None: writes run in this process)."""
        return None if self._writer is None else self._writer.pid

    async def health(self, within: float) -> Health:
        """A file beside this process: ready once open and while its writer runs (a
        failing disk fails the writes)."""
        if self._writer is None:
            return Health(False, "not open")
        return self._writer.health()

    async def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.cancel()
            await asyncio.gather(self._checkpoints, return_exceptions=True)
        if self._committer is not None:
            await self._committer
        await self._close_connections()
        self._executor.shutdown(wait=True)
        self._checkpointer.shutdown(wait=True)
        self._unlock()

    async def _close_connections(self) -> None:
        if self._readers is not None:
            readers, self._readers = self._readers, None
            await readers.close()
        if self._supervisor is not None:  # closing the writer is not its death
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self._writer is not None:
            writer, self._writer = self._writer, None
            await writer.close()

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases its lock
            self._lock = None

    # -- sessions ---------------------------------------------------------------

    async def create_session(self, session: Session) -> Session:
        stored: Session = await self._write(CreateSession(session))
        return stored

    async def get_session(self, session_id: str) -> Session | None:
        cached = self._sessions.get(session_id)
        if cached is not None:
            return cached

        def select(conn: Archive) -> Session | None:
            row = conn.execute(SQL.select_session, (session_id,)).fetchone()
            return None if row is None else session_from_row(row)

        generation = self._sessions.generation
        found = await self._read(select)
        if found is not None:
            self._sessions.offer(found, generation)
        return found

    async def list_sessions(
        self, owner: str, *, limit: int, cursor: str = "", include_deleted: bool = True
    ) -> list[Session]:
        statement = sql.list_sessions(sql.SQLITE, include_deleted, bool(cursor))
        args = sql.page_args(owner, limit, cursor)

        def select(conn: Archive) -> list[Session]:
            return [session_from_row(row) for row in conn.execute(statement, args).fetchall()]

        return await self._read(select)

    async def touch_session(self, session_id: str, now: float) -> None:
        await self._write(TouchSession(session_id, now))

    async def update_session(self, session: Session) -> Session:
        stored: Session = await self._write(UpdateSession(session))
        return stored

    async def fork_session(self, session: Session, messages: Sequence[Message]) -> list[Message]:
        stored: list[Message] = await self._write(ForkSession(session, tuple(messages)))
        return stored

    # -- messages ---------------------------------------------------------------

    async def append_message(self, message: Message) -> Message:
        stored: Message = await self._write(AppendMessage(message))
        return stored

    async def update_message(self, message: Message) -> Message:
        stored: Message = await self._write(UpdateMessage(message))
        return stored

    async def get_message(self, message_id: str) -> Message | None:
        def select(conn: Archive) -> Message | None:
            row = conn.execute(SQL.get_message, (message_id,)).fetchone()
            return None if row is None else message_from_row(row)

        return await self._read(select)

    async def find_message_by_client_id(self, owner: str, client_id: str) -> Message | None:
        if not client_id:
            return None

        def select(conn: Archive) -> Message | None:
            row = conn.execute(SQL.find_by_client_id, (client_id, owner)).fetchone()
            return None if row is None else message_from_row(row)

        return await self._read(select)

    async def begin_turn(
        self,
        turn: Turn,
        message: Message,
        *,
        reply: Message | None = None,
        unique_client_id: bool = False,
        started: Turn | None = None,
    ) -> Message:
        # One write, one hop to the writer, and all or nothing (each write is a savepoint).
        stored: Message = await self._write(
            BeginTurn(turn, message, reply, unique_client_id, started)
        )
        return stored

    async def list_messages(
        self, session_id: str, *, after_offset: int = 0, limit: int | None = None
    ) -> list[Message]:
        def select(conn: Archive) -> list[Message]:
            # A negative LIMIT is none in SQLite.
            args = (session_id, after_offset, -1 if limit is None else limit)
            found = conn.execute(SQL.list_messages, args).fetchall()
            return [message_from_row(row) for row in found]

        return await self._read(select)

    # -- turns ------------------------------------------------------------------

    async def create_turn(self, turn: Turn) -> None:
        await self._write(CreateTurn(turn))

    async def save_turn(self, turn: Turn) -> None:
        await self._write(SaveTurn(turn))

    async def end_turn(self, turn: Turn, reply: Message | None) -> None:
        await self._write(EndTurn(turn, reply))

    async def get_turn(self, turn_id: str) -> Turn | None:
        def select(conn: Archive) -> Turn | None:
            row = conn.execute(SQL.get_turn, (turn_id,)).fetchone()
            return None if row is None else _turn_from_row(row)

        return await self._read(select)

    async def list_turns(self, session_id: str) -> list[Turn]:
        def select(conn: Archive) -> list[Turn]:
            found = conn.execute(SQL.list_turns, (session_id,)).fetchall()
            return [_turn_from_row(row) for row in found]

        return await self._read(select)

    async def page_turns(self, session_id: str, *, limit: int, cursor: str = "") -> list[Turn]:
        statement = sql.page(sql.SQLITE, "turns", bool(cursor))
        args = sql.page_args(session_id, limit, cursor)

        def select(conn: Archive) -> list[Turn]:
            return [_turn_from_row(row) for row in conn.execute(statement, args).fetchall()]

        return await self._read(select)

    # -- tool calls -------------------------------------------------------------

    async def save_tool_call(self, call: ToolCallRecord) -> None:
        await self._write(SaveToolCall(call))

    async def get_tool_call(self, call_id: str) -> ToolCallRecord | None:
        def select(conn: Archive) -> ToolCallRecord | None:
            row = conn.execute(SQL.get_tool_call, (call_id,)).fetchone()
            return None if row is None else _tool_call_from_row(row)

        return await self._read(select)

    async def list_tool_calls(self, session_id: str) -> list[ToolCallRecord]:
        def select(conn: Archive) -> list[ToolCallRecord]:
            found = conn.execute(SQL.list_tool_calls, (session_id,)).fetchall()
            return [_tool_call_from_row(row) for row in found]

        return await self._read(select)

    async def page_tool_calls(
        self, session_id: str, *, limit: int, cursor: str = ""
    ) -> list[ToolCallRecord]:
        statement = sql.page(sql.SQLITE, "tool_calls", bool(cursor))
        args = sql.page_args(session_id, limit, cursor)

        def select(conn: Archive) -> list[ToolCallRecord]:
            return [_tool_call_from_row(row) for row in conn.execute(statement, args).fetchall()]

        return await self._read(select)

    async def renew_replica(self, replica_id: str, now: float) -> None:
        await self._write(RenewReplica(replica_id, now))

    async def interrupt_orphaned_turns(
        self, now: float, *, replica_id: str, lease: float, include_own: bool = False
    ) -> int:
        interrupted: int = await self._write(
            InterruptOrphanedTurns(now, replica_id, lease, include_own)
        )
        return interrupted

    # -- agent memory -------------------------------------------------------------

    async def save_memory(self, entry: MemoryEntry, *, max_entries: int) -> bool:
        saved: bool = await self._write(SaveMemory(entry, max_entries))
        return saved

    async def search_memory(self, key: MemoryKey, query: str, *, limit: int) -> list[MemoryEntry]:
        def select(conn: Archive) -> list[MemoryEntry]:
            found = conn.execute(SQL.search_memory, (*astuple(key), query, limit)).fetchall()
            return [rows.memory_from_row(row_dict(row)) for row in found]

        return await self._read(select)

    async def forget_memory(self, key: MemoryKey, memory_id: str) -> bool:
        forgotten: bool = await self._write(ForgetMemory(key, memory_id))
        return forgotten

    # -- session traces -----------------------------------------------------------

    async def append_trace(self, event: TraceEvent) -> None:
        await self._write(AppendTrace(event))

    async def list_trace(self, session_id: str, owner: str, *, limit: int) -> list[TraceEvent]:
        def select(conn: Archive) -> list[TraceEvent]:
            found = conn.execute(SQL.select_trace, (session_id, owner, limit)).fetchall()
            return [rows.trace_from_row(row_dict(row)) for row in found]

        return await self._read(select)

    # -- the update log ---------------------------------------------------------

    async def update_log(self, owner: str) -> UpdateLog:
        def select(conn: Archive) -> tuple[int, int | None]:
            last, first = conn.execute(_UPDATE_LOG, (owner,)).fetchone()
            return last, first

        return rows.update_log(self._epoch, *await self._read(select))

    async def list_updates(self, owner: str, *, after_offset: int, limit: int) -> list[Update]:
        def select(conn: Archive) -> list[Update]:
            found = conn.execute(SQL.select_updates, (owner, after_offset, limit)).fetchall()
            return [rows.update_from_row(row) for row in found]

        return await self._read(select)

    async def prune_updates(self, older_than: float) -> int:
        pruned: int = await self._write(PruneUpdates(older_than))
        return pruned
