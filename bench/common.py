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


# -- /v1/session (spec/sessions-protocol.md): the frames a lean client sends and reads ----

SESSION_PATH = "/v1/session"
SESSION_PROTOCOL = 1


def hello_frame(session_id: str | None = None, last_seq: int = 0) -> bytes:
    """`hello` opening a session, or resuming `session_id` from server seq `last_seq`."""
    frame: dict[str, object] = {"type": "hello", "protocol": SESSION_PROTOCOL}
    if session_id is not None:
        frame.update(session_id=session_id, last_seq=last_seq)
    return msgspec.json.encode(frame)


def session_message_frame(seq: int, content: str, scenario: str) -> bytes:
    """A numbered `/v1/session` `message` naming a scripted scenario."""
    frame = {
        "type": "message",
        "seq": seq,
        "content": content,
        "metadata": {"mock_scenario": scenario},
    }
    return msgspec.json.encode(frame)


def ack_frame(seq: int) -> bytes:
    return b'{"type":"ack","seq":%d}' % seq


def end_frame(seq: int) -> bytes:
    return b'{"type":"end","seq":%d}' % seq


class _Numbered(msgspec.Struct):
    type: str
    seq: int = 0  # 0: an unnumbered frame (ready, ack, pong, a connection-level error)


class _Ready(msgspec.Struct):
    session_id: str


_numbered_decoder = msgspec.json.Decoder(_Numbered)
_ready_decoder = msgspec.json.Decoder(_Ready)


def session_frame(payload: bytes | str) -> tuple[str, int]:
    """A server frame's `type` and `seq` (0 when unnumbered); the rest is skipped."""
    frame = _numbered_decoder.decode(payload)
    return frame.type, frame.seq


def ready_session_id(payload: bytes | str) -> str:
    return _ready_decoder.decode(payload).session_id
