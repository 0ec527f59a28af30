"""Where `/v1/session` keeps each session's transport state between connections.

The in-process store holds the live objects; a Redis implementation would keep
positions and the resend buffer so a session survives its replica's death.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

T = TypeVar("T")


class TransportStates(Protocol[T]):
    def get(self, session_id: str) -> T | None: ...

    def put(self, session_id: str, state: T) -> None: ...

    def remove(self, session_id: str) -> None: ...

    def __len__(self) -> int: ...
