"""The voice audio counters and the sockets' frame counts, kept in plain integers and
read at scrape time."""

from __future__ import annotations

import prometheus_client

from portico.server.metrics import Metrics


def samples(metrics: Metrics) -> dict[str, float]:
    text = prometheus_client.generate_latest(metrics.registry).decode()
    return {
        name: float(value)
        for line in text.splitlines()
        if line.startswith(("portico_audio_frames", "portico_audio_bytes"))
        for name, value in [line.rsplit(" ", 1)]
    }


def test_each_relayed_frame_is_counted_by_direction_in_frames_and_bytes() -> None:
    metrics = Metrics()
    assert samples(metrics) == {
        'portico_audio_frames_total{direction="in"}': 0.0,
        'portico_audio_frames_total{direction="out"}': 0.0,
        'portico_audio_bytes_total{direction="in"}': 0.0,
        'portico_audio_bytes_total{direction="out"}': 0.0,
    }
    metrics.audio("in", 640)
    metrics.audio("in", 10)
    metrics.audio("out", 640)
    assert samples(metrics) == {
        'portico_audio_frames_total{direction="in"}': 2.0,
        'portico_audio_frames_total{direction="out"}': 1.0,
        'portico_audio_bytes_total{direction="in"}': 650.0,
        'portico_audio_bytes_total{direction="out"}': 640.0,
    }


def frame_samples(metrics: Metrics) -> dict[str, float]:
    text = prometheus_client.generate_latest(metrics.registry).decode()
    return {
        name: float(value)
        for line in text.splitlines()
        if line.startswith("portico_frames_")
        for name, value in [line.rsplit(" ", 1)]
    }


def test_socket_frames_are_tallied_per_protocol_and_read_at_scrape_time() -> None:
    """The sockets' per-frame counts (server/sockets.py): the same two series as the
    labelled counters they were, a protocol's from its first socket on."""
    metrics = Metrics()
    assert frame_samples(metrics) == {}
    omnia = metrics.frames.of("omnia")
    assert metrics.frames.of("omnia") is omnia  # every socket of a protocol shares it
    omnia.inbound += 3
    omnia.outbound += 5
    metrics.frames.of("session").inbound += 1
    assert frame_samples(metrics) == {
        'portico_frames_in_total{protocol="omnia"}': 3.0,
        'portico_frames_in_total{protocol="session"}': 1.0,
        'portico_frames_out_total{protocol="omnia"}': 5.0,
        'portico_frames_out_total{protocol="session"}': 0.0,
    }
