"""The client-tool broker port: how a turn's `ToolCall` reaches a client and back."""

from __future__ import annotations

from typing import Protocol

from portico.core.events import Listener
from portico.runtime.base import ToolCall, ToolOutcome


class ToolBroker(Protocol):
    async def call(
        self, session_id: str, turn_id: str, call: ToolCall, emit: Listener
    ) -> ToolOutcome:
        """Deliver the call (through `emit`), wait for its outcome, record it."""


class NoClientTools:
    """Denies every client tool call: the agent continues without the tool.

    The broker that sends `tool_call` frames and waits for acks and results
    replaces this in the `/ws`-complete issue.
    """

    async def call(
        self, session_id: str, turn_id: str, call: ToolCall, emit: Listener
    ) -> ToolOutcome:
        return ToolOutcome(status="denied", error="client tools are not available")
