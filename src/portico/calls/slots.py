"""Concurrent audio sessions, as pure counting: per process and per principal."""

from __future__ import annotations

from typing import Literal

Refusal = Literal["process", "principal"]


class AudioSessionSlots:
    """`max_total` live or parked calls in the process, `max_per_principal` (None: no
    cap) per principal. Taking a slot that is not there takes nothing."""

    def __init__(self, max_total: int, max_per_principal: int | None) -> None:
        self._max_total = max_total
        self._max_per_principal = max_per_principal
        self._held: dict[str, int] = {}
        self.in_use = 0

    def take(self, principal: str) -> Refusal | None:
        """None when the slot was taken, else which limit refused it."""
        if self.in_use >= self._max_total:
            return "process"
        held = self._held.get(principal, 0)
        if self._max_per_principal is not None and held >= self._max_per_principal:
            return "principal"
        self._held[principal] = held + 1
        self.in_use += 1
        return None

    def give(self, principal: str) -> None:
        held = self._held.get(principal, 0)
        if held <= 0:
            return  # never below zero, whatever a caller does
        self.in_use -= 1
        if held == 1:
            del self._held[principal]
        else:
            self._held[principal] = held - 1

    def held_by(self, principal: str) -> int:
        return self._held.get(principal, 0)
