"""The SQLite archive's writes in one process, no server: what a batch costs, where its
time goes, and whether writes go on while a long read runs. For the archive writer's
decisions (docs/performance.md, "The archive writer (SQLite)").

`batches`: CLIENTS concurrent turns, each `begin_turn` (user message, turn, pending
reply) then `end_turn` (the reply's content, the turn's end), as the engine writes them;
per writer, the turns/s, the batches' size and duration (on whichever thread ran them)
and the time of each statement kind (COMMIT included).

`read`: a session of MESSAGES messages read whole (`list_messages`, LONG_READS of them
at once) while a ticker measures the event loop's lag (1 ms sleeps), a task keeps
appending to another session and another keeps reading one message: how long the loop
waited, and how long each write and each short read took, while the long reads ran;
per writer and per size of the store's read pool (`--readers`).

    python bench/archive_writes.py batches --writers thread,inline --clients 8
    python bench/archive_writes.py read --writers thread,inline --messages 50000
    python bench/archive_writes.py read --writers thread --readers 1,2,4 --long-reads 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import uvloop

from portico.domain.model import Message, Session, Turn
from portico.domain.states import TurnState
from portico.store import sqlite, sqlite_writes

Span = tuple[float, int]  # seconds, writes in the batch


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def pct(values: Sequence[float], p: float) -> float:
    ordered = sorted(values) or [float("nan")]
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


class Probe:
    """Times `commit_batch` and each statement of the writing connection while on."""

    def __init__(self) -> None:
        self.batches: list[Span] = []
        self.statements: dict[str, list[float]] = defaultdict(list)

    def __enter__(self) -> Probe:
        # Patched where the store's thread and inline writers look it up (sqlite imports it).
        commit, execute = getattr(sqlite, "commit_batch"), sqlite_writes.Archive.execute  # noqa: B009

        def timed_commit(conn: sqlite_writes.Archive, writes: Sequence[sqlite_writes.Write]) -> Any:
            start = time.perf_counter()
            try:
                return commit(conn, writes)
            finally:
                self.batches.append((time.perf_counter() - start, len(writes)))

        def timed_execute(conn: sqlite_writes.Archive, statement: str, *args: Any) -> Any:
            start = time.perf_counter()
            try:
                return execute(conn, statement, *args)
            finally:
                self.statements[statement.split("(")[0][:48]].append(time.perf_counter() - start)

        def restore() -> None:
            setattr(sqlite, "commit_batch", commit)  # noqa: B010
            setattr(sqlite_writes.Archive, "execute", execute)  # noqa: B010

        self._restore: Callable[[], None] = restore
        # Where the store's thread and inline writers look it up.
        sqlite.commit_batch = timed_commit  # type: ignore[attr-defined]
        sqlite_writes.Archive.execute = timed_execute  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()


def session(session_id: str) -> Session:
    now = time.time()
    return Session(
        id=session_id,
        owner=f"o-{session_id}",
        agent="default",
        created_at=now,
        updated_at=now,
        last_activity_at=now,
    )


def message(session_id: str, n: int, content: str = "hello") -> Message:
    now = time.time()
    return Message(
        id=f"{session_id}-m{n}",
        session_id=session_id,
        role="user",
        content=content,
        created_at=now,
        updated_at=now,
    )


async def open_store(path: Path, writer: str, readers: int = sqlite.READERS) -> sqlite.SqliteStore:
    store = sqlite.SqliteStore(path, writer=writer, readers=readers)  # type: ignore[arg-type]
    await store.open()
    return store


async def turns(store: sqlite.SqliteStore, session_id: str, count: int) -> None:
    for k in range(count):
        now = time.time()
        turn = Turn(
            id=f"{session_id}-t{k}", session_id=session_id, state=TurnState.RUNNING, created_at=now
        )
        reply = Message(
            id=f"{session_id}-r{k}",
            session_id=session_id,
            role="assistant",
            content="",
            status="pending",
            turn_id=turn.id,
            turn_offset=2,
            created_at=now,
            updated_at=now,
        )
        user = msgspec.structs.replace(message(session_id, k), turn_id=turn.id)
        await store.begin_turn(turn, user, reply=reply)
        await asyncio.sleep(0.001)  # the runtime's chunks
        ended = msgspec.structs.replace(turn, state=TurnState.COMPLETED, ended_at=time.time())
        final = msgspec.structs.replace(reply, status="complete", content="word " * 50)
        await store.end_turn(ended, final)


async def batches(writer: str, clients: int, count: int) -> None:
    with tempfile.TemporaryDirectory(prefix="portico-archive-") as workdir:
        store = await open_store(Path(workdir) / "archive.db", writer)
        try:
            for c in range(clients):
                await store.create_session(session(f"s{c}"))
            with Probe() as probe:
                start = time.perf_counter()
                await asyncio.gather(*(turns(store, f"s{c}", count) for c in range(clients)))
                elapsed = time.perf_counter() - start
        finally:
            await store.close()
    spans = [seconds for seconds, _ in probe.batches]
    writes = sum(size for _, size in probe.batches)
    print(
        f"{writer}: {clients * count / elapsed:.0f} turns/s ({clients} clients); "
        f"{len(spans)} batches of {writes / len(spans):.1f} writes; batch p50 "
        f"{ms(pct(spans, 0.5))} p99 {ms(pct(spans, 0.99))} max {ms(max(spans))} ms; "
        f"{sum(spans) / writes * 1e6:.0f} µs per write"
    )
    for name, times in sorted(probe.statements.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"    {statistics.median(times) * 1e6:7.0f} µs median, {len(times):6d} x  {name}")


async def read(writer: str, messages: int, readers: int, long_reads: int) -> None:
    with tempfile.TemporaryDirectory(prefix="portico-archive-") as workdir:
        store = await open_store(Path(workdir) / "archive.db", writer, readers)
        try:
            await read_beside_writes(store, messages, f"{writer}, {readers} readers", long_reads)
        finally:
            await store.close()


async def read_beside_writes(
    store: sqlite.SqliteStore, messages: int, label: str, long_reads: int = 1
) -> None:
    await store.create_session(session("big"))
    await store.create_session(session("live"))
    for k in range(0, messages, 500):
        batch = range(k, min(k + 500, messages))
        await asyncio.gather(*(store.append_message(message("big", n, "x" * 200)) for n in batch))
    lags: list[float] = []
    writes: list[float] = []
    short_reads: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    async def appender() -> None:
        n = 0
        while not stop.is_set():
            start = time.perf_counter()
            await store.append_message(message("live", n))
            writes.append(time.perf_counter() - start)
            n += 1
            await asyncio.sleep(0.002)

    async def reader() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            await store.get_message("big-m1")
            short_reads.append(time.perf_counter() - start)
            await asyncio.sleep(0.002)

    tasks = [asyncio.create_task(job()) for job in (ticker, appender, reader)]
    await asyncio.sleep(0.3)
    lags_before, writes_before, reads_before = len(lags), len(writes), len(short_reads)
    start = time.perf_counter()
    found = await asyncio.gather(*(store.list_messages("big") for _ in range(long_reads)))
    took = time.perf_counter() - start
    stop.set()
    await asyncio.gather(*tasks)
    during, wrote, read = lags[lags_before:], writes[writes_before:], short_reads[reads_before:]
    print(
        f"{label}: {long_reads} reads of {len(found[0])} messages {ms(took)} ms; loop lag during "
        f"them p50 {ms(pct(during, 0.5))} p99 {ms(pct(during, 0.99))} max {ms(max(during))} ms "
        f"(before: p50 {ms(pct(lags[:lags_before], 0.5))} ms); {len(wrote)} writes committed "
        f"during them, p50 {ms(pct(wrote, 0.5))} max {ms(max(wrote, default=0))} ms; "
        f"{len(read)} short reads, p50 {ms(pct(read, 0.5))} max {ms(max(read, default=0))} ms"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["batches", "read"])
    parser.add_argument("--writers", default="thread,inline", help="comma-separated, in order")
    parser.add_argument("--clients", type=int, default=8, help="batches: concurrent turns")
    parser.add_argument("--turns", type=int, default=200, help="batches: turns per client")
    parser.add_argument("--messages", type=int, default=50_000, help="read: the session's size")
    parser.add_argument(
        "--readers", default=str(sqlite.READERS), help="read: the read pool's sizes, in order"
    )
    parser.add_argument("--long-reads", type=int, default=1, help="read: long reads at once")
    args = parser.parse_args(argv)
    for writer in args.writers.split(","):
        if args.what == "batches":
            uvloop.run(batches(writer, args.clients, args.turns))
        else:
            for readers in args.readers.split(","):
                uvloop.run(read(writer, args.messages, int(readers), args.long_reads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
