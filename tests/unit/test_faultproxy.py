"""The fault-injection proxy against a tiny in-test echo server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType, web

from support.faultproxy import (
    CLIENT_TO_SERVER,
    SERVER_TO_CLIENT,
    FaultProxy,
    Frame,
    Rule,
    close,
    cut,
    delay,
    duplicate,
    event_filter,
    inject,
    replace,
    suppress,
)

RECEIVE = 2.0


@dataclass
class Upstream:
    """What the echo server saw of one connection."""

    path: str
    headers: dict[str, str]
    received: list[Any] = field(default_factory=list)
    end: str = ""  # "close <code>" or "drop"
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class EchoServer:
    """Echoes every frame back. JSON commands: {"type": "whoami"} answers with the request;
    {"type": "burst", "n": k} sends chunks seq 1..k; {"type": "close", "code", "reason"} closes."""

    def __init__(self) -> None:
        self.connections: list[Upstream] = []
        self.connected = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/refuse", refuse)
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=("portico.v1",))
        await ws.prepare(request)
        seen = Upstream(request.path_qs, dict(request.headers))
        self.connections.append(seen)
        self.connected.set()
        async for msg in ws:
            seen.received.append(msg.data)
            if msg.type is WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
            elif msg.type is WSMsgType.TEXT:
                await self._on_text(ws, request, msg.data)
        seen.end = "drop" if ws.close_code in (None, 1006) else f"close {ws.close_code}"
        seen.ended.set()
        return ws

    async def _on_text(self, ws: web.WebSocketResponse, request: web.Request, text: str) -> None:
        frame = json.loads(text) if text.startswith("{") else {}
        if frame.get("type") == "whoami":
            await ws.send_json(
                {
                    "type": "whoami",
                    "path": request.path_qs,
                    "authorization": request.headers.get("Authorization"),
                    "origin": request.headers.get("Origin"),
                    "protocol": ws.ws_protocol,
                }
            )
        elif frame.get("type") == "burst":
            for seq in range(1, frame["n"] + 1):
                await ws.send_json({"type": "chunk", "seq": seq})
        elif frame.get("type") == "close":
            await ws.close(code=frame["code"], message=frame["reason"].encode())
        else:
            await ws.send_str(text)


async def refuse(request: web.Request) -> web.Response:
    return web.Response(status=403)


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    server = EchoServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def proxy(echo: EchoServer) -> AsyncIterator[FaultProxy]:
    async with FaultProxy(echo.url) as running:
        yield running


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client_session:
        yield client_session


async def connect(
    session: aiohttp.ClientSession, proxy: FaultProxy, path: str = "/v1/session", **kwargs: Any
) -> aiohttp.ClientWebSocketResponse:
    ws: aiohttp.ClientWebSocketResponse = await session.ws_connect(proxy.url(path), **kwargs)
    return ws


async def recv_json(ws: aiohttp.ClientWebSocketResponse) -> Any:
    msg = await ws.receive(timeout=RECEIVE)
    assert msg.type is WSMsgType.TEXT, (msg.type, msg.data)
    return json.loads(msg.data)


async def recv_seqs(ws: aiohttp.ClientWebSocketResponse, count: int) -> list[int]:
    return [(await recv_json(ws))["seq"] for _ in range(count)]


async def assert_silent(ws: aiohttp.ClientWebSocketResponse, within: float = 0.1) -> None:
    with pytest.raises(TimeoutError):
        await ws.receive(timeout=within)


def chunk(seq: int) -> dict[str, Any]:
    return {"type": "chunk", "seq": seq}


# --- plain relay ------------------------------------------------------------------------


async def test_relays_text_and_binary_both_ways_keeping_frame_types(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    ws = await connect(session, proxy)
    await ws.send_str("plain text")
    await ws.send_bytes(b"\x00\x01binary")
    await ws.send_json({"type": "message", "seq": 1})

    first, second, third = [await ws.receive(timeout=RECEIVE) for _ in range(3)]
    assert (first.type, first.data) == (WSMsgType.TEXT, "plain text")
    assert (second.type, second.data) == (WSMsgType.BINARY, b"\x00\x01binary")
    assert (third.type, json.loads(third.data)) == (WSMsgType.TEXT, {"type": "message", "seq": 1})

    await proxy.events.wait_for_frame(SERVER_TO_CLIENT, type="message")
    upstream = proxy.events.frames(CLIENT_TO_SERVER)
    assert [(e.kind, e.frame, e.action) for e in upstream[:2]] == [
        ("text", "plain text", "forward"),
        ("binary", 8, "forward"),
    ]
    assert upstream[2].json == {"type": "message", "seq": 1}
    assert proxy.events.delivered(SERVER_TO_CLIENT) == ["plain text", 8, upstream[2].json]
    assert proxy.events.select(kind="open")[0].frame == "/v1/session"
    await ws.close()


async def test_many_connections_each_get_their_own_upstream(
    echo: EchoServer, proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    clients = [await connect(session, proxy, f"/v1/session?n={n}") for n in range(3)]
    for n, ws in enumerate(clients):
        await ws.send_str(f"from {n}")
    for n, ws in enumerate(clients):
        assert (await ws.receive(timeout=RECEIVE)).data == f"from {n}"
    assert [c.path for c in echo.connections] == [f"/v1/session?n={n}" for n in range(3)]
    assert [c.index for c in proxy.active] == [0, 1, 2]
    for ws in clients:
        await ws.close()


# --- actions ----------------------------------------------------------------------------


async def test_suppress_drops_only_the_matching_frame(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    rule = proxy.add_rule(Rule(suppress(), direction=SERVER_TO_CLIENT, type="chunk", seq=2))
    ws = await connect(session, proxy)
    await ws.send_json({"type": "burst", "n": 3})

    assert await recv_seqs(ws, 2) == [1, 3]
    assert rule.fired == 1
    assert [e.action for e in proxy.events.frames(SERVER_TO_CLIENT)] == [
        "forward",
        "suppress",
        "forward",
    ]
    assert [f["seq"] for f in proxy.events.delivered(SERVER_TO_CLIENT, type="chunk")] == [1, 3]
    assert proxy.events.frames(SERVER_TO_CLIENT, seq=2)[0].rule is rule
    await ws.close()


async def test_delay_holds_the_frames_behind_it_and_keeps_their_order(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    proxy.add_rule(Rule(delay(0.2), direction=CLIENT_TO_SERVER, seq=1))
    ws = await connect(session, proxy)
    started = time.monotonic()
    for seq in (1, 2, 3):
        await ws.send_json(chunk(seq))

    assert await recv_seqs(ws, 3) == [1, 2, 3]
    assert time.monotonic() - started >= 0.2
    actions = [e.action for e in proxy.events.frames(CLIENT_TO_SERVER)]
    assert actions == ["delay", "forward", "forward"]
    await ws.close()


async def test_duplicate_sends_extra_copies(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    proxy.add_rule(Rule(duplicate(2), direction=SERVER_TO_CLIENT, seq=2))
    ws = await connect(session, proxy)
    await ws.send_json({"type": "burst", "n": 3})

    assert await recv_seqs(ws, 5) == [1, 2, 2, 2, 3]
    event = proxy.events.frames(SERVER_TO_CLIENT, action="duplicate")[0]
    assert event.delivered == 3
    await ws.close()


async def test_inject_after_before_and_towards_the_other_side(
    echo: EchoServer, proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    proxy.add_rule(Rule(inject({"type": "ack", "seq": 1}), direction=SERVER_TO_CLIENT, seq=1))
    proxy.add_rule(
        Rule(inject([chunk(10), b"\x07"], before=True), direction=SERVER_TO_CLIENT, seq=2)
    )
    toward_server = inject({"type": "ack", "seq": 3}, direction=CLIENT_TO_SERVER)
    proxy.add_rule(Rule(toward_server, direction=SERVER_TO_CLIENT, seq=3))
    ws = await connect(session, proxy)
    await ws.send_json({"type": "burst", "n": 3})

    got = [await ws.receive(timeout=RECEIVE) for _ in range(6)]
    texts = [json.loads(m.data) if m.type is WSMsgType.TEXT else m.data for m in got]
    assert texts[:5] == [chunk(1), {"type": "ack", "seq": 1}, chunk(10), b"\x07", chunk(2)]
    assert texts[5] == chunk(3)
    # The ack injected toward the server came back from the echo server.
    assert await recv_json(ws) == {"type": "ack", "seq": 3}
    assert '{"type":"ack","seq":3}' in echo.connections[0].received
    assert len(proxy.events.frames(action="injected")) == 4
    await ws.close()


async def test_replace_with_a_frame_or_a_function_of_the_frame(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    proxy.add_rule(Rule(replace({"type": "chunk", "seq": 99}), direction=SERVER_TO_CLIENT, seq=1))

    def bump(frame: Frame) -> dict[str, Any]:
        return {**frame.json, "seq": frame.json["seq"] + 100}

    proxy.add_rule(Rule(replace(bump), direction=SERVER_TO_CLIENT, seq=2))
    proxy.add_rule(Rule(replace(lambda _: None), direction=SERVER_TO_CLIENT, seq=3))
    ws = await connect(session, proxy)
    await ws.send_json({"type": "burst", "n": 4})

    assert await recv_seqs(ws, 3) == [99, 102, 4]
    assert [e.action for e in proxy.events.frames(SERVER_TO_CLIENT)] == [
        "replace",
        "replacement",
        "replace",
        "replacement",
        "replace",
        "forward",
    ]
    await ws.close()


async def test_cut_aborts_both_sides_without_a_close_frame_and_reconnecting_works(
    echo: EchoServer, proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, seq=2))
    ws = await connect(session, proxy)
    await ws.send_json({"type": "burst", "n": 3})

    assert await recv_seqs(ws, 1) == [1]
    msg = await ws.receive(timeout=RECEIVE)
    assert msg.type in (WSMsgType.CLOSED, WSMsgType.ERROR)
    assert ws.close_code == 1006
    await asyncio.wait_for(echo.connections[0].ended.wait(), RECEIVE)
    assert echo.connections[0].end == "drop"
    assert proxy.events.select(kind="drop")[0].action == "cut"
    assert proxy.events.select(kind="close") == []

    again = await connect(session, proxy)
    await again.send_json({"type": "burst", "n": 3})
    assert await recv_seqs(again, 3) == [1, 2, 3]  # the rule fired once, and is spent
    assert [c.index for c in proxy.active] == [1]
    await again.close()


async def test_cut_can_forward_the_matching_frame_first(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    proxy.add_rule(Rule(cut(forward=True), direction=SERVER_TO_CLIENT, seq=2))
    ws = await connect(session, proxy)
    await ws.send_json({"type": "burst", "n": 3})

    assert await recv_seqs(ws, 2) == [1, 2]
    assert (await ws.receive(timeout=RECEIVE)).type in (WSMsgType.CLOSED, WSMsgType.ERROR)
    assert ws.close_code == 1006


async def test_a_cut_releases_a_frame_held_by_a_delay_at_once(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    held = asyncio.Event()

    def hold(frame: Frame) -> bool:
        held.set()
        return True

    proxy.add_rule(Rule(delay(30), direction=SERVER_TO_CLIENT, where=hold))
    ws = await connect(session, proxy)
    await ws.send_json(chunk(1))
    await asyncio.wait_for(held.wait(), RECEIVE)

    await asyncio.wait_for(proxy.cut_all(), 1.0)
    assert (await ws.receive(timeout=RECEIVE)).type in (WSMsgType.CLOSED, WSMsgType.ERROR)
    held_event = proxy.events.frames(SERVER_TO_CLIENT)[0]
    assert (held_event.action, held_event.delivered) == ("delay", 0)


async def test_cut_all_and_cut_one_connection_from_the_test(
    echo: EchoServer, proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    first, second, third = [await connect(session, proxy) for _ in range(3)]
    await proxy.cut(1)
    assert (await second.receive(timeout=RECEIVE)).type in (WSMsgType.CLOSED, WSMsgType.ERROR)
    assert [c.index for c in proxy.active] == [0, 2]

    await proxy.cut_all()
    for ws in (first, third):
        assert (await ws.receive(timeout=RECEIVE)).type in (WSMsgType.CLOSED, WSMsgType.ERROR)
        assert ws.close_code == 1006
    assert proxy.active == []
    await asyncio.wait_for(asyncio.gather(*(c.ended.wait() for c in echo.connections)), RECEIVE)
    assert {c.end for c in echo.connections} == {"drop"}

    fresh = await connect(session, proxy)
    await fresh.send_str("still here")
    assert (await fresh.receive(timeout=RECEIVE)).data == "still here"
    await fresh.close()


async def test_close_action_sends_its_code_and_reason_to_the_client(
    echo: EchoServer, proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    proxy.add_rule(Rule(close(4409, "replaced"), direction=SERVER_TO_CLIENT, seq=2))
    ws = await connect(session, proxy)
    await ws.send_json({"type": "burst", "n": 3})

    assert await recv_seqs(ws, 1) == [1]
    msg = await ws.receive(timeout=RECEIVE)
    assert (msg.type, msg.data, msg.extra) == (WSMsgType.CLOSE, 4409, "replaced")
    await asyncio.wait_for(echo.connections[0].ended.wait(), RECEIVE)
    assert echo.connections[0].end == "close 1000"
    closes = proxy.events.select(kind="close")
    assert [(e.direction, e.code, e.action) for e in closes] == [
        (SERVER_TO_CLIENT, 4409, "close"),
        (CLIENT_TO_SERVER, 1000, "close"),
    ]


async def test_close_from_the_test_can_abort_the_upstream(
    echo: EchoServer, proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    ws = await connect(session, proxy)
    conn = await proxy.wait_connection(0)
    await conn.close(1001, "going away", upstream_code=None)

    msg = await ws.receive(timeout=RECEIVE)
    assert (msg.type, msg.data, msg.extra) == (WSMsgType.CLOSE, 1001, "going away")
    await asyncio.wait_for(echo.connections[0].ended.wait(), RECEIVE)
    assert echo.connections[0].end == "drop"


async def test_ping_and_pong_control_frames_pass_through(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    ws = await connect(session, proxy, autoping=False)
    await ws.ping(b"are you there")

    msg = await ws.receive(timeout=RECEIVE)  # the echo server's automatic pong
    assert (msg.type, msg.data) == (WSMsgType.PONG, b"are you there")
    await ws.close()


# --- counting and runtime rules ---------------------------------------------------------


async def test_nth_and_times_pick_which_matches_fire(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    third = proxy.add_rule(Rule(suppress(), type="chunk", direction=SERVER_TO_CLIENT, nth=3))
    two_more = proxy.add_rule(
        Rule(suppress(), type="chunk", direction=SERVER_TO_CLIENT, nth=5, times=2)
    )
    ws = await connect(session, proxy)
    await ws.send_json({"type": "burst", "n": 8})

    # 3 goes to the first rule; the second counts 1, 2, 4, 5, 6, ... and fires on its 5th and 6th.
    assert await recv_seqs(ws, 5) == [1, 2, 4, 5, 8]
    assert (third.seen, third.fired, third.exhausted) == (3, 1, True)
    assert (two_more.seen, two_more.fired) == (6, 2)
    await ws.close()


async def test_seq_predicates_type_sets_and_unlimited_times(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    rule = Rule(suppress(), type={"chunk", "done"}, seq=lambda s: s % 2 == 0, times=None)
    proxy.add_rule(rule)
    ws = await connect(session, proxy)
    await ws.send_json({"type": "burst", "n": 6})

    assert await recv_seqs(ws, 3) == [1, 3, 5]
    assert rule.fired == 3
    await ws.close()


async def test_rules_added_and_removed_mid_conversation(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    ws = await connect(session, proxy)
    await ws.send_json(chunk(1))
    assert await recv_seqs(ws, 1) == [1]

    rule = proxy.add_rule(Rule(suppress(), direction=CLIENT_TO_SERVER, times=None))
    await ws.send_json(chunk(2))
    await proxy.events.wait_for_frame(CLIENT_TO_SERVER, action="suppress")
    await assert_silent(ws)

    proxy.remove_rule(rule)
    await ws.send_json(chunk(3))
    assert await recv_seqs(ws, 1) == [3]
    await ws.close()


async def test_rules_can_target_one_connection(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    proxy.add_rule(Rule(suppress(), connection=0, times=None))  # connection 0 is half-open
    dead, alive = await connect(session, proxy), await connect(session, proxy)
    await dead.send_str("lost")
    await alive.send_str("kept")

    assert (await alive.receive(timeout=RECEIVE)).data == "kept"
    await assert_silent(dead)
    await dead.close()
    await alive.close()


# --- close codes, handshake -------------------------------------------------------------


async def test_upstream_close_code_and_reason_reach_the_client(
    echo: EchoServer, proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    ws = await connect(session, proxy)
    await ws.send_json({"type": "close", "code": 4404, "reason": "resume failed"})

    msg = await ws.receive(timeout=RECEIVE)
    assert (msg.type, msg.data, msg.extra) == (WSMsgType.CLOSE, 4404, "resume failed")
    close_event = await proxy.events.wait_for(event_filter(SERVER_TO_CLIENT, kind="close"))
    assert (close_event.code, close_event.frame, close_event.action) == (
        4404,
        "resume failed",
        "forward",
    )
    await ws.close()
    await proxy.connections[0].wait_closed()
    assert echo.connections[0].end == "close 4404"


async def test_client_close_code_reaches_the_server(
    echo: EchoServer, proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    ws = await connect(session, proxy)
    await ws.close(code=4000, message=b"idle")

    assert ws.close_code == 4000  # the proxy answers the close with the same code
    await asyncio.wait_for(echo.connections[0].ended.wait(), RECEIVE)
    assert echo.connections[0].end == "close 4000"
    event = proxy.events.select(CLIENT_TO_SERVER, kind="close")[0]
    assert (event.code, event.frame) == (4000, "idle")


async def test_path_query_authorization_origin_and_subprotocol_are_forwarded(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    ws = await connect(
        session,
        proxy,
        "/v1/session?agent=support&x=a%20b",
        headers={"Authorization": "Bearer alice-token"},
        origin="https://app.example",
        protocols=("portico.v1",),
    )
    await ws.send_json({"type": "whoami"})

    assert await recv_json(ws) == {
        "type": "whoami",
        "path": "/v1/session?agent=support&x=a%20b",
        "authorization": "Bearer alice-token",
        "origin": "https://app.example",
        "protocol": "portico.v1",
    }
    assert ws.protocol == "portico.v1"
    await ws.close()


async def test_an_upstream_refusal_reaches_the_client_with_its_status(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await connect(session, proxy, "/refuse")
    assert refused.value.status == 403
    assert proxy.connections == []
    assert proxy.events.select(kind="refused")[0].code == 403


# --- the event log ----------------------------------------------------------------------


async def test_wait_for_resolves_on_a_later_event_and_times_out_otherwise(
    proxy: FaultProxy, session: aiohttp.ClientSession
) -> None:
    ws = await connect(session, proxy)
    waiting = asyncio.create_task(proxy.events.wait_for_frame(SERVER_TO_CLIENT, type="chunk"))
    await asyncio.sleep(0)
    assert not waiting.done()
    await ws.send_json(chunk(7))

    event = await waiting
    assert (event.connection, event.json, event.delivered) == (0, chunk(7), 1)
    with pytest.raises(TimeoutError, match="no matching proxy event"):
        await proxy.events.wait_for_frame(type="never", within=0.05)
    mark = len(proxy.events)
    with pytest.raises(TimeoutError):
        await proxy.events.wait_for_frame(type="chunk", since=mark, within=0.05)
    await ws.close()
