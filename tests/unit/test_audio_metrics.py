"""The voice audio counters, kept in plain integers and read at scrape time."""

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
