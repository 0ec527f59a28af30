"""Checks of the `/v1/session` exactly-once ledger across replicas (issue 16): a resume
with the old probe's position, frames up to a number of turn ends, the archive once it
has settled, and the server seqs a client saw."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from portico.domain.model import Message, Turn
from portico.store.postgres import PostgresStore
from support.archive import ENDED, OPEN
from support.session import SessionProbe

SETTLE_WITHIN = 15.0  # seconds for the archive to hold what a test waits for


async def resume(
    http: aiohttp.ClientSession,
    url: str,
    old: SessionProbe,
    session_id: str,
    *,
    handled: int | None = None,
) -> tuple[SessionProbe, dict[str, Any]]:
    """Reconnect to `url` with the old probe's position; the new probe and `ready`.
    `handled`: the client handled only the server messages up to it (the rest were
    still in its socket when the replica died)."""
    probe = await SessionProbe.connect(http, url)
    ready = await hello_again(probe, old, session_id, handled=handled)
    assert ready["type"] == "ready", ready
    assert ready["resumed"] is True
    return probe, ready


async def hello_again(
    probe: SessionProbe, old: SessionProbe, session_id: str, *, handled: int | None = None
) -> dict[str, Any]:
    """The resuming `hello` on a new connection; the server's first answer."""
    last = old.handled if handled is None else handled
    probe.handled, probe.next_seq = last, old.next_seq
    probe.received = [
        frame
        for frame in old.received
        if not isinstance(frame.get("seq"), int) or frame["type"] == "ack" or frame["seq"] <= last
    ]
    return await probe.hello(session_id=session_id, last_seq=last)


def is_turn_end(frame: dict[str, Any]) -> bool:
    return frame["type"] == "done" or (frame["type"] == "error" and "turn_id" in frame)


async def frames_until(probe: SessionProbe, turns: int) -> list[dict[str, Any]]:
    """Numbered frames until `turns` turns ended (done, or an error with a turn id)."""
    frames: list[dict[str, Any]] = []
    ended = 0
    while ended < turns:
        frame = await probe.recv_numbered()
        frames.append(frame)
        ended += is_turn_end(frame)
    return frames


async def archived(
    database_url: str, session_id: str, count: int
) -> tuple[list[Message], list[Turn]]:
    """The session's messages and turns once `count` messages are there and settled."""
    store = PostgresStore(database_url, pool_size=1)
    await store.open()
    try:
        deadline = time.monotonic() + SETTLE_WITHIN
        while True:
            messages = list(await store.list_messages(session_id))
            turns = list(await store.list_turns(session_id))
            settled = all(m.status not in OPEN for m in messages) and all(
                t.state in ENDED for t in turns
            )
            if (len(messages) >= count and settled) or time.monotonic() > deadline:
                return messages, turns
            await asyncio.sleep(0.05)
    finally:
        await store.close()


async def running_turn(database_url: str, session_id: str) -> Turn:
    """The session's unfinished turn, once the archive holds it."""
    store = PostgresStore(database_url, pool_size=1)
    await store.open()
    try:
        deadline = time.monotonic() + SETTLE_WITHIN
        while time.monotonic() < deadline:
            turns = [t for t in await store.list_turns(session_id) if t.state not in ENDED]
            if turns:
                return turns[0]
            await asyncio.sleep(0.02)
        raise AssertionError(f"no running turn archived in {session_id}")
    finally:
        await store.close()


def assert_seqs_once(probe: SessionProbe) -> None:
    """Server to client: every numbered message once, in order, 1..n."""
    seqs = probe.numbered_seqs()
    assert seqs == list(range(1, len(seqs) + 1)), seqs


def terminals_per_turn(probe: SessionProbe) -> dict[str, list[str]]:
    """Each turn id the client saw, with the terminal frames (`done`/`error`) it got."""
    ends: dict[str, list[str]] = {}
    for frame in probe.received:
        turn_id = frame.get("turn_id")
        if isinstance(turn_id, str) and frame["type"] not in ("ack", "ready"):
            ends.setdefault(turn_id, [])
            if is_turn_end(frame):
                ends[turn_id].append(frame["type"])
    return ends
