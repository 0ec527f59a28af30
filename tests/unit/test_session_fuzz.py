"""Property tests for `/v1/session`: fuzzed input, and exactly-once across a lossy network.

Everything runs in memory: two `SessionConnection`s per connection, two `Channel`s per session,
and a network this file controls (drops, duplicates, reordering, reconnects). Time is a number.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from portico.protocols.session import frames as f
from portico.protocols.session.channel import Channel
from portico.protocols.session.connection import (
    HelloReceived,
    PeerDead,
    ReadyReceived,
    Received,
    Role,
    SessionConnection,
    State,
    Timing,
)

TIMING = Timing(
    ack_delay=0.1,
    ack_every=3,
    heartbeat_interval=15.0,
    dead_after=2.5,
    idle_timeout=45.0,
    max_send_queue_bytes=10_000_000,
)


def fast(examples: int) -> settings:
    return settings(
        max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


def new_channel() -> Channel:
    return Channel(max_messages=1000, max_bytes=10_000_000)


def ready_frame(session_id: str, last_seq: int, resumed: bool) -> f.Ready:
    return f.Ready(
        session_id=session_id,
        resumed=resumed,
        last_seq=last_seq,
        capabilities=("resume",),
        heartbeat_ms=15000,
        resume_window_ms=30000,
    )


# -- fuzz: any input gets a defined answer, never an exception ---------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
frame_types = st.sampled_from(
    [
        "hello",
        "ready",
        "ack",
        "ping",
        "pong",
        "message",
        "tool_call_ack",
        "tool_call_nack",
        "tool_result",
        "context",
        "interrupt",
        "end",
        "chunk",
        "done",
        "tool_call",
        "transcript",
        "error",
        "audio_start",
        "x",
    ]
)
field_names = st.sampled_from(
    [
        "seq",
        "last_seq",
        "session_id",
        "protocol",
        "resumed",
        "capabilities",
        "heartbeat_ms",
        "resume_window_ms",
        "content",
        "parts",
        "metadata",
        "call_id",
        "result",
        "error",
        "reason",
        "context",
        "turn_id",
        "tool_call",
        "role",
        "text",
        "tools",
        "audio",
        "credential",
    ]
)
small_ints = st.integers(min_value=-2, max_value=6)
frames = st.builds(
    lambda kind, body, seq: {"type": kind, **body, **({"seq": seq} if seq is not None else {})},
    frame_types,
    st.dictionaries(field_names, json_values | small_ints, max_size=4),
    st.none() | small_ints,
)
inputs = (
    st.binary(max_size=64)
    | st.text(max_size=64)
    | json_values.map(json.dumps)
    | frames.map(json.dumps)
    | frames.map(lambda frame: json.dumps(frame).encode())
)
STATES = ["server_await_hello", "server_open", "client_await_ready", "client_open"]


def connection_in(state: str) -> SessionConnection:
    role = Role.SERVER if state.startswith("server") else Role.CLIENT
    conn = SessionConnection(role=role, timing=TIMING, now=0.0)
    channel = new_channel()
    channel.send(f.Chunk(seq=0, turn_id="t", content="x"))  # so ack 1 and ready.last_seq 1 are fine
    if state == "server_open":
        conn.receive_text(f.encode(f.Hello()), 0.0)
        conn.accept(channel, ready_frame("s-1", 0, False), 0)
    elif state.startswith("client"):
        conn.start(f.Hello(), channel)
        if state == "client_open":
            conn.receive_text(f.encode(ready_frame("s-1", 0, False)), 0.0)
    conn.data_to_send()
    return conn


def feed(conn: SessionConnection, data: str | bytes, now: float) -> None:
    """Any input: events and harmless answers, or one unnumbered PROTOCOL_ERROR and a 4400."""
    closed_before = conn.close_request is not None
    handled_before = conn.channel.handled if conn.channel is not None else 0
    events = conn.receive_text(data, now)
    written = [json.loads(frame) for frame in conn.data_to_send()]
    if closed_before:
        assert events == []
        assert written == []
        return
    if conn.close_request is not None:
        assert events == []
        assert conn.close_request == (4400, "PROTOCOL_ERROR")
        assert conn.state is State.CLOSED
        assert len(written) == 1
        assert written[0]["type"] == "error"
        assert written[0]["error"]["code"] == "PROTOCOL_ERROR"
        assert "seq" not in written[0]
        return
    assert all(frame["type"] in ("ack", "pong") for frame in written), written
    fresh = 0
    for event in events:
        assert isinstance(event, HelloReceived | ReadyReceived | Received)
        if isinstance(event, Received) and getattr(event.frame, "seq", None) is not None:
            fresh += 1
    assert len(events) <= 1
    handled_after = conn.channel.handled if conn.channel is not None else 0
    assert handled_after - handled_before == fresh


@fast(100)
@given(state=st.sampled_from(STATES), data=inputs)
def test_any_single_input_gets_a_defined_answer(state: str, data: str | bytes) -> None:
    feed(connection_in(state), data, 1.0)


@fast(40)
@given(state=st.sampled_from(STATES), data=st.lists(inputs, max_size=8))
def test_any_sequence_of_inputs_gets_a_defined_answer(state: str, data: list[str | bytes]) -> None:
    conn = connection_in(state)
    for i, item in enumerate(data):
        feed(conn, item, 1.0 + i)
        assert conn.on_timer(1.0 + i + 0.1) in ([], [PeerDead()])
        due = [json.loads(frame)["type"] for frame in conn.data_to_send()]
        assert set(due) <= {"ack", "ping"}


@fast(100)
@given(
    state=st.sampled_from(["server_open", "client_open"]),
    seqs=st.lists(st.integers(min_value=-3, max_value=8), max_size=20),
)
def test_numbered_frames_in_any_order_take_effect_once_or_close(
    state: str, seqs: list[int]
) -> None:
    """Duplicates vanish, the next seq is received, a gap closes 4400: once each, in order."""
    conn = connection_in(state)
    received: list[int] = []
    for seq in seqs:
        if state == "server_open":
            data = f.encode(f.Message(seq=seq, content=str(seq)))
        else:
            data = f.encode(f.Chunk(seq=seq, turn_id="t", content=str(seq)))
        events = conn.receive_text(data, 1.0)
        received += [event.frame.seq for event in events if isinstance(event, Received)]  # type: ignore[union-attr]
        if conn.close_request is not None:
            assert conn.close_request == (4400, "PROTOCOL_ERROR")
            break
    assert received == list(range(1, len(received) + 1))


# -- full duplex: exactly-once across drops, duplicates, reordering and resumes --------------


class Network:
    """One client and one server session, joined by a connection this test breaks at will."""

    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        self.now = 0.0
        self.client_channel = new_channel()
        self.server_channel: Channel | None = None  # created by the first hello
        self.session_id: str | None = None  # what the client knows, from ready
        self.sessions = 0
        self.client_sent = 0
        self.server_sent = 0
        self.client_got: list[str] = []
        self.server_got: list[str] = []
        self.client_errors: list[str] = []
        self.c2s: list[bytes] = []
        self.s2c: list[bytes] = []
        self.history: dict[str, list[bytes]] = {"c2s": [], "s2c": []}
        self.connections = 0
        self.connect()

    # -- wiring -----------------------------------------------------------------------------

    def connect(self) -> None:
        self.c2s.clear()
        self.s2c.clear()
        self.client = SessionConnection(role=Role.CLIENT, timing=self.timing, now=self.now)
        self.server = SessionConnection(role=Role.SERVER, timing=self.timing, now=self.now)
        if self.session_id is None:
            hello = f.Hello()
        else:
            hello = f.Hello(session_id=self.session_id, last_seq=self.client_channel.handled)
        self.client.start(hello, self.client_channel)
        self.connections += 1
        self.collect()

    def collect(self) -> None:
        for wire, name, conn in ((self.c2s, "c2s", self.client), (self.s2c, "s2c", self.server)):
            for data in conn.data_to_send():
                wire.append(data)
                value = json.loads(data)
                if value.get("seq") is not None and value["type"] != "ack":
                    self.history[name].append(data)

    @property
    def broken(self) -> bool:
        return self.client.state is State.CLOSED or self.server.state is State.CLOSED

    def settle_close(self) -> None:
        """A side closed: what it queued before its close still arrives, then reconnect."""
        while self.broken:
            self.collect()
            if self.server.state is State.CLOSED:
                while self.s2c and self.client.state is not State.CLOSED:
                    self.to_client(self.s2c.pop(0))
            if self.client.state is State.CLOSED:
                while self.c2s and self.server.state is not State.CLOSED:
                    self.to_server(self.c2s.pop(0))
            self.connect()

    # -- the two applications ---------------------------------------------------------------

    def to_server(self, data: bytes) -> None:
        for event in self.server.receive_text(data, self.now):
            if isinstance(event, HelloReceived):
                hello = event.hello
                if hello.session_id is None:
                    # The client never saw ready: it opens a new session.
                    assert self.client_channel.handled == 0
                    assert self.client_got == []
                    assert self.server_got == []
                    # Frames of the abandoned session cannot reach the new one's connection.
                    stale = {*self.history["c2s"], *self.history["s2c"]}
                    self.c2s[:] = [data for data in self.c2s if data not in stale]
                    self.s2c[:] = [data for data in self.s2c if data not in stale]
                    self.sessions += 1
                    self.server_channel = new_channel()
                    self.server_sent = 0
                    self.history = {"c2s": [], "s2c": []}
                    session_id = f"s-{self.sessions}"
                else:
                    session_id = hello.session_id
                assert self.server_channel is not None
                ready = ready_frame(
                    session_id, self.server_channel.handled, hello.session_id is not None
                )
                peer_last_seq = hello.last_seq if hello.session_id else 0
                self.server.accept(self.server_channel, ready, peer_last_seq)
            elif isinstance(event, Received):
                assert isinstance(event.frame, f.Message)
                self.server_got.append(event.frame.content or "")
            else:  # pragma: no cover - the server role has no other event
                raise AssertionError(event)

    def to_client(self, data: bytes) -> None:
        for event in self.client.receive_text(data, self.now):
            if isinstance(event, ReadyReceived):
                self.session_id = event.ready.session_id
            elif isinstance(event, Received):
                frame = event.frame
                if isinstance(frame, f.Error) and frame.seq is None:
                    self.client_errors.append(frame.error.code)
                else:
                    assert isinstance(frame, f.Chunk)
                    self.client_got.append(frame.content)

    def client_send(self) -> None:
        self.client_sent += 1
        self.client.send(f.Message(seq=0, content=f"c{self.client_sent}"))

    def server_send(self) -> None:
        if self.server_channel is None:
            return  # no session yet: no turn can run
        self.server_sent += 1
        data = self.server_channel.send(f.Chunk(seq=0, turn_id="t", content=f"s{self.server_sent}"))
        if self.server.channel is self.server_channel:
            self.server.write_numbered(data)  # what the adapter does on a turn event

    def tick(self, dt: float) -> None:
        self.now += dt
        self.client.on_timer(self.now)
        self.server.on_timer(self.now)

    # -- checks -----------------------------------------------------------------------------

    def check_prefixes(self) -> None:
        """At every step: each side got a prefix of what the other sent, each message once."""
        expected_server = [f"c{i}" for i in range(1, self.client_sent + 1)]
        expected_client = [f"s{i}" for i in range(1, self.server_sent + 1)]
        assert self.server_got == expected_server[: len(self.server_got)]
        assert self.client_got == expected_client[: len(self.client_got)]

    def heal(self) -> None:
        """No more faults: deliver everything, let the acks go out, until both sides are even."""
        limit = self.connections + 20  # a bug can make every resume fail: never spin forever
        for _ in range(100):
            self.settle_close()
            while self.c2s or self.s2c:
                assert self.connections < limit, "every resume failed"
                if self.c2s:
                    self.to_server(self.c2s.pop(0))
                if self.s2c:
                    self.to_client(self.s2c.pop(0))
                self.collect()
                self.settle_close()
                self.check_prefixes()
            quiet = (
                self.client.state is State.OPEN
                and self.server.state is State.OPEN
                and self.client_channel.buffered == (0, 0)
                and self.server_channel is not None
                and self.server_channel.buffered == (0, 0)
            )
            if quiet:
                return
            self.tick(self.timing.ack_delay)
            self.collect()
        raise AssertionError("the network never settled")


TRAFFIC: list[tuple[Any, ...]] = [
    ("client_send",),
    ("server_send",),
    ("deliver", "c2s", 1),
    ("deliver", "s2c", 1),
    ("client_send",),
    ("server_send",),
    ("deliver", "c2s", 4),
    ("deliver", "s2c", 4),
    ("tick", 0.05),
    ("tick", 0.1),
]
FAULTS: list[tuple[Any, ...]] = [
    ("drop",),
    ("duplicate", "c2s"),
    ("duplicate", "s2c"),
    ("drop",),
    ("swap", "c2s"),
    ("swap", "s2c"),
    ("drop",),
    ("replay", "c2s", 0),
    ("replay", "s2c", 0),
    ("drop",),
    ("replay", "c2s", -1),
    ("replay", "s2c", -1),
    ("replay", "c2s", 3),
    ("replay", "s2c", 3),
    ("tick", 1.0),
    ("tick", 16.0),
    ("tick", 50.0),
]
# Mostly traffic, now and then a fault. One draw for the whole script keeps generation cheap;
# shrinking heads for shorter scripts and the first entries: plain traffic.
STEPS = [*TRAFFIC, *TRAFFIC, *TRAFFIC, *TRAFFIC, *FAULTS]
actions = st.binary(min_size=20, max_size=150).map(
    lambda script: [STEPS[byte % len(STEPS)] for byte in script]
)
MAX_MESSAGES = 30
MAX_DROPS = 5
MAX_OTHER_FAULTS = 6


def run(network: Network, steps: list[tuple[Any, ...]]) -> None:
    drops = faults = 0
    for step in steps:
        match step:
            case ("client_send",) if network.client_sent < MAX_MESSAGES:
                network.client_send()
            case ("server_send",) if network.server_sent < MAX_MESSAGES:
                network.server_send()
            case ("deliver", "c2s", count):
                for _ in range(min(count, len(network.c2s))):
                    network.to_server(network.c2s.pop(0))
            case ("deliver", "s2c", count):
                for _ in range(min(count, len(network.s2c))):
                    network.to_client(network.s2c.pop(0))
            case ("tick", dt):
                network.tick(dt)
            case ("drop",) if drops < MAX_DROPS:
                drops += 1
                network.connect()  # whatever was in flight is lost
            case ("duplicate", direction) if faults < MAX_OTHER_FAULTS:
                wire = getattr(network, direction)
                if wire:
                    faults += 1
                    wire.insert(0, wire[0])
            case ("swap", direction) if faults < MAX_OTHER_FAULTS:
                wire = getattr(network, direction)
                if len(wire) >= 2:
                    faults += 1
                    wire[0], wire[1] = wire[1], wire[0]
            case ("replay", direction, index) if faults < MAX_OTHER_FAULTS:
                old = network.history[direction]
                if old:
                    faults += 1
                    getattr(network, direction).insert(0, old[index % len(old)])
            case _:
                pass
        network.collect()
        network.settle_close()
        network.check_prefixes()
    network.heal()
    assert network.server_got == [f"c{i}" for i in range(1, network.client_sent + 1)]
    assert network.client_got == [f"s{i}" for i in range(1, network.server_sent + 1)]
    assert set(network.client_errors) <= {"PROTOCOL_ERROR"}  # never RESUME_FAILED


SEND_ALL = [("client_send",), ("server_send",)] * 3


@fast(200)
@given(ack_every=st.sampled_from([1, 3, 16]), steps=actions)
@example(ack_every=3, steps=[])
@example(ack_every=3, steps=[*SEND_ALL, ("drop",), *SEND_ALL])
@example(  # the first ready is lost: the client opens a new session and resends
    ack_every=3, steps=[("client_send",), ("deliver", "c2s", 1), ("drop",)]
)
@example(  # a resend crosses the ack that would have made it unnecessary
    ack_every=16,
    steps=[
        ("deliver", "c2s", 1),
        ("deliver", "s2c", 1),
        *SEND_ALL,
        ("deliver", "c2s", 4),
        ("deliver", "s2c", 4),
        ("tick", 0.1),
        ("drop",),
        ("client_send",),
        ("server_send",),
    ],
)
@example(  # out-of-order delivery closes 4400, the resume repairs it
    ack_every=3,
    steps=[
        ("deliver", "c2s", 1),
        ("deliver", "s2c", 1),
        ("server_send",),
        ("server_send",),
        ("swap", "s2c"),
        ("deliver", "s2c", 2),
    ],
)
@example(  # a stale duplicate from an earlier connection is discarded
    ack_every=3,
    steps=[
        ("deliver", "c2s", 1),
        ("deliver", "s2c", 1),
        ("client_send",),
        ("deliver", "c2s", 1),
        ("drop",),
        ("deliver", "c2s", 1),
        ("deliver", "s2c", 1),
        ("replay", "c2s", 0),
        ("deliver", "c2s", 1),
        ("client_send",),
    ],
)
@example(  # silence: server idle close and client PeerDead, then resume
    ack_every=3, steps=[*SEND_ALL, ("tick", 50.0), *SEND_ALL, ("tick", 16.0), ("tick", 50.0)]
)
def test_every_numbered_message_arrives_exactly_once_in_order(
    ack_every: int, steps: list[tuple[Any, ...]]
) -> None:
    timing = Timing(
        ack_delay=TIMING.ack_delay,
        ack_every=ack_every,
        heartbeat_interval=TIMING.heartbeat_interval,
        dead_after=TIMING.dead_after,
        idle_timeout=TIMING.idle_timeout,
        max_send_queue_bytes=TIMING.max_send_queue_bytes,
    )
    run(Network(timing), steps)


def test_a_quiet_network_needs_one_connection() -> None:
    network = Network(TIMING)
    run(network, [*SEND_ALL, ("deliver", "c2s", 4), ("deliver", "s2c", 4)])
    assert network.connections == 1
    assert network.client_errors == []
