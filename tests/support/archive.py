"""Read a running server's SQLite archive from the test process (WAL allows it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from portico.core.model import Message, ToolCallRecord
from portico.store.sqlite import SqliteStore

OPEN = ("pending", "streaming")  # a reply still being written


@asynccontextmanager
async def open_archive(path: Path) -> AsyncIterator[SqliteStore]:
    store = SqliteStore(path)
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
