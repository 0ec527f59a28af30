"""Prometheus metrics, one registry per server (so in-process test servers never mix)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from portico.domain.states import ToolCallState, TurnState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class AudioCounts(Collector):
    """`portico_audio_frames_total` and `portico_audio_bytes_total`, by direction."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {"in": [0, 0], "out": [0, 0]}  # frames, bytes

    def collect(self) -> Iterator[Metric]:
        frames = CounterMetricFamily(
            "portico_audio_frames", "Voice call audio frames, by direction", labels=["direction"]
        )
        sizes = CounterMetricFamily(
            "portico_audio_bytes", "Voice call audio bytes, by direction", labels=["direction"]
        )
        for direction, (count, size) in self.counts.items():
            frames.add_metric([direction], count)
            sizes.add_metric([direction], size)
        yield frames
        yield sizes


class FrameTally:
    """One protocol's frame counts, bumped in place by its sockets (a plain integer
    add per frame: no label lookup, no lock)."""

    __slots__ = ("inbound", "outbound")

    def __init__(self) -> None:
        self.inbound = 0
        self.outbound = 0


class FrameCounts(Collector):
    """`portico_frames_in_total` and `portico_frames_out_total`, by protocol, read
    from the tallies at scrape time. Every WebSocket frame counts (a voice call's 50 a
    second each way), and prometheus-client's `inc()` takes a threading lock per call.
    A protocol's series appear with its first socket, as its labelled children did."""

    def __init__(self) -> None:
        self.tallies: dict[str, FrameTally] = {}

    def of(self, protocol: str) -> FrameTally:
        tally = self.tallies.get(protocol)
        if tally is None:
            tally = self.tallies[protocol] = FrameTally()
        return tally

    def collect(self) -> Iterator[Metric]:
        inbound = CounterMetricFamily(
            "portico_frames_in", "Frames received from clients", labels=["protocol"]
        )
        outbound = CounterMetricFamily(
            "portico_frames_out", "Frames sent to clients", labels=["protocol"]
        )
        for protocol, tally in self.tallies.items():
            inbound.add_metric([protocol], tally.inbound)
            outbound.add_metric([protocol], tally.outbound)
        yield inbound
        yield outbound


class Metrics:
    """Every figure an operator of a gateway watches; also the engine's Telemetry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.connections_open = Gauge(
            "portico_connections_open", "WebSocket connections now open", ["protocol"], registry=r
        )
        self.connections = Counter(
            "portico_connections", "WebSocket connections accepted", ["protocol"], registry=r
        )
        self.upgrades_refused = Counter(
            "portico_upgrades_refused",
            "WebSocket upgrades refused before accepting",
            ["reason"],
            registry=r,
        )
        self.frames = FrameCounts()  # plain integers per frame, read at scrape time
        r.register(self.frames)
        self.turns = Counter("portico_turns", "Turns ended, by final state", ["state"], registry=r)
        self.turn_first_chunk = Histogram(
            "portico_turn_first_chunk_seconds",
            "Time from a turn's start to its first streamed chunk",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.turn_duration = Histogram(
            "portico_turn_duration_seconds",
            "Time from a turn's start to its end",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tool_calls = Counter(
            "portico_tool_calls", "Client tool calls ended, by state", ["state"], registry=r
        )
        self.uploads = Counter(
            "portico_uploads", "Media uploads, by result", ["result"], registry=r
        )
        self.rate_limited = Counter(
            "portico_rate_limited", "Client input shed by a limit", ["limit"], registry=r
        )
        self.slow_consumers = Counter(
            "portico_slow_consumer_disconnects",
            "Connections closed because the client stopped reading",
            registry=r,
        )

        self.audio_sessions_open = Gauge(
            "portico_audio_sessions_open", "Voice calls now live or parked", registry=r
        )
        self.audio_sessions = Counter("portico_audio_sessions", "Voice calls started", registry=r)
        self.audio_sessions_refused = Counter(
            "portico_audio_sessions_refused",
            "Voice calls refused at their start, by reason",
            ["reason"],
            registry=r,
        )
        self.audio_sessions_parked = Gauge(
            "portico_audio_sessions_parked", "Voice calls parked for ?resume", registry=r
        )
        self.audio_sessions_unparked = Counter(
            "portico_audio_sessions_unparked",
            "Parked voice calls that left the lot: reclaimed, or not (ended, expired)",
            ["outcome"],
            registry=r,
        )
        self.audio_sessions_moved = Counter(
            "portico_audio_sessions_moved",
            "Voice calls a new connection took over from one still open (?resume)",
            registry=r,
        )
        # Counted in plain integers, given to Prometheus at scrape time: a relayed voice
        # frame counts four times (frames and bytes, in and out), and prometheus-client's
        # locked increments were a seventh of the event loop's time under voice load
        # (docs/performance.md, voice calls).
        self._audio = AudioCounts()
        r.register(self._audio)

    # -- CallTelemetry (calls/service.py) ----------------------------------------------

    def call_started(self) -> None:
        self.audio_sessions.inc()
        self.audio_sessions_open.inc()

    def call_ended(self) -> None:
        self.audio_sessions_open.dec()

    def call_refused(self, reason: str) -> None:
        self.audio_sessions_refused.labels(reason).inc()

    def call_parked(self) -> None:
        self.audio_sessions_parked.inc()

    def call_unparked(self, reclaimed: bool) -> None:
        self.audio_sessions_parked.dec()
        self.audio_sessions_unparked.labels("reclaimed" if reclaimed else "ended").inc()

    def call_moved(self) -> None:
        self.audio_sessions_moved.inc()

    def audio(self, direction: str, size: int) -> None:
        counts = self._audio.counts[direction]
        counts[0] += 1
        counts[1] += size

    # -- Telemetry (core/telemetry.py) ------------------------------------------------

    def turn_ended(
        self, state: TurnState, *, first_chunk_seconds: float | None, duration_seconds: float
    ) -> None:
        self.turns.labels(state.value).inc()
        self.turn_duration.observe(duration_seconds)
        if first_chunk_seconds is not None:
            self.turn_first_chunk.observe(first_chunk_seconds)

    def tool_call_ended(self, state: ToolCallState) -> None:
        self.tool_calls.labels(state.value).inc()
