"""The session trace: an append-only list of timestamped session events that the
session's owner can read and the archive keeps with the session (spec/identity.md,
AI disclosure and the session trace)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

log = logging.getLogger("portico.trace")
DISCLOSURE_DISPLAYED = "ai.disclosure.displayed"
MESSAGE_METADATA = "message.metadata"
TOOL_OUTCOME = "tool.outcome"
CREDENTIAL_REFRESHED = "credential.refreshed"
ERROR = "error"


class TraceEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One event; `data` is small and never holds message bodies or tool arguments."""

    session_id: str
    owner: str
    kind: str
    at: float  # seconds since the epoch
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class TraceArchive(Protocol):
    """The part of the Store port the trace uses."""

    async def append_trace(self, event: TraceEvent) -> None: ...


class SessionTraces:
    """Records trace events without holding up the caller: a trace write never delays
    a turn, and a failed one is logged, not raised (the trace is a record, not a gate)."""

    def __init__(self, archive: TraceArchive, clock: Callable[[], float] = time.time) -> None:
        self._archive = archive
        self._clock = clock
        self._writing: set[asyncio.Task[None]] = set()

    def record(self, session_id: str, owner: str, kind: str, **data: Any) -> None:
        event = TraceEvent(
            session_id=session_id, owner=owner, kind=kind, at=self._clock(), data=data
        )
        task = asyncio.create_task(self._archive.append_trace(event))
        self._writing.add(task)
        task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task[None]) -> None:
        self._writing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("recording a trace event failed", exc_info=task.exception())

    def tool_outcome(self, session_id: str, owner: str, tool: str, status: str) -> None:
        """A tool call ended (client-side, or server-side in a runtime): its name and
        status only, never its arguments or result."""
        self.record(session_id, owner, TOOL_OUTCOME, tool=tool, status=status)

    def credential_refreshed(self, session_id: str, owner: str, *, protocol: str) -> None:
        """A connection on the session took a refreshed credential (nothing of the
        token is recorded)."""
        self.record(session_id, owner, CREDENTIAL_REFRESHED, protocol=protocol)

    async def drain(self) -> None:
        """Wait for the events recorded so far to be written (shutdown, tests)."""
        await asyncio.gather(*self._writing, return_exceptions=True)
