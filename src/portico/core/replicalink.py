"""What the engine asks of the other replicas, when there are any (docs/replicas.md).

The engine holds an optional `ReplicaLink`; without one (bus=memory) it runs exactly as
one process does, with nothing on its hot path. The implementation lives in
`portico.replication`, above the core: it drives the engine through `RemoteSink`.
"""

from __future__ import annotations

from typing import Protocol

from portico.core.events import TurnEvent


class RemoteSink(Protocol):
    """The engine as the link sees it: where events of turns run elsewhere go, and the
    control that other replicas address to turns running here."""

    def deliver_to_session(self, session_id: str, event: TurnEvent) -> None: ...

    def deliver_to_owner(self, owner: str, event: TurnEvent) -> None: ...

    async def stop_here(self, session_id: str) -> bool: ...


class ReplicaLink(Protocol):
    def bind(self, sink: RemoteSink) -> None: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    # -- output of turns running here, for listeners elsewhere ---------------------------

    def published(self, session_id: str, owner: str, event: TurnEvent) -> None:
        """A turn running here emitted `event`: queue it for the other replicas, in order."""
        ...

    # -- listeners here, for turns running elsewhere -------------------------------------

    def watch_session(self, session_id: str) -> None: ...

    def unwatch_session(self, session_id: str) -> None: ...

    async def session_position(self, session_id: str) -> str:
        """Where the session's relayed events stand now (opaque; "" for the start)."""
        ...

    async def recent_session_events(
        self, session_id: str, count: int, after: str = ""
    ) -> list[TurnEvent]:
        """The session's newest `count` relayed turn events since position `after`,
        newest first, from every replica (a takeover's replay)."""
        ...

    def watch_owner(self, owner: str) -> None: ...

    def unwatch_owner(self, owner: str) -> None: ...

    # -- one turn per session across replicas --------------------------------------------

    async def claim(self, session_id: str) -> bool:
        """Take the session's turn lock for this replica; False when another replica
        holds it. Raises `BusUnavailable` when the lock cannot be asked for."""
        ...

    def holds(self, session_id: str) -> bool: ...

    def release(self, session_id: str) -> None: ...

    async def runs_elsewhere(self, session_id: str) -> bool:
        """Another replica holds the session's turn lock. Raises `BusUnavailable`."""
        ...

    # -- control for turns running elsewhere ---------------------------------------------

    async def stop_elsewhere(self, session_id: str) -> bool:
        """Stop the session's turn on the replica running it; False when none runs."""
        ...
