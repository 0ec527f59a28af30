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


# -- /v1/rpc (spec/rpc-protocol.md): the frames a lean client sends and reads ------------

RPC_PATH = "/v1/rpc"
# A turn's states that end it (spec/rpc-protocol.md §7); `merged` ends a waiting turn.
RPC_TURN_ENDS = frozenset({"completed", "failed", "cancelled", "interrupted", "merged"})
RPC_TURN_FAILURES = frozenset({"failed", "cancelled", "interrupted"})
PAGE_SIZE = 50  # rpc_pages: messages per `v1.message.list` page
FILL_SCENARIO = "default"  # rpc_pages fills its session with these short replies (1 chunk)
FILL_WINDOW = 32  # rpc_pages: sends in flight while filling (the server refuses past 64)
_encode = msgspec.json.Encoder().encode


def bench_token(index: int) -> str:
    """The API key of bench user `index` (a throwaway key of a loopback bench server)."""
    return f"bench-key-{index}"


def bench_api_keys(users: int) -> str:
    """`PORTICO_API_KEYS` for `users` bench users: token=principal, comma-separated."""
    return ",".join(f"{bench_token(i)}=bench-user-{i}" for i in range(users))


def rpc_connect_frame(token: str | None = None) -> bytes:
    frame: dict[str, object] = {"type": "connect"}
    if token is not None:
        frame["token"] = token
    return _encode(frame)


def rpc_send_frame(request_id: str, client_id: str, scenario: str, session_id: str = "") -> bytes:
    """`v1.message.send` naming a scripted scenario; into `session_id`, or a new session."""
    params: dict[str, object] = {
        "content_data": "bench",
        "client_id": client_id,
        "metadata": {"mock_scenario": scenario},
    }
    if session_id:
        params["server_session_id"] = session_id
    return _encode({"id": request_id, "method": "v1.message.send", "params": params})


def rpc_list_frame(request_id: str, session_id: str, cursor: int, limit: int) -> bytes:
    """`v1.message.list`: `limit` messages after global_offset `cursor`, oldest first."""
    params = {"session_id": session_id, "cursor": cursor, "limit": limit}
    return _encode({"id": request_id, "method": "v1.message.list", "params": params})


class RpcEntity(msgspec.Struct):
    """The fields of a pushed or listed entity the benchmark reads (the rest is skipped)."""

    id: str = ""
    session_id: str = ""
    status: str = ""
    role: str = ""
    client_id: str = ""
    global_offset: int = 0


class RpcItem(msgspec.Struct):
    entity: str
    action: str


class RpcUpdate(msgspec.Struct):
    items: list[RpcItem]
    data_list: list[RpcEntity]


class RpcLive(msgspec.Struct):
    session_id: str


class RpcFrame(msgspec.Struct):
    """A server frame: a push (`type`), or a reply (`id` with `result` or `error`)."""

    type: str = ""
    id: str = ""
    live: RpcLive | None = None
    update: RpcUpdate | None = None
    result: msgspec.Raw = msgspec.Raw()
    error: msgspec.Raw = msgspec.Raw()


class RpcSendResult(msgspec.Struct):
    session_id: str


class RpcPage(msgspec.Struct):
    items: list[RpcEntity]
    next_cursor: str


_rpc_decoder = msgspec.json.Decoder(RpcFrame)
_send_result_decoder = msgspec.json.Decoder(RpcSendResult)
_page_decoder = msgspec.json.Decoder(RpcPage)


def rpc_frame(payload: bytes | str) -> RpcFrame:
    return _rpc_decoder.decode(payload)


def rpc_send_result(frame: RpcFrame) -> RpcSendResult:
    return _send_result_decoder.decode(frame.result)


def rpc_page(frame: RpcFrame) -> RpcPage:
    return _page_decoder.decode(frame.result)
