"""What the engine reports about its work; the server plugs in Prometheus."""

from __future__ import annotations

from typing import Protocol

from portico.domain.states import ToolCallState, TurnState


class Telemetry(Protocol):
    def turn_ended(
        self, state: TurnState, *, first_chunk_seconds: float | None, duration_seconds: float
    ) -> None: ...

    def tool_call_ended(self, state: ToolCallState) -> None: ...


class NoTelemetry:
    def turn_ended(
        self, state: TurnState, *, first_chunk_seconds: float | None, duration_seconds: float
    ) -> None:
        return None

    def tool_call_ended(self, state: ToolCallState) -> None:
        return None
