"""In-process transport states: a dict; sessions do not outlive the process."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class InProcessTransportStates(Generic[T]):
    def __init__(self) -> None:
        self._states: dict[str, T] = {}

    def get(self, session_id: str) -> T | None:
        return self._states.get(session_id)

    def put(self, session_id: str, state: T) -> None:
        self._states[session_id] = state

    def remove(self, session_id: str) -> None:
        self._states.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._states)
