"""The client-tool broker: a turn's `ToolCall` goes to the owner's connection and back.

Shared by every protocol: `/ws` turns the emitted `TurnToolCall` into a
`tool_call` frame and feeds `tool_call_ack`, `tool_call_nack` and `tool_result`
back through `acknowledge`, `reject` and `answer`. A call waits `ack_timeout`
for its acknowledgement and then `answer_timeout` for its result; a call that
runs out of time is recorded `timeout`, the runtime gets a denial, and the
client is told (`TurnToolCallTimedOut`) so it stops waiting too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from portico.core.events import TurnEvent, TurnToolCall, TurnToolCallTimedOut
from portico.core.model import ToolCallRecord
from portico.core.states import ToolCallState, ToolCallTrigger, next_tool_call_state
from portico.core.telemetry import NoTelemetry, Telemetry
from portico.errors import InvalidMessage
from portico.runtime.base import ToolCall, ToolOutcome
from portico.store.base import Store

log = logging.getLogger("portico.tools")

# Delivers an event to the session's connections; returns how many received it.
Emit = Callable[[TurnEvent], int]

TIMED_OUT = "the client did not answer the tool call in time"
TURN_ENDED = "the turn ended before the tool answered"


class ToolBroker(Protocol):
    async def call(
        self, owner: str, session_id: str, turn_id: str, call: ToolCall, emit: Emit
    ) -> ToolOutcome:
        """Deliver the call, wait for its outcome, archive it."""


class _Pending:
    def __init__(self, owner: str, record: ToolCallRecord, deadline: float) -> None:
        self.owner = owner
        self.record = record
        self.deadline = deadline
        self.outcome: asyncio.Future[tuple[ToolCallTrigger, ToolOutcome]] = (
            asyncio.get_running_loop().create_future()
        )


class ClientToolBroker:
    def __init__(
        self,
        *,
        store: Store,
        ack_timeout: float,
        answer_timeout: float,
        clock: Callable[[], float],
        telemetry: Telemetry | None = None,
    ) -> None:
        self._telemetry = telemetry or NoTelemetry()
        self._store = store
        self._ack_timeout = ack_timeout
        self._answer_timeout = answer_timeout
        self._clock = clock
        self._pending: dict[str, _Pending] = {}

    async def call(
        self, owner: str, session_id: str, turn_id: str, call: ToolCall, emit: Emit
    ) -> ToolOutcome:
        now = self._clock()
        record = ToolCallRecord(
            id=call.id,
            session_id=session_id,
            turn_id=turn_id,
            name=call.name,
            arguments=call.arguments,
            consent_message=call.consent_message,
            categories=call.categories,
            state=ToolCallState.PENDING,
            created_at=now,
            updated_at=now,
        )
        loop = asyncio.get_running_loop()
        pending = _Pending(owner, record, loop.time() + self._ack_timeout)
        self._pending[call.id] = pending
        try:
            await self._store.save_tool_call(record)
            if emit(TurnToolCall(session_id, turn_id, call)) and call.id in self._pending:
                await self._advance(pending, ToolCallTrigger.DELIVER)
            trigger, outcome = await self._wait(pending)
        except asyncio.CancelledError:
            self._pending.pop(call.id, None)
            await asyncio.shield(self._end(pending, ToolCallTrigger.NACK, error=TURN_ENDED))
            raise
        if trigger is ToolCallTrigger.EXPIRE:
            emit(TurnToolCallTimedOut(session_id, turn_id, call.id, TIMED_OUT))
        await self._end(pending, trigger, result=outcome.result, error=outcome.error or "")
        return outcome

    async def _wait(self, pending: _Pending) -> tuple[ToolCallTrigger, ToolOutcome]:
        """The client's answer, or EXPIRE once the (movable) deadline passes."""
        loop = asyncio.get_running_loop()
        while not pending.outcome.done():
            remaining = pending.deadline - loop.time()
            if remaining <= 0:
                self._pending.pop(pending.record.id, None)
                return ToolCallTrigger.EXPIRE, ToolOutcome(status="denied", error=TIMED_OUT)
            await asyncio.wait({pending.outcome}, timeout=remaining)
        return pending.outcome.result()

    async def _advance(self, pending: _Pending, trigger: ToolCallTrigger, **changes: Any) -> None:
        state = next_tool_call_state(pending.record.state, trigger)
        pending.record = msgspec.structs.replace(
            pending.record, state=state, updated_at=self._clock(), **changes
        )
        await self._store.save_tool_call(pending.record)

    async def _end(self, pending: _Pending, trigger: ToolCallTrigger, **changes: Any) -> None:
        await self._advance(pending, trigger, **changes)
        self._telemetry.tool_call_ended(pending.record.state)
        log.info(
            "tool call ended session=%s call=%s tool=%s state=%s",
            pending.record.session_id,
            pending.record.id,
            pending.record.name,
            pending.record.state,
        )

    # -- the client's side --------------------------------------------------------

    def _open_call(self, principal: str, call_id: str) -> _Pending:
        pending = self._pending.get(call_id)
        if pending is None or pending.owner != principal or pending.outcome.done():
            # Another principal's call looks exactly like an unknown one.
            raise InvalidMessage(f"no pending tool call {call_id!r}")
        return pending

    async def acknowledge(self, principal: str, call_id: str) -> None:
        """The client is working on it: the wait becomes `answer_timeout` from now."""
        pending = self._open_call(principal, call_id)
        if pending.record.state is ToolCallState.EXECUTING:
            return  # a repeated ack changes nothing
        pending.deadline = asyncio.get_running_loop().time() + self._answer_timeout
        await self._advance(pending, ToolCallTrigger.ACK)

    def reject(self, principal: str, call_id: str, reason: str) -> None:
        pending = self._open_call(principal, call_id)
        self._pending.pop(call_id)
        pending.outcome.set_result(
            (ToolCallTrigger.NACK, ToolOutcome(status="denied", error=reason))
        )

    def answer(self, principal: str, call_id: str, result: Any, error: str | None) -> None:
        pending = self._open_call(principal, call_id)
        self._pending.pop(call_id)
        if error is not None:
            outcome = (ToolCallTrigger.ERROR, ToolOutcome(status="error", error=error))
        else:
            outcome = (ToolCallTrigger.RESULT, ToolOutcome(status="completed", result=result))
        pending.outcome.set_result(outcome)


class NoClientTools:
    """Denies every client tool call at once: for agents served where no client answers."""

    async def call(
        self, owner: str, session_id: str, turn_id: str, call: ToolCall, emit: Emit
    ) -> ToolOutcome:
        return ToolOutcome(status="denied", error="client tools are not available")
