"""A server's lifecycle and its drain, sans-I/O: which phase it is in, and which
connections to close and when turns are interrupted while it stops.

Phases: STARTING (the archive opens) -> ADMITTING -> DRAINING (a stop signal) ->
STOPPED. While DRAINING nothing new is admitted; each connection is told to move
(close 1001) as soon as no turn runs on it, so its client reconnects elsewhere at
once; turns get until the deadline to finish, then are interrupted; once every turn
has ended and every connection was told, the drain is over. A second stop signal
moves the deadline to now. The adapter (server/drain.py) owns the clock, the
sockets and the engine; it feeds them in through `step` and carries out its answer.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from portico.errors import IllegalTransition

K = TypeVar("K")  # a connection: any hashable handle


class Phase(enum.Enum):
    STARTING = "starting"
    ADMITTING = "admitting"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(frozen=True)
class DrainStep(Generic[K]):
    """What the adapter does now: close these connections with 1001, interrupt every
    running turn, and wake again at `wake_at` (or sooner, when a turn ends)."""

    close: tuple[K, ...] = ()
    interrupt: bool = False
    wake_at: float = math.inf


class Lifecycle(Generic[K]):
    def __init__(self, *, drain_timeout: float) -> None:
        self.drain_timeout = drain_timeout
        self.phase = Phase.STARTING
        self.deadline = math.inf  # when running turns are interrupted
        self._told: set[K] = set()  # connections already sent 1001
        self._interrupted = False

    @property
    def admitting(self) -> bool:
        """Whether a new connection or a new turn may start."""
        return self.phase is Phase.ADMITTING

    def started(self) -> None:
        if self.phase is not Phase.STARTING:
            raise IllegalTransition("lifecycle", self.phase.value, "started")
        self.phase = Phase.ADMITTING

    def stop_requested(self, now: float) -> None:
        """A stop signal: the first starts the drain, the next cuts it short."""
        if self.phase is Phase.STOPPED:
            return
        if self.phase is Phase.DRAINING:
            self.deadline = min(self.deadline, now)
            return
        self.phase = Phase.DRAINING
        self.deadline = now + self.drain_timeout

    def step(self, now: float, busy: Mapping[K, bool], turns_running: int) -> DrainStep[K]:
        """`busy`: each open connection and whether a turn (or a request) runs on it;
        `turns_running`: the turns this process runs."""
        if self.phase is not Phase.DRAINING:
            return DrainStep()
        overdue = now >= self.deadline
        if overdue and turns_running and not self._interrupted:
            # Interrupt first, close after: each client gets its turn's terminal frame
            # before the close frame.
            self._interrupted = True
            return DrainStep(interrupt=True)
        # Past the deadline with the turns ended (or interrupted): close what is left.
        past = overdue and (self._interrupted or not turns_running)
        close = tuple(
            key for key, running in busy.items() if key not in self._told and (past or not running)
        )
        self._told.update(close)
        waiting = any(key not in self._told for key in busy)
        if past or (not turns_running and not waiting):
            self.phase = Phase.STOPPED
            return DrainStep(close=close)
        return DrainStep(close=close, wake_at=self.deadline)
