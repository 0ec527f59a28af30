"""What the benchmark's processes share: limits, the ready line, frame kinds."""

from __future__ import annotations

import re
import resource

import msgspec

HOST = "127.0.0.1"  # every server binds here and every client talks only to it
# The line Portico prints once it accepts connections; the bare servers print the same shape.
READY_LINE = re.compile(r"serving http://127\.0\.0\.1:(?P<port>\d+)/")
TERMINAL_KINDS = frozenset({"done", "error"})


def raise_fd_limit() -> int:
    """Lift RLIMIT_NOFILE to the hard limit (children inherit it); returns the new soft limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def message_frame(content: str, scenario: str) -> bytes:
    """A `/ws` `message` frame naming a scripted scenario (metadata `mock_scenario`)."""
    frame = {"type": "message", "content": content, "metadata": {"mock_scenario": scenario}}
    return msgspec.json.encode(frame)


class _Kind(msgspec.Struct):
    type: str


# Decoding only `type` (msgspec skips the other fields) keeps the client's per-frame cost
# well under a microsecond, so the client is not what a workload measures.
_kind_decoder = msgspec.json.Decoder(_Kind)


def frame_kind(payload: bytes | str) -> str:
    return _kind_decoder.decode(payload).type
