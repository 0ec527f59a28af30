"""Where each `/ws` call lives, for a `?resume` that reaches any replica (docs/replicas.md).

A small port beside the in-process parking lot: the lot keeps the call objects of this
process, the directory decides who may take a call over. Each record names the call's
owner, the replica running it, its agent and caller format, a token (one per holding of
the call), and while it is parked the end of its window. `claim` is the one gate: the
owner's claim of a live call, or of a parked one inside its window, removes the record
in one step, so two reconnects racing on two replicas get the call once. Another
principal's claim changes nothing.

The in-process default is a dict (one process: every record is this replica's); the
Redis backend (`calls/redis_directory.py`) shares the records between replicas.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from portico.runtime.duplex.base import AudioFormat


class CallRecord(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    owner: str
    agent: str
    replica: str  # the replica running the call
    token: str  # this holding of the call; a later holding gets a new one
    format: AudioFormat  # the caller's, as its first frame named it
    until: float | None = None  # wall clock: the end of its parking window; None: live


class CallDirectory(Protocol):
    async def register(self, record: CallRecord) -> None:
        """A live call (replacing any earlier record of its session)."""

    async def park(self, session_id: str, token: str, until: float) -> None:
        """The call holding `token` is parked until `until`; a no-op for another token."""

    async def claim(self, session_id: str, principal: str, now: float) -> CallRecord | None:
        """The record, removed, when it is `principal`'s and live or parked before `now`
        passed its window; None otherwise (another principal's record stays)."""

    async def drop(self, session_id: str, token: str) -> None:
        """The call holding `token` ended; a no-op for another token."""

    async def close(self) -> None: ...


class InProcessCallDirectory:
    def __init__(self) -> None:
        self._records: dict[str, CallRecord] = {}

    async def register(self, record: CallRecord) -> None:
        self._records[record.session_id] = record

    async def park(self, session_id: str, token: str, until: float) -> None:
        record = self._records.get(session_id)
        if record is not None and record.token == token:
            self._records[session_id] = msgspec.structs.replace(record, until=until)

    async def claim(self, session_id: str, principal: str, now: float) -> CallRecord | None:
        record = self._records.get(session_id)
        if record is None or not claimable(record, principal, now):
            return None
        del self._records[session_id]
        return record

    async def drop(self, session_id: str, token: str) -> None:
        record = self._records.get(session_id)
        if record is not None and record.token == token:
            del self._records[session_id]

    async def close(self) -> None:
        self._records.clear()


def claimable(record: CallRecord, principal: str, now: float) -> bool:
    return record.owner == principal and (record.until is None or now < record.until)
