"""The benchmark's load generator: one process, many WebSocket connections, one workload.

    python bench/loadgen.py stream  --url ws://127.0.0.1:PORT/ws [--clients 100] [--seconds 5]
    python bench/loadgen.py latency --url ... [--rate 200] [--pool 32] [--seconds 6]
    python bench/loadgen.py idle    --url ... --count 1000 [--hold 120]
    python bench/loadgen.py session_stream --url ws://127.0.0.1:PORT/v1/session [--clients 100]
    python bench/loadgen.py session_resume --url ws://.../v1/session --scenario long1000
                                           --backlog 1000 [--samples 20] [--warm 1]
    python bench/loadgen.py rpc_latency --url ws://127.0.0.1:PORT/v1/rpc [--rate 200]
                                        [--pool 32] [--users 32]
    python bench/loadgen.py rpc_pages --url ws://.../v1/rpc [--messages 10000]
                                      [--samples 20] [--warm 1]

`--users N` authenticates connection i as bench user i mod N (common.bench_token; the
server needs those keys, see bench/harness.py); without it no token is sent.

Prints one JSON object per line on stdout; the last has `"event": "result"`. `idle` first
prints `"event": "ready"` once every connection has its `connected`, then holds them until
a line (or EOF) arrives on stdin, or `--hold` seconds pass.

Adding a workload is one decorated function: `@workload("name")` over an
`async def (Options) -> dict` (see `stream` below); it gets the parsed options and returns
its figures. Talks only to loopback addresses; every phase is bounded in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import json
import math
import os
import random
import re
import stat
import struct
import sys
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import uvloop
from common import (
    FILL_SCENARIO,
    FILL_WINDOW,
    PAGE_SIZE,
    RPC_TURN_ENDS,
    RPC_TURN_FAILURES,
    TERMINAL_KINDS,
    RpcFrame,
    RpcLive,
    RpcUpdate,
    ack_frame,
    bench_token,
    end_frame,
    frame_kind,
    hello_frame,
    message_frame,
    raise_fd_limit,
    ready_session_id,
    rpc_connect_frame,
    rpc_frame,
    rpc_list_frame,
    rpc_page,
    rpc_send_frame,
    rpc_send_result,
    session_frame,
    session_message_frame,
)

from portico.protocols.omnia.binary import (  # the OMNI frame format voice calls speak
    HEADER_SIZE,
    BinaryFrame,
    BinaryMetadata,
    encode_frame,
)

VOICE_FORMAT = BinaryMetadata(codec="pcm16", sample_rate=16_000, channels=1)
VOICE_NO_METADATA = BinaryMetadata()
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
DRAIN_TIMEOUT = 5.0  # seconds for in-flight turns to end once a workload stops sending
CONNECT_TIMEOUT = 60.0  # seconds for every connection of a workload to get `connected`
CLOSE_TIMEOUT = 30.0  # seconds for every closing handshake of a workload to finish


# -- options and the workload registry ---------------------------------------------------


@dataclass(frozen=True)
class Options:
    url: str
    clients: int
    seconds: float
    warmup: float
    start_at: float | None
    scenario: str
    max_turns: int
    rate: float
    pool: int
    count: int
    hold: float
    warm: int
    samples: int
    backlog: int
    users: int
    messages: int
    connect_concurrency: int
    client: str
    source: str | None


Workload = Callable[[Options], Awaitable[dict[str, Any]]]
WORKLOADS: dict[str, Workload] = {}


def workload(name: str) -> Callable[[Workload], Workload]:
    """Register a workload under `name` (the first positional argument of the CLI)."""

    def register(fn: Workload) -> Workload:
        WORKLOADS[name] = fn
        return fn

    return register


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


# -- connections: picows when installed (fastest), aiohttp otherwise ----------------------


class Handler(Protocol):
    """What a workload attaches to each connection."""

    def on_frame(self, payload: bytes | str) -> None: ...

    def on_binary(self, payload: bytes) -> None: ...

    def on_closed(self) -> None: ...


class Connection(Protocol):
    def send(self, data: bytes) -> None: ...

    def send_binary(self, data: bytes) -> None: ...

    def close(self) -> None:
        """Start the closing handshake; the server then closes the TCP connection."""

    def abort(self) -> None:
        """Drop the TCP connection now."""

    def drop(self) -> None:
        """Close TCP once what was sent is flushed, without a closing handshake."""


class Dialer(Protocol):
    async def connect(
        self, url: str, handler: Handler, headers: dict[str, str] | None = None
    ) -> Connection: ...

    async def aclose(self) -> None: ...


class PicowsDialer:
    """picows parses frames in C and calls back synchronously: about 1 us per frame."""

    def __init__(self, source: str | None = None) -> None:
        import picows

        self._picows = picows
        # A source address of its own: 28k ephemeral ports per address on loopback.
        self._extra: dict[str, Any] = {} if source is None else {"local_addr": (source, 0)}

        class Listener(picows.WSListener):
            def __init__(self, handler: Handler) -> None:
                self.handler = handler

            def on_ws_frame(self, transport: picows.WSTransport, frame: picows.WSFrame) -> None:
                if frame.msg_type == picows.WSMsgType.TEXT:
                    self.handler.on_frame(frame.get_payload_as_bytes())
                elif frame.msg_type == picows.WSMsgType.BINARY:
                    self.handler.on_binary(frame.get_payload_as_bytes())
                elif frame.msg_type == picows.WSMsgType.CLOSE and not transport.is_close_frame_sent:
                    transport.send_close(frame.get_close_code())
                # Then wait: the server closes TCP first, so TIME_WAIT stays on its side
                # and thousands of closed connections do not tie up our ephemeral ports.

            def on_ws_disconnected(self, transport: picows.WSTransport) -> None:
                self.handler.on_closed()

        self._listener = Listener

    async def connect(
        self, url: str, handler: Handler, headers: dict[str, str] | None = None
    ) -> Connection:
        transport, _ = await self._picows.ws_connect(
            lambda: self._listener(handler),
            url,
            websocket_handshake_timeout=CONNECT_TIMEOUT,
            extra_headers=headers,
            # uvloop's own connect: in this benchmark it opens connections about 30%
            # faster than the aiofastnet path picows picks by default.
            use_aiofastnet=False,
            **self._extra,
        )
        types = self._picows.WSMsgType
        return PicowsConnection(transport, types.TEXT, types.BINARY)

    async def aclose(self) -> None:
        return None


class PicowsConnection:
    def __init__(self, transport: Any, text: Any, binary: Any) -> None:
        self._transport = transport
        self._text = text
        self._binary = binary

    def send(self, data: bytes) -> None:
        self._transport.send(self._text, data)

    def send_binary(self, data: bytes) -> None:
        self._transport.send(self._binary, data)

    def close(self) -> None:
        if not self._transport.is_close_frame_sent:
            self._transport.send_close()

    def abort(self) -> None:
        self._transport.disconnect(graceful=False)

    def drop(self) -> None:
        self._transport.disconnect(graceful=True)


class AiohttpDialer:
    """The fallback where picows is absent (CI): slower per frame, fine for smoke runs."""

    def __init__(self, source: str | None = None) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        # limit=0: the default pool of 100 would queue every connection past the 100th.
        local = None if source is None else (source, 0)
        connector = aiohttp.TCPConnector(limit=0, local_addr=local)
        self._session = aiohttp.ClientSession(connector=connector)

    async def connect(
        self, url: str, handler: Handler, headers: dict[str, str] | None = None
    ) -> Connection:
        ws = await self._session.ws_connect(url, max_msg_size=0, autoping=True, headers=headers)
        return AiohttpConnection(ws, handler, self._aiohttp.WSMsgType)

    async def aclose(self) -> None:
        await self._session.close()


class AiohttpConnection:
    def __init__(self, ws: Any, handler: Handler, types: Any) -> None:
        self._ws = ws
        self._text = types.TEXT
        self._binary = types.BINARY
        self._tasks: set[asyncio.Task[Any]] = set()
        self._spawn(self._read(handler))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # held until done, so the loop cannot drop it
        task.add_done_callback(self._tasks.discard)

    async def _read(self, handler: Handler) -> None:
        async for msg in self._ws:
            if msg.type == self._text:
                handler.on_frame(msg.data)
            elif msg.type == self._binary:
                handler.on_binary(msg.data)
        handler.on_closed()

    def send(self, data: bytes) -> None:
        self._spawn(self._ws.send_frame(data, self._text))

    def send_binary(self, data: bytes) -> None:
        self._spawn(self._ws.send_frame(data, self._binary))

    def close(self) -> None:
        self._spawn(self._ws.close())

    def abort(self) -> None:
        return None  # AiohttpDialer.aclose() closes the session, which drops every socket

    def drop(self) -> None:
        self.close()  # aiohttp has no FIN without a close frame; to the server, alike


def resolve_client(kind: str) -> str:
    """`auto` is picows where it is installed, aiohttp otherwise."""
    if kind != "auto":
        return kind
    try:
        import picows  # noqa: F401
    except ImportError:
        return "aiohttp"
    return "picows"


def make_dialer(kind: str, source: str | None = None) -> Dialer:
    """`source`: the local address to connect from (loopback), None: the kernel's pick."""
    if resolve_client(kind) == "picows":
        return PicowsDialer(source)
    return AiohttpDialer(source)


class Peer:
    """A handler base: resolves `connected`, notes a close, ignores the rest."""

    def __init__(self) -> None:
        self.connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.conn: Connection | None = None
        self.closed = False
        self.token: str | None = None  # the API key it authenticates with (`--users`)

    @property
    def headers(self) -> dict[str, str] | None:
        """What the upgrade request carries: the token, for `/ws` and `/v1/session`."""
        return None if self.token is None else {"Authorization": f"Bearer {self.token}"}

    def on_frame(self, payload: bytes | str) -> None:
        if not self.connected.done() and frame_kind(payload) == "connected":
            self.connected.set_result(None)

    def on_binary(self, payload: bytes) -> None:
        return None

    def on_closed(self) -> None:
        self.closed = True
        if not self.connected.done():
            self.connected.set_exception(ConnectionError("closed before `connected`"))

    def opened(self) -> None:
        """The WebSocket is open: a protocol that speaks first (`hello`) does so here."""
        return None


async def open_all(dialer: Dialer, url: str, peers: Sequence[Peer], concurrency: int) -> int:
    """Connect every peer (at most `concurrency` handshakes at once); returns the failures."""
    gate = asyncio.Semaphore(concurrency)

    async def one(peer: Peer) -> None:
        async with gate:
            peer.conn = await dialer.connect(url, peer, peer.headers)
            peer.opened()
            await peer.connected

    tasks = [asyncio.ensure_future(one(p)) for p in peers]
    if not tasks:
        return 0
    # Those not connected by the deadline are failures (a server at its descriptor
    # limit leaves them hanging), counted as such rather than ending the workload.
    done, pending = await asyncio.wait(tasks, timeout=CONNECT_TIMEOUT)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return len(pending) + sum(task.exception() is not None for task in done)


def assign_users(peers: Sequence[Peer], users: int) -> None:
    """With `--users N`, connection i authenticates as bench user i mod N (else as nobody:
    the server runs with authentication off)."""
    if users > 0:
        for index, peer in enumerate(peers):
            peer.token = bench_token(index % users)


async def close_all(peers: Sequence[Peer]) -> None:
    """Close every connection with a handshake; drop those still open after CLOSE_TIMEOUT."""
    for peer in peers:
        if peer.conn is not None and not peer.closed:
            peer.conn.close()
    await until(lambda: all(p.closed or p.conn is None for p in peers), CLOSE_TIMEOUT)
    for peer in peers:
        if peer.conn is not None and not peer.closed:
            peer.conn.abort()


async def sleep_until(wall_time: float | None) -> None:
    """Processes started together align their windows on a shared wall-clock instant."""
    if wall_time is not None:
        await asyncio.sleep(max(0.0, wall_time - time.time()))


async def until(condition: Callable[[], bool], within: float, step: float = 0.01) -> bool:
    """Poll `condition` every `step` seconds, at most `within` seconds; returns its last value."""
    for _ in range(math.ceil(within / step)):
        if condition():
            return True
        await asyncio.sleep(step)
    return condition()


# -- stream: closed loop, each client sends its next message when its reply ends ----------


class StreamTally:
    def __init__(self, message: bytes, max_turns: int) -> None:
        self.message = message
        self.max_turns = max_turns
        self.sending = False
        self.sent = 0
        self.frames = 0
        self.turns = 0
        self.errors = 0
        self.busy = 0


class StreamPeer(Peer):
    def __init__(self, tally: StreamTally) -> None:
        super().__init__()
        self.tally = tally

    def on_frame(self, payload: bytes | str) -> None:
        kind = frame_kind(payload)
        tally = self.tally
        if kind == "chunk":
            tally.frames += 1
        elif kind in TERMINAL_KINDS:
            tally.frames += 1
            tally.turns += 1
            tally.errors += kind == "error"
            tally.busy -= 1
            self.next_turn()
        elif kind == "connected" and not self.connected.done():
            self.connected.set_result(None)

    def next_turn(self) -> None:
        tally = self.tally
        if tally.sending and tally.sent < tally.max_turns and self.conn is not None:
            tally.sent += 1
            tally.busy += 1
            self.conn.send(tally.message)


@workload("stream")
async def stream(options: Options) -> dict[str, Any]:
    """N clients, each: send a message, read its streamed reply to the terminal frame, repeat."""
    tally = StreamTally(message_frame("bench", options.scenario), options.max_turns)
    peers = [StreamPeer(tally) for _ in range(options.clients)]
    assign_users(peers, options.users)
    dialer = make_dialer(options.client)
    connect_errors = await open_all(dialer, options.url, peers, options.connect_concurrency)
    await sleep_until(options.start_at)
    tally.sending = True
    for peer in peers:
        peer.next_turn()
    await asyncio.sleep(options.warmup)
    frames0, turns0, errors0, t0, cpu0 = (
        tally.frames,
        tally.turns,
        tally.errors,
        time.perf_counter(),
        time.process_time(),
    )
    await asyncio.sleep(options.seconds)
    frames1, turns1, errors1, t1, cpu1 = (
        tally.frames,
        tally.turns,
        tally.errors,
        time.perf_counter(),
        time.process_time(),
    )
    tally.sending = False
    drained = await until(lambda: tally.busy <= 0, DRAIN_TIMEOUT)
    await close_all(peers)
    await dialer.aclose()
    elapsed = t1 - t0
    return {
        "clients": options.clients,
        "connect_errors": connect_errors,
        "window_s": elapsed,
        "frames_per_s": (frames1 - frames0) / elapsed,
        "turns_per_s": (turns1 - turns0) / elapsed,
        "errors": errors1 - errors0,
        "drained": drained,
        "client_cpu_pct": 100 * (cpu1 - cpu0) / elapsed,
    }


# -- latency: open loop at a fixed rate over a pool of connections -------------------------


class LatencyPeer(Peer):
    def __init__(self, done: Callable[[LatencyPeer, str], None]) -> None:
        super().__init__()
        self._done = done
        self.sent_at = 0.0
        self.first_at: float | None = None
        self.busy = False

    def send(self, data: bytes) -> None:
        assert self.conn is not None
        self.busy, self.first_at = True, None
        self.sent_at = time.perf_counter()
        self.conn.send(data)

    def on_frame(self, payload: bytes | str) -> None:
        now = time.perf_counter()
        kind = frame_kind(payload)
        if kind == "chunk":
            if self.first_at is None:
                self.first_at = now
        elif kind in TERMINAL_KINDS:
            self.busy = False
            self._done(self, kind)
        elif kind == "connected" and not self.connected.done():
            self.connected.set_result(None)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize_ms(samples: list[float], prefix: str) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        f"{prefix}_p50_ms": 1000 * percentile(ordered, 0.50),
        f"{prefix}_p99_ms": 1000 * percentile(ordered, 0.99),
        f"{prefix}_p999_ms": 1000 * percentile(ordered, 0.999),
    }


class OpenLoop:
    """`rate` sends/s over a pool of connections, a send only on a connection whose last
    turn ended: a pool too small for the rate is counted (`missed`), never hidden."""

    def __init__(self) -> None:
        self.idle: deque[Any] = deque()
        self.measure_from = math.inf  # perf_counter() after the warm-up
        self.sent = self.missed = self.connect_errors = 0

    def measured(self, peer: Any) -> bool:
        """Give `peer` back to the pool; True when its turn falls in the window."""
        self.idle.append(peer)
        return bool(peer.sent_at >= self.measure_from)

    async def run(self, peers: list[Any], options: Options, send: Callable[[Any], None]) -> bool:
        """Connect, send at the rate, wait for the last turns; True when they all ended."""
        assign_users(peers, options.users)
        dialer = make_dialer(options.client)
        self.connect_errors = await open_all(
            dialer, options.url, peers, options.connect_concurrency
        )
        self.idle.extend(p for p in peers if p.connected.done() and not p.connected.exception())
        await sleep_until(options.start_at)
        interval = 1.0 / options.rate
        start = time.perf_counter()
        self.measure_from = start + options.warmup
        ticks = min(options.max_turns, int((options.warmup + options.seconds) * options.rate))
        for tick in range(ticks):
            await asyncio.sleep(max(0.0, start + tick * interval - time.perf_counter()))
            if self.idle:
                send(self.idle.popleft())
                self.sent += 1
            else:
                self.missed += 1
        drained = await until(lambda: not any(p.busy for p in peers), DRAIN_TIMEOUT)
        await close_all(peers)
        await dialer.aclose()
        return drained


@workload("latency")
async def latency(options: Options) -> dict[str, Any]:
    """`rate` messages/s, each on a pooled connection whose previous turn has ended."""
    message = message_frame("bench", options.scenario)
    first: list[float] = []
    total: list[float] = []
    pacer = OpenLoop()
    errors = 0

    def done(peer: LatencyPeer, kind: str) -> None:
        nonlocal errors
        if not pacer.measured(peer):
            return
        if kind == "error" or peer.first_at is None:
            errors += 1
            return
        end = time.perf_counter()
        first.append(peer.first_at - peer.sent_at)
        total.append(end - peer.sent_at)

    peers = [LatencyPeer(done) for _ in range(options.pool)]
    await pacer.run(peers, options, lambda peer: peer.send(message))
    return {
        "rate": options.rate,
        "pool": options.pool,
        "connect_errors": pacer.connect_errors,
        "sent": pacer.sent,
        "missed": pacer.missed,
        "samples": len(total),
        "errors": errors,
        **summarize_ms(first, "first"),
        **summarize_ms(total, "done"),
    }


# -- idle: hold connections open for the caller to measure the server's memory ------------


async def stdin_reader() -> asyncio.StreamReader | None:
    """stdin as a stream when it is a pipe (as bench/run.py gives it); else None."""
    if not stat.S_ISFIFO(os.fstat(sys.stdin.fileno()).st_mode):
        return None  # libuv aborts on a pipe reader over /dev/null or a file
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def next_line(reader: asyncio.StreamReader | None, within: float) -> None:
    """Return on a line or EOF on stdin, or after `within` seconds, whichever comes first."""
    if reader is None:
        await asyncio.sleep(within)
        return
    try:
        await asyncio.wait_for(reader.readline(), within)
    except TimeoutError:
        return


@workload("idle")
async def idle(options: Options) -> dict[str, Any]:
    """Open `count` connections, wait for every `connected`, hold until released (stdin).

    With `--warm N`, first open and close N connections (the server's one-time costs),
    say `warmed`, and wait for a line on stdin before opening the `count`.
    """
    reader = await stdin_reader()
    dialer = make_dialer(options.client, options.source)
    if options.warm:
        warm = [Peer() for _ in range(options.warm)]
        await open_all(dialer, options.url, warm, options.connect_concurrency)
        await close_all(warm)
        emit("warmed")
        await next_line(reader, options.hold)
    peers = [Peer() for _ in range(options.count)]
    connect_errors = await open_all(dialer, options.url, peers, options.connect_concurrency)
    emit("ready", opened=options.count - connect_errors, connect_errors=connect_errors)
    await next_line(reader, options.hold)
    dropped = sum(p.closed for p in peers)  # closed by the server while held
    emit("released", dropped=dropped)  # told before closing: the caller may now kill the server
    await close_all(peers)
    await dialer.aclose()
    return {"count": options.count, "connect_errors": connect_errors, "dropped": dropped}


# -- voice: callers sending 20 ms of PCM in real time, each frame's echo timed -------------
#
# Each caller is a /ws voice call (docs/voice.md): OMNI binary frames of 16 kHz mono PCM16,
# the first naming the format. The server echoes every frame (Portico: the scripted duplex
# runtime with `echo: true`; the bare servers: the message as it came). A frame's payload
# starts with its caller-side sequence number, so its echo is matched whatever the server
# numbers it. Callers' sends are spread evenly over the 20 ms period.

VOICE_FRAME_S = 0.020
VOICE_RATE = 16_000
VOICE_FRAME_BYTES = int(VOICE_RATE * VOICE_FRAME_S) * 2
VOICE_DRAIN = 1.0  # seconds for the last frames' echoes after the window
_VOICE_SEQ = struct.Struct("<I")
_VOICE_PAD = bytes(VOICE_FRAME_BYTES - _VOICE_SEQ.size)
# Where a frame's header holds its Sequence and its MetadataLen (binary.py's layout).
_OMNI_SEQUENCE = struct.Struct(">I")
_OMNI_SEQUENCE_AT = 16
_OMNI_METADATA_LEN_AT = 8
HANGUP = b'{"type":"hangup"}'
# The shortest period of the pacer's timer (TimerPacer): at 1,000 callers a frame is due
# every 20 us, and waking for each would cost more than the frames; every frame due by a
# wake-up is sent at it, as the busy pacer did when its loop came round.
PACER_MIN_TICK = 100e-6


class VoiceTally:
    def __init__(self) -> None:
        self.measure_from = math.inf
        self.measure_until = math.inf
        self.sent = 0  # in the window
        self.echoed = 0  # of those, echoed by the end of the drain
        self.echoes_in_window = 0  # echoes (of any frame) that arrived in the window
        self.latencies: list[float] = []
        self.lags: list[float] = []  # how late each send in the window left, s
        self.errors = 0  # `error` frames, until the callers hang up
        self.counting = True


def voice_frame(sequence: int) -> bytes:
    """A caller's frame `sequence`, as `encode_frame` makes it: the format on the first."""
    return encode_frame(
        BinaryFrame(
            sequence=sequence,
            media_id="mic",
            metadata=VOICE_FORMAT if sequence == 0 else VOICE_NO_METADATA,
            payload=_VOICE_SEQ.pack(sequence) + _VOICE_PAD,
        )
    )


def echoed_sequence(data: bytes) -> int:
    """The caller-side sequence number at the start of an echoed frame's payload.

    Reads the header's MetadataLen, not the whole frame: checking the server's frames is
    the tests' work (Portico's; a bare server's are the caller's own bytes), and a full
    decode per echo (the metadata's JSON, a BinaryFrame) was a third of the client's
    Python per frame. A frame that is not OMNI raises, as a failed decode did."""
    if data[:4] != b"OMNI":
        raise ValueError("an echo that is not an OMNI frame")
    metadata_len = _OMNI_SEQUENCE.unpack_from(data, _OMNI_METADATA_LEN_AT)[0]
    return int(_VOICE_SEQ.unpack_from(data, HEADER_SIZE + metadata_len)[0])


class VoicePeer(Peer):
    def __init__(self, tally: VoiceTally) -> None:
        super().__init__()
        self.tally = tally
        self.sequence = 0
        self.sent_at: dict[int, float] = {}
        self.started: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.dialled = 0.0
        # Frames after the first differ only in their two sequence numbers: one buffer,
        # those patched in place per frame (the bytes are `voice_frame`'s; picows copies
        # what it sends), instead of a BinaryFrame and an encode per frame.
        self._frame = bytearray(voice_frame(1))
        self._payload_at = len(self._frame) - VOICE_FRAME_BYTES

    def on_frame(self, payload: bytes | str) -> None:
        kind = frame_kind(payload)
        if kind == "connected" and not self.connected.done():
            self.connected.set_result(None)
        elif kind == "session_config" and not self.started.done():
            self.started.set_result(time.perf_counter() - self.dialled)
        elif kind == "error" and self.tally.counting:
            self.tally.errors += 1

    def dial(self) -> None:
        """The call's first frame (the format): the call starts; `session_config` (or, from
        a bare server, the frame's echo) says so."""
        self.dialled = time.perf_counter()
        self.speak(self.dialled)

    def on_binary(self, payload: bytes) -> None:
        now = time.perf_counter()
        if not self.started.done():  # a bare echo server says nothing else
            self.started.set_result(now - self.dialled)
        sequence = echoed_sequence(payload)
        tally = self.tally
        if tally.measure_from <= now < tally.measure_until:
            tally.echoes_in_window += 1
        sent = self.sent_at.pop(sequence, None)
        if sent is not None:
            tally.echoed += 1
            tally.latencies.append(now - sent)

    def frame(self, sequence: int) -> bytes | bytearray:
        if sequence == 0:
            return voice_frame(0)
        frame = self._frame
        _OMNI_SEQUENCE.pack_into(frame, _OMNI_SEQUENCE_AT, sequence)
        _VOICE_SEQ.pack_into(frame, self._payload_at, sequence)
        return frame

    def speak(self, due: float) -> None:
        if self.conn is None or self.closed:
            return
        sequence = self.sequence
        self.sequence += 1
        data = self.frame(sequence)
        now = time.perf_counter()
        tally = self.tally
        if tally.measure_from <= now < tally.measure_until:
            self.sent_at[sequence] = now
            tally.sent += 1
            tally.lags.append(now - due)
        self.conn.send_binary(cast(bytes, data))  # picows sends a bytearray as it is


async def pace_voice(peers: Sequence[VoicePeer], start: float, until: float) -> None:
    """Frame k of caller i is due at start + k * 20 ms + i * 20 ms / N; every due frame
    is sent at once when the loop wakes (a late client shows in the send lag).

    Woken by a kernel timer (TimerPacer) where there is one: the loop's own timers have
    a resolution of 1 ms, the frames' spacing is 200 us at 100 callers, and waiting for it
    with asyncio.sleep spun the loop (a whole core at any caller count, 80% of it the
    spin). Elsewhere that busy loop is what paces."""
    pacer = TimerPacer.create(peers, start, until)
    if pacer is not None:
        await pacer.run()
        return
    count = len(peers)
    step = VOICE_FRAME_S / count
    index = 0
    while (due := start + index * step) < until:
        now = time.perf_counter()
        if due > now:
            await asyncio.sleep(due - now)
            now = time.perf_counter()
        while due <= now and due < until:
            peers[index % count].speak(due)
            index += 1
            due = start + index * step


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _timespec(seconds: float) -> _Timespec:
    whole = math.floor(seconds)
    return _Timespec(whole, round((seconds - whole) * 1e9))


class TimerPacer:
    """`pace_voice`'s schedule, woken by a Linux timerfd on CLOCK_MONOTONIC (the clock of
    time.perf_counter) every frame spacing (at least PACER_MIN_TICK) from `start`."""

    CLOCK_MONOTONIC = 1
    TFD_NONBLOCK = os.O_NONBLOCK
    TFD_CLOEXEC = os.O_CLOEXEC
    TFD_TIMER_ABSTIME = 1

    def __init__(self, fd: int, peers: Sequence[VoicePeer], start: float, until: float) -> None:
        self._fd = fd
        self._peers = peers
        self._start = start
        self._step = VOICE_FRAME_S / len(peers)
        self._index = 0
        self._until = until
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @classmethod
    def create(cls, peers: Sequence[VoicePeer], start: float, until: float) -> TimerPacer | None:
        if not peers or time.get_clock_info("perf_counter").implementation != (
            "clock_gettime(CLOCK_MONOTONIC)"
        ):
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.timerfd_create(cls.CLOCK_MONOTONIC, cls.TFD_NONBLOCK | cls.TFD_CLOEXEC)
        except (OSError, AttributeError):
            return None
        if fd < 0:
            return None
        pacer = cls(fd, peers, start, until)
        tick = max(pacer._step, PACER_MIN_TICK)
        spec = _Itimerspec(_timespec(tick), _timespec(start))
        if libc.timerfd_settime(fd, cls.TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            os.close(fd)
            return None
        return pacer

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self._fd, self._wake)
        try:
            await self._done
        finally:
            loop.remove_reader(self._fd)
            os.close(self._fd)

    def _wake(self) -> None:
        try:
            os.read(self._fd, 8)  # the expirations since the last read: not needed
        except BlockingIOError:
            return
        now = time.perf_counter()
        peers, count, step, start, until = (
            self._peers,
            len(self._peers),
            self._step,
            self._start,
            self._until,
        )
        index = self._index
        due = start + index * step
        while due <= now and due < until:
            peers[index % count].speak(due)
            index += 1
            due = start + index * step
        self._index = index
        if due >= until and not self._done.done():
            self._done.set_result(None)


@workload("voice")
async def voice(options: Options) -> dict[str, Any]:
    """`clients` callers for `warmup` + `seconds`, each a 20 ms frame every 20 ms.

    Says `ready` once connected; with stdin a pipe, starts on a line from it."""
    tally = VoiceTally()
    peers = [VoicePeer(tally) for _ in range(options.clients)]
    dialer = make_dialer(options.client, options.source)
    connect_errors = await open_all(dialer, options.url, peers, options.connect_concurrency)
    live = [p for p in peers if p.conn is not None and not p.closed]
    # Every call is started before any is timed: a call's start (its session opened in
    # the archive) is its own figure, not the relay's.
    for peer in live:
        peer.dial()
    await until(lambda: all(p.started.done() or p.closed for p in live), CONNECT_TIMEOUT)
    starts = sorted(p.started.result() for p in live if p.started.done())
    connect_errors += len(live) - len(starts)
    live = [p for p in live if p.started.done() and not p.closed]
    emit("ready", opened=len(live), connect_errors=connect_errors)
    # Processes of one run start together: when told on stdin (bench/run.py), else now.
    reader = await stdin_reader()
    if reader is not None:
        await next_line(reader, options.hold)
    start = time.perf_counter()
    tally.measure_from = start + options.warmup
    tally.measure_until = tally.measure_from + options.seconds
    if live:
        await pace_voice(live, start, tally.measure_until)
    await until(lambda: tally.echoed >= tally.sent, VOICE_DRAIN)
    echoed = tally.echoed  # what came back in time; later echoes are lost ones
    latencies = tally.latencies[:]
    dropped = sum(p.closed for p in live)  # closed by the server during the run
    tally.counting = False  # a bare server answers `hangup` with an error
    for peer in live:
        if peer.conn is not None and not peer.closed:
            peer.conn.send(HANGUP)  # the call ends now, not parked for a resume
    await close_all(peers)
    await dialer.aclose()
    lags = sorted(tally.lags)
    return {
        "callers": options.clients,
        "connect_errors": connect_errors,
        "dropped": dropped,
        "sent": tally.sent,
        "echoed": echoed,
        "lost": tally.sent - echoed,
        "echoes_in_window": tally.echoes_in_window,
        "errors": tally.errors,
        "samples": len(latencies),
        "lag_p99_ms": 1000 * percentile(lags, 0.99),
        "start_p50_ms": 1000 * percentile(starts, 0.50),
        "start_p99_ms": 1000 * percentile(starts, 0.99),
        **summarize_ms(latencies, "echo"),
    }


# -- session_stream: the stream workload on /v1/session ------------------------------------
#
# The client side of spec/sessions-protocol.md that a benchmark needs, and no more: `hello`
# once per connection, numbered `message`s, and acknowledgements as the spec asks of every
# client (after 16 unacknowledged server messages, or within 100 ms of the first of them),
# plus one at each `done`, so the server's resend buffer stays small.

ACK_EVERY = 16  # acknowledge after this many unacknowledged server messages...
ACK_WITHIN = 0.1  # ...or within this many seconds of the first of them
ACK_SWEEP = 0.02  # how often the 100 ms half of that rule is checked


class SessionTally(StreamTally):
    def __init__(self, scenario: str, max_turns: int) -> None:
        super().__init__(b"", max_turns)
        self.scenario = scenario
        self.acks = 0
        self.conn_errors = 0  # connection-level `error`s (each precedes a close)


class SessionStreamPeer(Peer):
    def __init__(self, tally: SessionTally) -> None:
        super().__init__()
        self.tally = tally
        self.seq = 0  # our last numbered message
        self.last = 0  # the last server seq handled
        self.unacked = 0
        self.unacked_since = 0.0

    def opened(self) -> None:
        assert self.conn is not None
        self.conn.send(hello_frame())

    def ack(self) -> None:
        if self.conn is not None and not self.closed:
            self.conn.send(ack_frame(self.last))
            self.tally.acks += 1
        self.unacked = 0

    def on_frame(self, payload: bytes | str) -> None:
        kind, seq = session_frame(payload)
        tally = self.tally
        if seq:  # numbered: chunk, done, a turn's error
            if seq <= self.last:
                return  # a duplicate (never on one connection; kept for the rule's sake)
            self.last = seq
            tally.frames += 1
            if kind in TERMINAL_KINDS:
                tally.turns += 1
                tally.errors += kind == "error"
                tally.busy -= 1
                self.ack()
                self.next_turn()
                return
            if not self.unacked:
                self.unacked_since = time.perf_counter()
            self.unacked += 1
            if self.unacked >= ACK_EVERY:
                self.ack()
        elif kind == "ready":
            if not self.connected.done():
                self.connected.set_result(None)
        elif kind == "error":  # connection-level: the server closes next
            tally.conn_errors += 1
        # `ack` (the server's for our messages) and `pong` need nothing.

    def next_turn(self) -> None:
        tally = self.tally
        if tally.sending and tally.sent < tally.max_turns and self.conn is not None:
            tally.sent += 1
            tally.busy += 1
            self.seq += 1
            self.conn.send(session_message_frame(self.seq, "bench", tally.scenario))

    def end(self) -> None:
        """Close the session on purpose (`end`): the server frees it and closes with 1000."""
        if self.conn is not None and not self.closed:
            self.seq += 1
            self.conn.send(end_frame(self.seq))


async def ack_timer(peers: Sequence[SessionStreamPeer]) -> None:
    """Acknowledge within ACK_WITHIN of the first unacknowledged message (until cancelled)."""
    due = ACK_WITHIN - ACK_SWEEP  # a sweep may come ACK_SWEEP late
    while True:
        await asyncio.sleep(ACK_SWEEP)
        now = time.perf_counter()
        for peer in peers:
            if peer.unacked and now - peer.unacked_since >= due:
                peer.ack()


async def end_all(peers: Sequence[SessionStreamPeer]) -> None:
    """`end` every session, then close what the server has not closed within CLOSE_TIMEOUT."""
    for peer in peers:
        peer.end()
    await until(lambda: all(p.closed or p.conn is None for p in peers), CLOSE_TIMEOUT)
    await close_all(peers)


@workload("session_stream")
async def session_stream(options: Options) -> dict[str, Any]:
    """`stream` on `/v1/session`: N sessions, each: message, read to `done`, ack, repeat."""
    tally = SessionTally(options.scenario, options.max_turns)
    peers = [SessionStreamPeer(tally) for _ in range(options.clients)]
    dialer = make_dialer(options.client)
    connect_errors = await open_all(dialer, options.url, peers, options.connect_concurrency)
    timer = asyncio.create_task(ack_timer(peers))
    await sleep_until(options.start_at)
    tally.sending = True
    for peer in peers:
        peer.next_turn()
    await asyncio.sleep(options.warmup)
    frames0, turns0, errors0, acks0, t0, cpu0 = (
        tally.frames,
        tally.turns,
        tally.errors,
        tally.acks,
        time.perf_counter(),
        time.process_time(),
    )
    await asyncio.sleep(options.seconds)
    frames1, turns1, errors1, acks1, t1, cpu1 = (
        tally.frames,
        tally.turns,
        tally.errors,
        tally.acks,
        time.perf_counter(),
        time.process_time(),
    )
    tally.sending = False
    drained = await until(lambda: tally.busy <= 0, DRAIN_TIMEOUT)
    timer.cancel()
    await end_all(peers)
    await dialer.aclose()
    elapsed = t1 - t0
    return {
        "clients": options.clients,
        "connect_errors": connect_errors,
        "window_s": elapsed,
        "frames_per_s": (frames1 - frames0) / elapsed,
        "turns_per_s": (turns1 - turns0) / elapsed,
        "acks_per_turn": (acks1 - acks0) / max(1, turns1 - turns0),
        "errors": errors1 - errors0 + tally.conn_errors,
        "drained": drained,
        "client_cpu_pct": 100 * (cpu1 - cpu0) / elapsed,
    }


# -- session_resume: how long a resume with a large backlog takes ---------------------------
#
# Per sample: open a session, send a message whose reply is `--backlog` numbered messages
# (a `longN` scenario), drop the connection at once (TCP FIN, no closing handshake, nothing
# read or acknowledged), wait until the server has ended the turn (so every message waits
# in its resend buffer), then on a fresh socket `hello` with the session id and
# `last_seq` 0, and time: reconnect start -> `ready`, and -> the backlog's `done`.
# bench/replicas.py runs the same samples in its process with the resume on another
# replica (`resume_url`), after that replica can read the whole backlog (`recorded`).

TURN_POLL = 0.01  # seconds between reads of the server's turn counter
TURNS_FAMILY = b"# TYPE portico_turns_total counter"
COMPLETED_TURNS = re.compile(rb'^portico_turns_total\{state="completed"\} (\S+)$', re.MULTILINE)


def turn_wait_bound(backlog: int) -> float:
    """The longest a `longN` turn may take with nobody connected: generous, but bounded."""
    return 10.0 + 0.005 * backlog


def fixed_turn_wait(backlog: int) -> float:
    """The wait when the server has no turn counter: about 3x a `longN` turn on 2 busy cores."""
    return 0.2 + 0.00005 * backlog


def sample_bound(backlog: int) -> float:
    """The longest one resume sample may take: its turn, two handshakes, the backlog."""
    return 2 * turn_wait_bound(backlog) + 2 * CLOSE_TIMEOUT


class ResumePeer(Peer):
    """One `/v1/session` connection: `hello`, then numbered messages up to a `done`."""

    def __init__(self, hello: bytes, *, acking: bool = True) -> None:
        super().__init__()
        self.hello = hello
        self.acking = acking  # False: acknowledge nothing (the connection about to drop)
        self.session_id = ""
        self.ready_at = 0.0
        self.done_at = 0.0
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # The dropped connection's `done` fails unawaited by design: nothing to report.
        self.done.add_done_callback(lambda future: future.cancelled() or future.exception())
        self.gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.received = 0
        self.last = 0
        self.unacked = 0

    def opened(self) -> None:
        assert self.conn is not None
        self.conn.send(self.hello)

    def on_frame(self, payload: bytes | str) -> None:
        kind, seq = session_frame(payload)
        if seq:
            if seq <= self.last:
                return
            self.received += 1
            self.last = seq
            self.unacked += 1
            if kind in TERMINAL_KINDS:
                self.done_at = time.perf_counter()
                self._ack()
                if not self.done.done():
                    self.done.set_result(kind)
            elif self.unacked >= ACK_EVERY:
                self._ack()
        elif kind == "ready":
            self.ready_at = time.perf_counter()
            self.session_id = ready_session_id(payload)
            if not self.connected.done():
                self.connected.set_result(None)
        elif kind == "error":
            failure = ConnectionError(f"server error: {payload[:200]!r}")
            for future in (self.connected, self.done):
                if not future.done():
                    future.set_exception(failure)

    def _ack(self) -> None:
        assert self.conn is not None
        if self.acking:
            self.conn.send(ack_frame(self.last))
        self.unacked = 0

    def on_closed(self) -> None:
        super().on_closed()
        if not self.done.done():
            self.done.set_exception(ConnectionError("closed before `done`"))
        if not self.gone.done():
            self.gone.set_result(None)

    async def wait_closed(self, within: float) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(self.gone), within)
        except TimeoutError:
            return False
        return True


class TurnCounter:
    """The server's count of completed turns, read from its /metrics over HTTP."""

    def __init__(self, ws_url: str) -> None:
        import aiohttp

        parts = urlsplit(ws_url)
        self.url = f"http://{parts.hostname}:{parts.port}/metrics"
        self._session = aiohttp.ClientSession()

    async def read(self) -> float | None:
        """Turns completed so far; None when the server exports no such counter."""
        async with self._session.get(self.url) as response:
            text = await response.read()
        match = COMPLETED_TURNS.search(text)
        if match is not None:
            return float(match[1])
        return 0.0 if TURNS_FAMILY in text else None  # no turn completed yet, or no counter

    async def wait_above(self, count: float | None, within: float, fixed: float) -> bool:
        """Poll until the count passes `count`, at most `within` seconds; True if it did.

        Without a counter (`count` None), sleep `fixed` seconds instead and return False.
        """
        if count is None:
            await asyncio.sleep(fixed)
            return False
        deadline = time.perf_counter() + within
        while time.perf_counter() < deadline:
            now = await self.read()
            if now is not None and now > count:
                return True
            await asyncio.sleep(TURN_POLL)
        return False

    async def aclose(self) -> None:
        await self._session.close()


async def open_peer(dialer: Dialer, url: str, peer: Peer) -> None:
    peer.conn = await dialer.connect(url, peer, peer.headers)
    peer.opened()
    await peer.connected


async def finish(peer: ResumePeer, seq: int) -> None:
    """`end` the session (its backlog is acknowledged already) and wait for the close."""
    if peer.conn is not None and not peer.closed:
        peer.conn.send(end_frame(seq))
        if not await peer.wait_closed(CLOSE_TIMEOUT):
            peer.conn.abort()


# Waits until the dropped session's backlog is where the resume reads it (the session
# id, at most `within` seconds); True if it got there.
Recorded = Callable[[str, float], Awaitable[bool]]


async def resume_sample(
    dialer: Dialer,
    url: str,
    counter: TurnCounter,
    options: Options,
    resume_url: str | None = None,
    recorded: Recorded | None = None,
) -> dict[str, float]:
    """One sample; `counter` reads the server at `url`, which runs the turn; the resume
    connects to `resume_url` (None: `url`), after `recorded` (None: the turn's end)."""
    # 1. A session with one long turn in flight and nobody connected.
    first = ResumePeer(hello_frame(), acking=False)
    await open_peer(dialer, url, first)
    assert first.conn is not None
    before = await counter.read()
    first.conn.send(session_message_frame(1, "bench", options.scenario))
    first.conn.drop()
    await first.wait_closed(CLOSE_TIMEOUT)
    dropped = time.perf_counter()
    # 2. The turn ends while the session is detached: its messages wait in the buffer.
    bound, fixed = turn_wait_bound(options.backlog), fixed_turn_wait(options.backlog)
    counted = await counter.wait_above(before, bound, fixed)
    if recorded is not None:
        counted = await recorded(first.session_id, bound) and counted
    waited = time.perf_counter() - dropped
    # 3. Resume from seq 0 on a fresh socket: everything is resent.
    peer = ResumePeer(hello_frame(first.session_id, last_seq=0))
    start = time.perf_counter()
    await open_peer(dialer, resume_url or url, peer)
    kind = await peer.done
    sample = {
        "ready_s": peer.ready_at - start,
        "done_s": peer.done_at - start,
        "received": peer.received,
        "last_seq": peer.last,
        "turn_wait_s": waited,
        "counted": counted,
        "error": kind == "error" or peer.last != options.backlog,
    }
    await finish(peer, seq=2)
    return sample


@workload("session_resume")
async def session_resume(options: Options) -> dict[str, Any]:
    """`--samples` resumes (after `--warm` unmeasured ones), one session at a time."""
    return await resume_samples(options)


async def resume_samples(
    options: Options,
    resume_url: str | None = None,
    recorded: Recorded | None = None,
    within: float = math.inf,
) -> dict[str, Any]:
    """session_resume's samples and figures; `resume_url`, `recorded`: resume_sample's;
    no sample starts after `within` seconds."""
    dialer = make_dialer(options.client)
    counter = TurnCounter(options.url)
    samples: list[dict[str, float]] = []
    errors = 0
    stop_at = time.perf_counter() + within
    try:
        for index in range(options.warm + options.samples):
            if time.perf_counter() > stop_at:
                break
            try:
                async with asyncio.timeout(sample_bound(options.backlog)):
                    sample = await resume_sample(
                        dialer, options.url, counter, options, resume_url, recorded
                    )
            except (TimeoutError, ConnectionError, OSError) as exc:
                emit("sample_failed", index=index, reason=repr(exc)[:300])
                errors += 1
                continue
            errors += bool(sample["error"])
            if index >= options.warm:
                samples.append(sample)
    finally:
        await counter.aclose()
        await dialer.aclose()
    good = [s for s in samples if not s["error"]]
    return {
        "scenario": options.scenario,
        "backlog": options.backlog,
        "samples": len(good),
        "warm": options.warm,
        "errors": errors,
        "received_min": min((s["received"] for s in samples), default=0),
        "fixed_wait": sum(not s["counted"] for s in samples),
        "turn_wait_p50_ms": 1000 * percentile(sorted(s["turn_wait_s"] for s in samples), 0.5),
        **summarize_ms([s["ready_s"] for s in good], "ready"),
        **summarize_ms([s["done_s"] for s in good], "done"),
    }


# -- rpc_latency, rpc_pages: Portico's /v1/rpc (spec/rpc-protocol.md) -----------------------
#
# A `/v1/rpc` connection speaks first (`connect`, with its user's token when the server
# has authentication on), then sends requests by id; replies come by id. The server also
# pushes every change of its user's sessions: `update` frames (persisted entities, in
# order) and `live` frames (a reply's chunks, lossy). A turn's first chunk is the first
# `live` of its session after the send; its end, an update whose turn has a terminal status.
# Each user's pushes go to every connection of that user: a pool that shares one user gets
# every turn of the pool on every connection, so rpc_latency gives each connection a user
# of its own (`--users`) where the server has them.

RUN_TAG = uuid.uuid4().hex[:12]  # in client_ids, which must be unique per user across runs
# Replies the fill has not seen yet, at most: one of the running turn, one of the turn
# the sends waiting behind it merge into. The fill stops this short of its target.
FILL_MARGIN = 2
PAGE_SEED = 20240601  # rpc_pages: the same cursors in every run
PAGE_BOUND = 1.0  # seconds one page may take, for the load generator's overall bound


def fill_bound(messages: int) -> float:
    """The longest filling a session with `messages` may take: generous, but bounded."""
    return 30.0 + 0.02 * messages


class RpcPeer(Peer):
    """A `/v1/rpc` connection; subclasses handle pushes and replies."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0
        self.frame_errors = 0  # frame-level `error`s (a malformed request) after `connected`

    def opened(self) -> None:
        assert self.conn is not None
        self.conn.send(rpc_connect_frame(self.token))

    def next_id(self) -> str:
        self.requests += 1
        return f"r{self.requests}"

    def on_frame(self, payload: bytes | str) -> None:
        now = time.perf_counter()
        frame = rpc_frame(payload)
        kind = frame.type
        if kind == "live":
            assert frame.live is not None
            self.on_live(frame.live, now)
        elif kind == "update":
            assert frame.update is not None
            self.on_update(frame.update, now)
        elif frame.id:
            self.on_reply(frame, now)
        elif kind == "connected":
            if not self.connected.done():
                self.connected.set_result(None)
        elif kind == "error":
            if not self.connected.done():
                self.connected.set_exception(ConnectionError(f"refused: {payload[:200]!r}"))
            self.frame_errors += 1
        # `gap` needs nothing: a first connect replays nothing.

    def on_live(self, live: RpcLive, now: float) -> None:
        return None

    def on_update(self, update: RpcUpdate, now: float) -> None:
        return None

    def on_reply(self, frame: RpcFrame, now: float) -> None:
        return None


class RpcLatencyPeer(RpcPeer):
    """One connection, one session (its first send makes it), one turn at a time."""

    def __init__(
        self, index: int, scenario: str, done: Callable[[RpcLatencyPeer, bool], None]
    ) -> None:
        super().__init__()
        self._done = done
        self.scenario = scenario
        self.client_prefix = f"{RUN_TAG}-{index}-"
        self.session_id = ""
        self.client_id = ""
        self.request_id = ""
        self.busy = False
        self.sent_at = self.ended_at = 0.0
        self.reply_at: float | None = None
        self.running_at: float | None = None
        self.first_at: float | None = None

    def send(self) -> None:
        assert self.conn is not None
        self.request_id = self.next_id()
        self.client_id = self.client_prefix + self.request_id
        frame = rpc_send_frame(self.request_id, self.client_id, self.scenario, self.session_id)
        self.busy = True
        self.reply_at = self.running_at = self.first_at = None
        self.sent_at = time.perf_counter()
        self.conn.send(frame)

    def on_live(self, live: RpcLive, now: float) -> None:
        if self.busy and self.first_at is None and live.session_id == self.session_id:
            self.first_at = now

    def on_update(self, update: RpcUpdate, now: float) -> None:
        if not self.busy:
            return
        for item, data in zip(update.items, update.data_list, strict=True):
            if item.entity == "message":
                if not self.session_id and data.client_id == self.client_id:
                    # The first send's session: known before any chunk, whose `live` frames
                    # wait for the assistant message's `created`, an update after this one.
                    self.session_id = data.session_id
            elif item.entity == "turn" and self.session_id == data.session_id:
                if data.status == "running" and self.running_at is None:
                    self.running_at = now
                elif data.status in RPC_TURN_ENDS:
                    self._end(now, failed=data.status != "completed")
                    return

    def on_reply(self, frame: RpcFrame, now: float) -> None:
        if frame.id != self.request_id or not self.busy:
            return
        self.reply_at = now
        if frame.error:
            self._end(now, failed=True)  # refused: no turn runs
        elif not self.session_id:
            self.session_id = rpc_send_result(frame).session_id

    def _end(self, now: float, *, failed: bool) -> None:
        self.busy = False
        self.ended_at = now
        self._done(self, failed)


@workload("rpc_latency")
async def rpc_latency(options: Options) -> dict[str, Any]:
    """`latency` on `/v1/rpc`: `rate` sends/s, each on a pooled connection whose last turn
    ended; times send -> reply, -> turn `running`, -> first `live` chunk, -> turn end."""
    samples: dict[str, list[float]] = {"reply": [], "running": [], "first": [], "done": []}
    pacer = OpenLoop()
    errors = 0

    def done(peer: RpcLatencyPeer, failed: bool) -> None:
        nonlocal errors
        if not pacer.measured(peer):
            return
        if failed or peer.first_at is None or peer.reply_at is None or peer.running_at is None:
            errors += 1
            return
        samples["reply"].append(peer.reply_at - peer.sent_at)
        samples["running"].append(peer.running_at - peer.sent_at)
        samples["first"].append(peer.first_at - peer.sent_at)
        samples["done"].append(peer.ended_at - peer.sent_at)

    peers = [RpcLatencyPeer(i, options.scenario, done) for i in range(options.pool)]
    drained = await pacer.run(peers, options, lambda peer: peer.send())
    figures: dict[str, float] = {}
    for stage, values in samples.items():
        figures.update(summarize_ms(values, stage))
    return {
        "rate": options.rate,
        "pool": options.pool,
        "users": options.users,
        "connect_errors": pacer.connect_errors,
        "sent": pacer.sent,
        "missed": pacer.missed,
        "samples": len(samples["done"]),
        "errors": errors + sum(p.frame_errors for p in peers) + (not drained),
        **figures,
    }


class RpcSessionPeer(RpcPeer):
    """One connection filling one session and reading it back: requests awaited by id."""

    def __init__(self) -> None:
        super().__init__()
        self.replies: dict[str, asyncio.Future[tuple[float, RpcFrame]]] = {}
        self.first_client_id = ""
        self.session_id = ""
        self.messages = 0  # the highest global_offset seen in the session
        self.replies_seen = 0  # assistant messages created in the session
        self.open_turns: set[str] = set()
        self.failed_turns = 0

    def request(self, frame: Callable[[str], bytes]) -> asyncio.Future[tuple[float, RpcFrame]]:
        """Send `frame(request_id)`; the future gets (arrival time, reply)."""
        assert self.conn is not None
        request_id = self.next_id()
        reply = asyncio.get_running_loop().create_future()
        self.replies[request_id] = reply
        self.conn.send(frame(request_id))
        return reply

    def send(self, scenario: str) -> asyncio.Future[tuple[float, RpcFrame]]:
        client_id = f"{RUN_TAG}-fill-{self.requests + 1}"
        self.first_client_id = self.first_client_id or client_id
        return self.request(lambda rid: rpc_send_frame(rid, client_id, scenario, self.session_id))

    def on_reply(self, frame: RpcFrame, now: float) -> None:
        reply = self.replies.pop(frame.id, None)
        if reply is not None and not reply.done():
            reply.set_result((now, frame))

    def on_update(self, update: RpcUpdate, now: float) -> None:
        for item, data in zip(update.items, update.data_list, strict=True):
            if item.entity == "message":
                if not self.session_id and data.client_id == self.first_client_id:
                    self.session_id = data.session_id
                if data.session_id != self.session_id or not self.session_id:
                    continue
                self.messages = max(self.messages, data.global_offset)
                self.replies_seen += item.action == "created" and data.role == "assistant"
            elif item.entity == "turn" and data.session_id == self.session_id:
                if data.status in RPC_TURN_ENDS:
                    self.open_turns.discard(data.id)
                    self.failed_turns += data.status in RPC_TURN_FAILURES
                else:
                    self.open_turns.add(data.id)

    def on_closed(self) -> None:
        super().on_closed()
        for reply in self.replies.values():
            if not reply.done():
                reply.set_exception(ConnectionError("closed before the reply"))


async def settle(peer: RpcSessionPeer, within: float) -> bool:
    """Wait until every request has its reply and every turn of the session has ended."""
    return await until(lambda: not peer.replies and not peer.open_turns, within)


async def fill_session(peer: RpcSessionPeer, target: int, bound: float) -> dict[str, Any]:
    """Make a session of `target` messages (or one or two more) through `v1.message.send`.

    The first send makes the session; then up to FILL_WINDOW sends stay in flight. Each
    stores a user message; the sends that arrive while a turn runs wait and merge into one
    turn, which adds one assistant reply. The fill stops FILL_MARGIN short (replies not seen
    yet), waits for every turn to end, and tops up with single sends (+2 messages each).
    """
    start = time.perf_counter()
    deadline = start + bound
    errors = 0
    sends = 0

    async def count(replies: set[asyncio.Future[tuple[float, RpcFrame]]]) -> None:
        nonlocal errors
        for reply in replies:
            _, frame = await reply
            errors += bool(frame.error)

    _, first = await peer.send(FILL_SCENARIO)
    sends += 1
    if first.error:
        raise ConnectionError(f"the first send failed: {bytes(first.error)[:200]!r}")
    peer.session_id = peer.session_id or rpc_send_result(first).session_id
    in_flight: set[asyncio.Future[tuple[float, RpcFrame]]] = set()
    while sends + peer.replies_seen + FILL_MARGIN < target and time.perf_counter() < deadline:
        if len(in_flight) >= FILL_WINDOW:
            finished, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            await count(finished)
            continue
        in_flight.add(peer.send(FILL_SCENARIO))
        sends += 1
    await count(in_flight)
    settled = await settle(peer, max(0.0, deadline - time.perf_counter()))
    while settled and peer.messages < target and time.perf_counter() < deadline:
        _, frame = await peer.send(FILL_SCENARIO)
        sends += 1
        errors += bool(frame.error)
        settled = await settle(peer, max(0.0, deadline - time.perf_counter()))
    return {
        "messages": peer.messages,
        "sends": sends,
        "replies": peer.replies_seen,
        "fill_s": time.perf_counter() - start,
        "fill_errors": errors + peer.failed_turns + (not settled),
    }


@workload("rpc_pages")
async def rpc_pages(options: Options) -> dict[str, Any]:
    """Fill one session with `--messages` messages through `v1.message.send`, then time
    `--samples` `v1.message.list` pages of PAGE_SIZE at random cursors, one at a time
    (after `--warm` unmeasured ones), on the same connection."""
    dialer = make_dialer(options.client)
    peer = RpcSessionPeer()
    assign_users([peer], options.users)
    try:
        await open_peer(dialer, options.url, peer)
        filled = await fill_session(peer, options.messages, fill_bound(options.messages))
        rng = random.Random(PAGE_SEED)
        highest = max(0, filled["messages"] - PAGE_SIZE)
        times: list[float] = []
        errors = 0
        for index in range(options.warm + options.samples):
            cursor = rng.randint(0, highest)
            start = time.perf_counter()
            page_of = functools.partial(
                rpc_list_frame, session_id=peer.session_id, cursor=cursor, limit=PAGE_SIZE
            )
            arrived, frame = await peer.request(page_of)
            if frame.error:
                errors += 1
                continue
            page = rpc_page(frame)
            whole = len(page.items) == PAGE_SIZE and page.items[0].global_offset == cursor + 1
            errors += not whole
            if whole and index >= options.warm:
                times.append(arrived - start)
        if peer.conn is not None:
            await close_all([peer])
    finally:
        await dialer.aclose()
    return {
        **filled,
        "page_size": PAGE_SIZE,
        "samples": len(times),
        "warm": options.warm,
        "errors": errors + filled["fill_errors"] + peer.frame_errors,
        **summarize_ms(times, "page"),
    }


# -- command line --------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> tuple[str, Options]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--url", required=True, help="ws://127.0.0.1:PORT/ws (loopback only)")
    parser.add_argument("--clients", type=int, default=100, help="stream: concurrent clients")
    parser.add_argument("--seconds", type=float, default=5.0, help="measurement window")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before the window")
    parser.add_argument("--start-at", type=float, help="wall-clock time to start sending")
    parser.add_argument("--scenario", default="stream50", help="the script's scenario")
    parser.add_argument("--max-turns", type=int, default=10_000_000, help="count bound")
    parser.add_argument("--rate", type=float, default=200.0, help="latency: messages/s")
    parser.add_argument("--pool", type=int, default=32, help="latency: connections")
    parser.add_argument("--count", type=int, default=1000, help="idle: connections")
    parser.add_argument("--hold", type=float, default=120.0, help="idle: longest hold, seconds")
    parser.add_argument(
        "--warm",
        type=int,
        default=0,
        help="idle: connections to cycle first; session_resume, rpc_pages: unmeasured "
        "samples first",
    )
    parser.add_argument(
        "--samples", type=int, default=20, help="session_resume: resumes timed; rpc_pages: pages"
    )
    parser.add_argument(
        "--backlog", type=int, default=1000, help="session_resume: messages the scenario sends"
    )
    parser.add_argument(
        "--users",
        type=int,
        default=0,
        help="connection i authenticates as bench user i mod N (bench_token); 0: no token",
    )
    parser.add_argument(
        "--messages", type=int, default=10_000, help="rpc_pages: messages in the session"
    )
    parser.add_argument("--connect-concurrency", type=int, default=64)
    parser.add_argument("--client", choices=["auto", "picows", "aiohttp"], default="auto")
    parser.add_argument(
        "--source", help="idle, voice: connect from this 127.x.y.z address (ephemeral ports)"
    )
    args = parser.parse_args(argv)
    host = urlsplit(args.url).hostname
    if host not in LOOPBACK:
        parser.error(f"refusing to load {host!r}: the benchmark talks to loopback only")
    if args.source is not None and not args.source.startswith("127."):
        parser.error(f"refusing source {args.source!r}: loopback (127.0.0.0/8) only")
    fields = {name: getattr(args, name) for name in Options.__dataclass_fields__}
    fields["client"] = resolve_client(args.client)
    return args.workload, Options(**fields)


def time_bound(options: Options) -> float:
    """The most any workload may take: its windows, its connects, its hold, and slack."""
    waited = 0.0 if options.start_at is None else max(0.0, options.start_at - time.time())
    return (
        waited
        + options.warmup
        + options.seconds
        + options.hold
        + 2 * CONNECT_TIMEOUT
        + CLOSE_TIMEOUT
    )


async def main(argv: Sequence[str] | None = None) -> None:
    name, options = parse_args(argv)
    raise_fd_limit()
    bound = time_bound(options)
    if name == "session_resume":
        bound += (options.warm + options.samples) * sample_bound(options.backlog)
    elif name == "rpc_pages":
        bound += fill_bound(options.messages) + (options.warm + options.samples) * PAGE_BOUND
    async with asyncio.timeout(bound):
        result = await WORKLOADS[name](options)
    emit("result", workload=name, client=options.client, **result)


if __name__ == "__main__":
    uvloop.run(main())
