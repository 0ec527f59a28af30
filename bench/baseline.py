"""Bare `/ws` servers with no Portico logic: the yardsticks every Portico figure is divided by.

    python bench/baseline.py aiohttp [--port 0]    # Portico's stack: aiohttp + uvloop + msgspec
    python bench/baseline.py picows  [--port 0]    # the fastest Python WebSocket server

Both speak the frame shapes Portico sends: `connected` on open, then for each `message`
the scripted scenario it names (`mock_scenario`): `stream50` is 50 `chunk` frames and a
`done` whose content is the concatenated chunks; `echo` is one `chunk` per word and a
`done`. A binary message (the voice workload's audio frames) comes back as it came.
Every frame is encoded with msgspec one at a time, as Portico does; nothing is archived,
validated beyond decoding, rate-limited or logged. Prints
`Baseline serving http://127.0.0.1:PORT/` once it accepts connections; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import uvloop
from aiohttp import WSMsgType, web
from common import HOST, raise_fd_limit

MAX_PAYLOAD = 16 * 1024 * 1024
STREAM_CHUNKS = 50
STREAM_TEXT = "c "


class Capabilities(msgspec.Struct):
    binary_frames: bool
    max_payload_size: int
    protocol_version: int


class ConnectedInfo(msgspec.Struct):
    capabilities: Capabilities


class Connected(msgspec.Struct, tag="connected", tag_field="type"):
    session_id: str
    connected: ConnectedInfo


class Chunk(msgspec.Struct, tag="chunk", tag_field="type"):
    content: str
    session_id: str


class Done(msgspec.Struct, tag="done", tag_field="type"):
    content: str
    session_id: str


class ErrorInfo(msgspec.Struct):
    code: str
    message: str


class Error(msgspec.Struct, tag="error", tag_field="type"):
    error: ErrorInfo
    session_id: str


class Message(msgspec.Struct, tag="message", tag_field="type"):
    content: str = ""
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


_encode = msgspec.json.Encoder().encode
_decode_message = msgspec.json.Decoder(Message).decode


def new_session_id() -> str:
    return f"sess-{uuid.uuid4().hex}"


def connected_frame(session_id: str) -> bytes:
    capabilities = Capabilities(
        binary_frames=False, max_payload_size=MAX_PAYLOAD, protocol_version=1
    )
    return _encode(Connected(session_id=session_id, connected=ConnectedInfo(capabilities)))


def reply_frames(data: bytes | str, session_id: str) -> Iterator[bytes]:
    """The encoded frames answering one client frame, encoded lazily one by one."""
    try:
        message = _decode_message(data)
    except msgspec.DecodeError:
        yield _encode(Error(ErrorInfo("INVALID_MESSAGE", "bad frame"), session_id))
        return
    scenario = message.metadata.get("mock_scenario", "stream50")
    if scenario == "stream50":
        texts = [STREAM_TEXT] * STREAM_CHUNKS
    elif scenario == "echo":
        words = message.content.split()
        texts = [word if i == len(words) - 1 else word + " " for i, word in enumerate(words)]
    else:
        yield _encode(Error(ErrorInfo("INTERNAL_ERROR", "unknown scenario"), session_id))
        return
    for text in texts:
        yield _encode(Chunk(text, session_id))
    yield _encode(Done("".join(texts), session_id))


# -- aiohttp + uvloop ------------------------------------------------------------------


async def _aiohttp_ws(request: web.Request) -> web.StreamResponse:
    ws = web.WebSocketResponse(max_msg_size=MAX_PAYLOAD, compress=False)
    await ws.prepare(request)
    session_id = new_session_id()
    await ws.send_frame(connected_frame(session_id), WSMsgType.TEXT)
    async for msg in ws:
        if msg.type is WSMsgType.TEXT:
            for data in reply_frames(msg.data, session_id):
                await ws.send_frame(data, WSMsgType.TEXT)
        elif msg.type is WSMsgType.BINARY:  # the voice workload: the frame comes back as is
            await ws.send_frame(msg.data, WSMsgType.BINARY)
    return ws


async def serve_aiohttp(port: int, stop: asyncio.Event) -> None:
    app = web.Application()
    app.router.add_get("/ws", _aiohttp_ws)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, HOST, port)  # default backlog, as Portico's
    await site.start()
    announce(runner.addresses[0][1])
    await stop.wait()
    await runner.cleanup()


# -- picows ----------------------------------------------------------------------------


def serve_picows_factory() -> Callable[[Any], Any]:
    # Imported here so the aiohttp baseline runs where the `bench` extra is not installed.
    from picows import WSFrame, WSListener, WSTransport, WSUpgradeRequest
    from picows import WSMsgType as PicoType

    class Session(WSListener):
        def on_ws_connected(self, transport: WSTransport) -> None:
            self.session_id = new_session_id()
            transport.send(PicoType.TEXT, connected_frame(self.session_id))

        def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
            if frame.msg_type == PicoType.TEXT:
                for data in reply_frames(frame.get_payload_as_bytes(), self.session_id):
                    transport.send(PicoType.TEXT, data)
            elif frame.msg_type == PicoType.BINARY:  # the voice workload: echoed as is
                transport.send(PicoType.BINARY, frame.get_payload_as_bytes())
            elif frame.msg_type == PicoType.CLOSE:
                transport.send_close(frame.get_close_code())
                transport.disconnect()

    def route(request: WSUpgradeRequest) -> Session | None:
        return Session() if request.path.split(b"?")[0] == b"/ws" else None

    return route


async def serve_picows(port: int, stop: asyncio.Event) -> None:
    from picows import ws_create_server

    server = await ws_create_server(serve_picows_factory(), HOST, port)
    announce(server.sockets[0].getsockname()[1])
    await stop.wait()
    server.close()


def announce(port: int) -> None:
    print(f"Baseline serving http://{HOST}:{port}/ (ws://{HOST}:{port}/ws)", flush=True)


SERVERS = {"aiohttp": serve_aiohttp, "picows": serve_picows}


async def main(kind: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await SERVERS[kind](port, stop)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(SERVERS))
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    raise_fd_limit()
    uvloop.run(main(args.kind, args.port))
