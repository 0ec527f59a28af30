"""Parked calls: a dropped connection's live call, kept for `realtime_grace_window`.

A small port, so that a shared implementation (Redis, for replicas: who owns which
parked session, and where it runs) can follow the in-process one. The lot holds no
clock: deadlines come in as numbers and `expired(now)` hands back what is due.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class ParkingLot(Protocol[T]):
    def park(self, session_id: str, owner: str, call: T, until: float) -> None:
        """Keep `call` for `owner` until `until` (a later park replaces an earlier one)."""

    def reclaim(self, session_id: str, principal: str, now: float) -> T | None:
        """The parked call, removed, when it is `principal`'s and not expired; None
        otherwise (another principal's call stays parked for its owner)."""

    def discard(self, session_id: str) -> T | None:
        """Forget the session's parked call (it ended by itself)."""

    def expired(self, now: float) -> list[T]:
        """Remove and return every call whose window is over."""

    def next_deadline(self) -> float | None: ...

    def __len__(self) -> int: ...


class InProcessParkingLot(Generic[T]):
    def __init__(self) -> None:
        self._parked: dict[str, tuple[str, T, float]] = {}

    def park(self, session_id: str, owner: str, call: T, until: float) -> None:
        self._parked[session_id] = (owner, call, until)

    def reclaim(self, session_id: str, principal: str, now: float) -> T | None:
        entry = self._parked.get(session_id)
        if entry is None:
            return None
        owner, call, until = entry
        if owner != principal or now >= until:
            return None
        del self._parked[session_id]
        return call

    def discard(self, session_id: str) -> T | None:
        entry = self._parked.pop(session_id, None)
        return None if entry is None else entry[1]

    def expired(self, now: float) -> list[T]:
        due = [sid for sid, (_, _, until) in self._parked.items() if now >= until]
        return [self._parked.pop(sid)[1] for sid in due]

    def next_deadline(self) -> float | None:
        return min((until for _, _, until in self._parked.values()), default=None)

    def __len__(self) -> int:
        return len(self._parked)
