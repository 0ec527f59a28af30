"""The SQLite archive's writer as a process of its own.

The writes' Python (rows, update entries, statements) ran on a thread of the
serving process and took the GIL from the event loop for about half the time under
a stream load (docs/performance.md). Here one child process owns the writing
connection and runs the same batches (`sqlite_writes.commit_batch`); the server keeps its
reads on a read-only connection of its own (WAL lets readers run beside the writer).

The two speak length-prefixed msgpack frames over the child's stdin and stdout. A
request is a batch of writes (each a `sqlite_writes.Write`: its name and arguments), a WAL
restart or a close; each has one reply, in order. A batch's reply holds each write's
result (msgpack, decoded as the write's `RESULT`) or error, and the updates it
logged (as update rows). The child answers a batch once it committed, so what is
durable when a write's future resolves is what it was with the thread writer.

Lifecycles are tied by the pipes: the child exits when its stdin closes (the server
exited, even by kill -9), and the server fails every waiting and later write with
StoreError once the child's stdout closes (it died).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import operator
import os
import signal
import sqlite3
import sys
from collections import deque
from pathlib import Path
from typing import IO, Any

import msgspec

import portico
from portico.errors import DuplicateClientId, StoreError
from portico.health import Health
from portico.store import rows
from portico.store.base import as_store_error
from portico.store.sqlite_writes import (
    WRITES,
    Archive,
    Outcome,
    Write,
    checkpoint,
    commit_batch,
    connect_writer,
    restart_wal,
)

log = logging.getLogger("portico.store")

# Seconds the writer may take to open (and migrate) the archive, and to close.
START_DEADLINE = 60.0
CLOSE_DEADLINE = 30.0
_HEADER = 4  # bytes of a frame's length, big-endian


class Batch(msgspec.Struct, frozen=True, tag=True, array_like=True):
    writes: list[msgspec.Raw]  # each a msgpack-encoded Write


class RestartWal(msgspec.Struct, frozen=True, tag=True, array_like=True):
    pass


class Close(msgspec.Struct, frozen=True, tag=True, array_like=True):
    pass


Request = Batch | RestartWal | Close


class WireError(msgspec.Struct, frozen=True, array_like=True):
    """A failed write's StoreError: its message, the class and message of its cause
    (the sqlite3 error, rebuilt as one on the server's side), or a taken client id."""

    message: str
    cause: str = ""
    cause_message: str = ""
    duplicate: tuple[str, str, str] | None = None


UpdateRow = tuple[str, int, str, bytes, bytes, float]


class WireOutcome(msgspec.Struct, frozen=True, array_like=True):
    result: msgspec.Raw  # msgpack of what the write returned
    error: WireError | None
    updates: list[UpdateRow]


_encode = msgspec.msgpack.encode
_request_decoder = msgspec.msgpack.Decoder(Request)
_write_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
    functools.reduce(operator.or_, WRITES)
)
_outcomes_decoder = msgspec.msgpack.Decoder(list[WireOutcome])
_NONE = msgspec.Raw(_encode(None))


@functools.cache
def _result_decoder(result_type: Any) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(result_type)


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(_HEADER, "big") + payload


# -- the server's side ----------------------------------------------------------------


class ProcessWriter:
    """The server's handle on its writer process (a `sqlite.BatchWriter`)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        # One reply per request, in order: the first is the child's greeting.
        self._waiting: deque[asyncio.Future[bytes]] = deque()
        self._greeting = self._expect_reply()
        self._stopped = ""  # why the writer is gone, once it is
        self._replies = asyncio.create_task(self._read_replies())

    @property
    def pid(self) -> int:
        return self._process.pid

    @classmethod
    async def start(cls, path: str, wal_size_limit: int) -> ProcessWriter:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            __name__,
            path,
            str(wal_size_limit),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=_child_environment(),
        )
        writer = cls(process)
        try:
            async with asyncio.timeout(START_DEADLINE):
                failure = msgspec.msgpack.decode(await writer._greeting, type=str)
        except (TimeoutError, StoreError) as exc:
            await writer._stop()
            raise StoreError(f"the archive writer did not start: {exc}") from exc
        if failure:
            await writer._stop()
            raise StoreError(failure)
        return writer

    def _expect_reply(self) -> asyncio.Future[bytes]:
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        return future

    async def _read_replies(self) -> None:
        stdout = self._process.stdout
        assert stdout is not None
        try:
            while True:
                size = int.from_bytes(await stdout.readexactly(_HEADER), "big")
                reply = await stdout.readexactly(size)
                future = self._waiting.popleft()
                if not future.done():
                    future.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the child closed its end: it exited
        self._stopped = "the archive writer process exited"
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(StoreError(self._stopped))
        code = await self._process.wait()
        self._stopped = f"the archive writer process exited (code {code})"

    async def _request(self, request: Batch | RestartWal | Close) -> bytes:
        if self._stopped:
            raise StoreError(self._stopped)
        stdin = self._process.stdin
        assert stdin is not None
        reply = self._expect_reply()
        stdin.write(_frame(_encode(request)))
        with contextlib.suppress(ConnectionError):  # gone: the reply's reader fails it
            await stdin.drain()
        return await reply

    async def run_batch(self, writes: list[Write]) -> list[Outcome]:
        encoded: list[msgspec.Raw | StoreError] = [_encode_write(write) for write in writes]
        sent = [raw for raw in encoded if isinstance(raw, msgspec.Raw)]
        replies = iter(_outcomes_decoder.decode(await self._request(Batch(sent))) if sent else [])
        return [
            (raw, []) if isinstance(raw, StoreError) else _outcome(write, next(replies))
            for write, raw in zip(writes, encoded, strict=True)
        ]

    async def restart_wal(self) -> None:
        await self._checkpoint(RestartWal())

    async def _checkpoint(self, request: RestartWal | Close) -> None:
        failure = msgspec.msgpack.decode(await self._request(request), type=str)
        if failure:
            raise StoreError(failure)

    async def close(self) -> None:
        try:
            async with asyncio.timeout(CLOSE_DEADLINE):
                await self._checkpoint(Close())
        except (TimeoutError, StoreError) as exc:
            log.warning("the archive writer did not close cleanly: %s", exc or "no answer")
        await self._stop()

    async def _stop(self) -> None:
        """Close the child's stdin (it exits) and wait for it; kill it past the deadline."""
        stdin = self._process.stdin
        if stdin is not None:
            stdin.close()
        try:
            async with asyncio.timeout(CLOSE_DEADLINE):
                await self._process.wait()
        except TimeoutError:
            self._process.kill()
            await self._process.wait()
        await self._replies

    async def stopped(self) -> str:
        """Returns once the process has exited: why (its exit code)."""
        await asyncio.shield(self._replies)
        return self._stopped

    def health(self) -> Health:
        # Ready as the thread writer is (a file beside this process), and says where the
        # writes run: an operator reading /readyz sees the process to look for.
        if self._stopped:
            return Health(False, self._stopped)
        return Health(True, f"writer process {self.pid}")


def _encode_write(write: Write) -> msgspec.Raw | StoreError:
    """A write as msgpack; one that cannot be encoded fails alone, as any failing write."""
    try:
        return msgspec.Raw(_encode(write))
    except (TypeError, ValueError, OverflowError) as exc:
        return as_store_error(exc)


def _outcome(write: Write, wire: WireOutcome) -> Outcome:
    if wire.error is not None:
        return _store_error(wire.error), []
    result = _result_decoder(write.RESULT).decode(wire.result)
    return result, [rows.update_from_row(row) for row in wire.updates]


def _store_error(wire: WireError) -> StoreError:
    if wire.duplicate is not None:
        client_id, session_id, message_id = wire.duplicate
        return DuplicateClientId(client_id, session_id=session_id, message_id=message_id)
    error = StoreError(wire.message)
    if wire.cause:
        error.__cause__ = _cause(wire.cause, wire.cause_message)
    return error


def _cause(name: str, message: str) -> BaseException:
    """The writer's exception as the same sqlite3 error class, for the log and callers
    that tell a constraint from a broken disk; any other as a RuntimeError naming it."""
    module, _, qualname = name.rpartition(".")
    found = getattr(sqlite3, qualname, None) if module == "sqlite3" else None
    if isinstance(found, type) and issubclass(found, sqlite3.Error):
        return found(message)
    return RuntimeError(f"{name}: {message}")


def _child_environment() -> dict[str, str]:
    """This process's environment, with this portico first on the child's path (the
    server may run a source tree that is not the installed one)."""
    root = str(Path(portico.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, path) if p)}


# -- the writer process's side --------------------------------------------------------


def _wire_outcome(outcome: Outcome) -> WireOutcome:
    result, updates = outcome
    if isinstance(result, BaseException):
        return WireOutcome(_NONE, _wire_error(result), [])
    update_rows: list[Any] = [rows.update_row(update) for update in updates]
    return WireOutcome(msgspec.Raw(_encode(result)), None, update_rows)


def _wire_error(error: BaseException) -> WireError:
    if isinstance(error, DuplicateClientId):
        ids = (error.client_id, error.session_id, error.message_id)
        return WireError(str(error), duplicate=ids)
    cause = error.__cause__
    if cause is None:
        return WireError(str(error))
    kind = type(cause)
    return WireError(str(error), f"{kind.__module__}.{kind.__qualname__}", str(cause))


def _answer(conn: Archive, request: Batch | RestartWal | Close) -> bytes:
    if isinstance(request, Batch):
        writes: list[Write] = [_write_decoder.decode(raw) for raw in request.writes]
        return _encode([_wire_outcome(outcome) for outcome in commit_batch(conn, writes)])
    try:
        if isinstance(request, RestartWal):
            restart_wal(conn)
        else:  # closing, the owner checkpoints the WAL into the database file
            checkpoint(conn, "TRUNCATE")
    except sqlite3.Error as exc:
        return _encode(f"archive checkpoint failed: {exc}")
    return _encode("")


def _read_frame(requests: IO[bytes]) -> bytes | None:
    header = requests.read(_HEADER)
    if len(header) < _HEADER:
        return None  # the server closed the pipe, or exited
    size = int.from_bytes(header, "big")
    payload = requests.read(size)
    return payload if len(payload) == size else None


def serve(path: str, wal_size_limit: int, requests: IO[bytes], replies: IO[bytes]) -> None:
    def send(payload: bytes) -> None:
        replies.write(_frame(payload))
        replies.flush()

    try:
        conn = connect_writer(path, wal_size_limit)
    except sqlite3.Error as exc:
        send(_encode(str(exc)))  # the store says which archive
        return
    send(_encode(""))
    try:
        while (frame := _read_frame(requests)) is not None:
            request = _request_decoder.decode(frame)
            send(_answer(conn, request))
            if isinstance(request, Close):
                break
    finally:
        conn.close()


def main() -> None:
    # The server stops it (by closing its stdin) after its last write: a Ctrl-C or a
    # SIGTERM sent to the whole process group must not end it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Replies go to the original stdout; anything printed goes to stderr instead.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    path, wal_size_limit = sys.argv[1], int(sys.argv[2])
    serve(path, wal_size_limit, sys.stdin.buffer, replies)


if __name__ == "__main__":
    main()
