"""Read a running server's SQLite archive from the test process (WAL allows it)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from portico.domain.model import Message, ToolCallRecord, Turn
from portico.domain.states import TurnState
from portico.store.sqlite import SqliteStore

OPEN = ("pending", "streaming")  # a reply still being written
TOOL_RECORDS = ("toolcall_input", "toolcall_output")  # a tool call's request and outcome
ENDED = frozenset(
    {
        TurnState.COMPLETED,
        TurnState.FAILED,
        TurnState.CANCELLED,
        TurnState.INTERRUPTED,
        TurnState.MERGED,
    }
)


@asynccontextmanager
async def open_archive(path: Path) -> AsyncIterator[SqliteStore]:
    store = SqliteStore(path, read_only=True)  # beside the server that owns it
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def wait_for_messages(
    path: Path, session_id: str, count: int, within: float = 10.0
) -> list[Message]:
    """Poll until the session holds `count` messages, none of them still streaming
    (the server writes asynchronously)."""
    deadline = time.monotonic() + within
    while True:
        async with open_archive(path) as store:
            messages = await store.list_messages(session_id)
        settled = all(m.status not in OPEN for m in messages)
        if (len(messages) >= count and settled) or time.monotonic() > deadline:
            return messages
        await asyncio.sleep(0.05)


async def wait_for_open_reply(path: Path, session_id: str, within: float = 10.0) -> Message:
    """Poll until the session's reply in progress is archived (`pending` or `streaming`)."""
    deadline = time.monotonic() + within
    while True:
        async with open_archive(path) as store:
            messages = await store.list_messages(session_id)
        open_replies = [m for m in messages if m.status in OPEN]
        if open_replies:
            return open_replies[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no reply in progress in {session_id}: {messages}")
        await asyncio.sleep(0.05)


async def wait_for_tool_calls(
    path: Path, session_id: str, within: float = 10.0
) -> list[ToolCallRecord]:
    """Poll until the session has archived a tool call; its calls."""
    deadline = time.monotonic() + within
    while True:
        async with open_archive(path) as store:
            calls = await store.list_tool_calls(session_id)
        if calls or time.monotonic() > deadline:
            return list(calls)
        await asyncio.sleep(0.02)


@dataclass(frozen=True)
class Ledger:
    """A session's effects as archived: its messages, turns and tool calls."""

    messages: list[Message]
    turns: list[Turn]
    tool_calls: list[ToolCallRecord]


async def read_ledger(path: Path, session_id: str) -> Ledger:
    async with open_archive(path) as store:
        return Ledger(
            list(await store.list_messages(session_id)),
            list(await store.list_turns(session_id)),
            list(await store.list_tool_calls(session_id)),
        )


async def assert_ledger(
    path: Path,
    session_id: str,
    messages: Sequence[tuple[str, str]],
    *,
    turns: Sequence[TurnState] | None = None,
    tool_results: Mapping[str, Any] | None = None,
    within: float = 10.0,
) -> Ledger:
    """The effect ledger of one session holds exactly what it should: zero loss, zero
    duplicates, counted by id.

    `messages`: the conversation as (role, content), in archive order (the tool-call
    records are checked apart). `turns`: the states of the session's turns in order
    (default: one completed turn per user message). `tool_results`: call id -> the
    result archived for that call (default: no tool call); each call has exactly one
    input and one output message. Waits (up to `within`) for the server's asynchronous
    writes to settle: the expected counts reached, no reply still streaming, every
    turn ended.
    """
    expected_turns = (
        list(turns)
        if turns is not None
        else [TurnState.COMPLETED] * sum(role == "user" for role, _ in messages)
    )
    expected_results = dict(tool_results or {})
    deadline = time.monotonic() + within
    while True:
        ledger = await read_ledger(path, session_id)
        settled = (
            len(ledger.messages) >= len(messages) + 2 * len(expected_results)
            and len(ledger.turns) >= len(expected_turns)
            and len(ledger.tool_calls) >= len(expected_results)
            and all(m.status not in OPEN for m in ledger.messages)
            and all(t.state in ENDED for t in ledger.turns)
        )
        if settled or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    # (support modules get no assertion rewriting: the messages say what differs)
    _no_repeated_ids("message", [m.id for m in ledger.messages])
    _no_repeated_ids("turn", [t.id for t in ledger.turns])
    _no_repeated_ids("tool call", [c.id for c in ledger.tool_calls])
    # A reply is split at its tool calls; the part before a call the agent made first is
    # empty, and readers skip it (docs/storage.md).
    conversation = [
        m
        for m in ledger.messages
        if m.content_type not in TOOL_RECORDS
        and not (m.role == "assistant" and not m.content and not m.parts)
    ]
    archived = [(m.role, m.content) for m in conversation]
    assert archived == list(messages), f"messages: archived {archived}, expected {messages}"
    states = [t.state for t in ledger.turns]
    assert states == expected_turns, f"turns: archived {states}, expected {expected_turns}"
    # Each turn answered once: one reply of the agent's per turn and tool call at most
    # (the reply is split at its calls), none orphaned.
    turn_ids = {t.id for t in ledger.turns}
    replies = Counter(m.turn_id for m in conversation if m.role == "assistant")
    calls = Counter(c.turn_id for c in ledger.tool_calls)
    assert set(replies) <= turn_ids, f"replies of unknown turns: {replies}"
    twice = {turn: n for turn, n in replies.items() if n > 1 + calls[turn]}
    assert not twice, f"a turn answered twice: {replies}"
    # Each tool call once, its request and its outcome archived once each.
    results = {c.id: c.result for c in ledger.tool_calls}
    assert results == expected_results, f"tool results: {results}, expected {expected_results}"
    assert {c.turn_id for c in ledger.tool_calls} <= turn_ids, "tool calls of unknown turns"
    for content_type in TOOL_RECORDS:
        ids = [
            json.loads(m.content).get("id")
            for m in ledger.messages
            if m.content_type == content_type
        ]
        assert sorted(ids) == sorted(results), f"{content_type} messages: {ids}"
    return ledger


def _no_repeated_ids(kind: str, ids: list[str]) -> None:
    repeated = [key for key, count in Counter(ids).items() if count > 1]
    assert not repeated, f"{kind} archived more than once: {repeated}"
