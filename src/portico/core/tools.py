"""The client-tool broker: a turn's `ToolCall` goes to the owner's clients and back.

Shared by every protocol. `/ws` and `/v1/session` turn the emitted
`TurnToolCall` into a `tool_call` frame and feed acks, nacks and results back
through `acknowledge`, `reject` and `answer`; such a call waits `ack_timeout`
for its acknowledgement and then `answer_timeout` from the ack. `/v1/rpc`
clients see the call as an Rtc (its archived record, pushed as an update) and
move it with `rtc_status` and `rtc_submit`; for them the whole call has
`answer_timeout` from its creation (rpc-protocol.md section 7), and so has a
call no connection received. A call that runs out of time ends `timeout`, the
runtime gets a denial, and `/ws` clients are told (`TurnToolCallTimedOut`).

Every call is archived with a `toolcall_input` message before it goes out and
a `toolcall_output` message when it ends; whoever ends a call (an answer, a
rejection, the deadline, the turn's end) writes its terminal state once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Literal, Protocol

import msgspec

from portico.core.events import TurnEvent, TurnToolCall, TurnToolCallTimedOut
from portico.core.telemetry import NoTelemetry, Telemetry
from portico.domain.model import Message, ToolCallRecord, new_id
from portico.domain.states import (
    TERMINAL_TOOL_CALL_STATES,
    ToolCallState,
    ToolCallTrigger,
    next_tool_call_state,
)
from portico.errors import Forbidden, IllegalTransition, InvalidMessage, RtcInvalidTransition
from portico.runtime.base import ToolCall, ToolOutcome
from portico.store.base import Store

log = logging.getLogger("portico.tools")

# Delivers an event to the session's connections; returns how many received it.
Emit = Callable[[TurnEvent], int]

TIMED_OUT = "the client did not answer the tool call in time"
TURN_ENDED = "the turn ended before the tool answered"
_encode = msgspec.json.Encoder().encode


def _no_offset() -> int:
    return 0


class ClientReply(msgspec.Struct, frozen=True, kw_only=True):
    """A `/ws` or `/v1/session` client's ack, nack or result for a tool call."""

    kind: Literal["ack", "nack", "result"]
    reason: str = ""  # nack
    result: Any = None
    error: str | None = None


class RtcStep(msgspec.Struct, frozen=True, kw_only=True):
    """A `/v1/rpc` client's move of an Rtc: `v1.rtc.update_status` or `submit_result`."""

    kind: Literal["status", "submit"]
    status: Literal["executing", "rejected"] = "executing"
    success: bool = False
    result: Any = None
    error: str = ""
    client_id: str = ""


class ToolRelay(Protocol):
    """Where a reply goes when the call is not held here: the replica running its turn."""

    async def forward_reply(self, principal: str, call_id: str, reply: ClientReply) -> None: ...

    async def forward_rtc(self, record: ToolCallRecord, step: RtcStep) -> ToolCallRecord | None:
        """Apply `step` on the replica whose turn waits for the call; the record after it,
        or None when no live replica runs the call's turn (it is applied here)."""
        ...


class ToolBroker(Protocol):
    # Whether a call is archived as `toolcall_input` and `toolcall_output` messages: the
    # turn then splits its reply at the call (docs/storage.md).
    archives_calls: bool

    async def call(
        self,
        owner: str,
        session_id: str,
        turn_id: str,
        call: ToolCall,
        emit: Emit,
        next_offset: Callable[[], int] = _no_offset,
    ) -> ToolOutcome:
        """Deliver the call, wait for its outcome, archive it. `next_offset` numbers the
        turn's messages (`turn_offset`)."""


class _Pending:
    def __init__(
        self, owner: str, record: ToolCallRecord, deadline: float, *, extend_on_ack: bool
    ) -> None:
        self.owner = owner
        self.record = record
        self.deadline = deadline
        self.extend_on_ack = extend_on_ack
        self.next_offset: Callable[[], int] = _no_offset
        # Resolved by whoever ends the call; True when that party already archived the end.
        self.outcome: asyncio.Future[tuple[ToolCallTrigger, ToolOutcome, bool]] = (
            asyncio.get_running_loop().create_future()
        )


class ClientToolBroker:
    archives_calls = True

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
        # Calls whose end is being archived: a late reply waits for it instead of racing.
        self._ending: dict[str, asyncio.Future[ToolCallRecord]] = {}
        self._rpc_clients: dict[str, int] = {}
        # Set when replicas share the bus: replies for calls of turns running elsewhere.
        self.relay: ToolRelay | None = None

    # -- the turn's side ----------------------------------------------------------------

    async def call(
        self,
        owner: str,
        session_id: str,
        turn_id: str,
        call: ToolCall,
        emit: Emit,
        next_offset: Callable[[], int] = _no_offset,
    ) -> ToolOutcome:
        record = await self._open(session_id, turn_id, call, next_offset)
        pending = self._register(owner, record)
        pending.next_offset = next_offset
        try:
            await self._store.save_tool_call(record)
            delivered = emit(TurnToolCall(session_id, turn_id, call))
            self._set_deadline(pending, delivered=bool(delivered))
            # An RPC connection may have reported the delivery already.
            still_pending = pending.record.state is ToolCallState.PENDING
            if delivered and still_pending and call.id in self._pending:
                await self._advance(pending, ToolCallTrigger.DELIVER)
            trigger, outcome, archived = await self._wait(pending)
        except asyncio.CancelledError:
            if self._pending.pop(call.id, None) is not None:
                await asyncio.shield(self._end(pending, ToolCallTrigger.NACK, error=TURN_ENDED))
            raise
        if trigger is ToolCallTrigger.EXPIRE:
            emit(TurnToolCallTimedOut(session_id, turn_id, call.id, TIMED_OUT))
        if not archived:
            await self._end(pending, trigger, result=outcome.result, error=outcome.error or "")
        return outcome

    async def _open(
        self, session_id: str, turn_id: str, call: ToolCall, next_offset: Callable[[], int]
    ) -> ToolCallRecord:
        """Archive the `toolcall_input` message; the call's record points at it."""
        now = self._clock()
        request = {"id": call.id, "name": call.name, "arguments": call.arguments}
        message = await self._store.append_message(
            Message(
                id=new_id("msg"),
                session_id=session_id,
                turn_id=turn_id,
                role="assistant",
                content=_encode(request).decode(),
                content_type="toolcall_input",
                created_at=now,
                updated_at=now,
                turn_offset=next_offset(),
            )
        )
        return ToolCallRecord(
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
            message_id=message.id,
        )

    def _register(self, owner: str, record: ToolCallRecord) -> _Pending:
        deadline = asyncio.get_running_loop().time() + self._answer_timeout
        pending = _Pending(owner, record, deadline, extend_on_ack=False)
        self._pending[record.id] = pending
        return pending

    def _set_deadline(self, pending: _Pending, *, delivered: bool) -> None:
        # Omnia semantics (a short wait for the ack, then the answer timeout from it)
        # only when a session connection took the call and no RPC client is about.
        if delivered and not self._rpc_clients.get(pending.owner):
            pending.extend_on_ack = True
            pending.deadline = asyncio.get_running_loop().time() + self._ack_timeout

    async def _wait(self, pending: _Pending) -> tuple[ToolCallTrigger, ToolOutcome, bool]:
        """The client's answer, or EXPIRE once the (movable) deadline passes."""
        loop = asyncio.get_running_loop()
        while not pending.outcome.done():
            remaining = pending.deadline - loop.time()
            if remaining <= 0 and self._pending.pop(pending.record.id, None) is not None:
                return ToolCallTrigger.EXPIRE, ToolOutcome(status="denied", error=TIMED_OUT), False
            await asyncio.wait({pending.outcome}, timeout=max(remaining, 0.001))
        return pending.outcome.result()

    async def _advance(self, pending: _Pending, trigger: ToolCallTrigger, **changes: Any) -> None:
        # The new state is taken before the write is awaited, so a concurrent step (the
        # RPC connection reporting delivery, say) starts from it and is not applied twice.
        pending.record = self._next(pending.record, trigger, **changes)
        await self._store.save_tool_call(pending.record)

    async def _save(
        self, record: ToolCallRecord, trigger: ToolCallTrigger, **changes: Any
    ) -> ToolCallRecord:
        updated = self._next(record, trigger, **changes)
        await self._store.save_tool_call(updated)
        return updated

    def _next(
        self, record: ToolCallRecord, trigger: ToolCallTrigger, **changes: Any
    ) -> ToolCallRecord:
        state = next_tool_call_state(record.state, trigger)
        return msgspec.structs.replace(record, state=state, updated_at=self._clock(), **changes)

    async def _end(self, pending: _Pending, trigger: ToolCallTrigger, **changes: Any) -> None:
        """Archive the call's terminal state and its `toolcall_output` message, once."""
        done: asyncio.Future[ToolCallRecord] = asyncio.get_running_loop().create_future()
        self._ending[pending.record.id] = done
        try:
            await self._advance(pending, trigger, **changes)
            await self._archive_output(pending.record, pending.next_offset)
        finally:
            self._ending.pop(pending.record.id, None)
            done.set_result(pending.record)
        self._telemetry.tool_call_ended(pending.record.state)
        log.info(
            "tool call ended session=%s call=%s tool=%s state=%s",
            pending.record.session_id,
            pending.record.id,
            pending.record.name,
            pending.record.state,
        )

    async def _archive_output(self, record: ToolCallRecord, next_offset: Callable[[], int]) -> None:
        now = self._clock()
        output = {
            "id": record.id,
            "name": record.name,
            "status": record.state.value,
            "result": record.result,
            "error": record.error,
        }
        await self._store.append_message(
            Message(
                id=new_id("msg"),
                session_id=record.session_id,
                turn_id=record.turn_id,
                role="tool",
                content=_encode(output).decode(),
                content_type="toolcall_output",
                created_at=now,
                updated_at=now,
                turn_offset=next_offset(),
            )
        )

    # -- /ws and /v1/session clients ----------------------------------------------------

    async def settle(self, principal: str, call_id: str, reply: ClientReply) -> None:
        """A client's reply, applied here or on the replica whose turn made the call."""
        if self.relay is not None and call_id not in self._pending:
            await self.relay.forward_reply(principal, call_id, reply)
            return
        await self.settle_here(principal, call_id, reply)

    async def settle_here(self, principal: str, call_id: str, reply: ClientReply) -> None:
        if reply.kind == "ack":
            await self.acknowledge(principal, call_id)
        elif reply.kind == "nack":
            self.reject(principal, call_id, reply.reason)
        else:
            self.answer(principal, call_id, reply.result, reply.error)

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
        if pending.extend_on_ack:
            pending.deadline = asyncio.get_running_loop().time() + self._answer_timeout
        await self._advance(pending, ToolCallTrigger.ACK)

    def reject(self, principal: str, call_id: str, reason: str) -> None:
        pending = self._open_call(principal, call_id)
        self._pending.pop(call_id)
        outcome = ToolOutcome(status="denied", error=reason)
        pending.outcome.set_result((ToolCallTrigger.NACK, outcome, False))

    def answer(self, principal: str, call_id: str, result: Any, error: str | None) -> None:
        pending = self._open_call(principal, call_id)
        self._pending.pop(call_id)
        trigger, outcome = _answer_outcome(error is None, result, error or "")
        pending.outcome.set_result((trigger, outcome, False))

    # -- /v1/rpc clients ----------------------------------------------------------------

    def rpc_attached(self, principal: str) -> None:
        self._rpc_clients[principal] = self._rpc_clients.get(principal, 0) + 1

    def rpc_detached(self, principal: str) -> None:
        left = self._rpc_clients.get(principal, 0) - 1
        if left > 0:
            self._rpc_clients[principal] = left
        else:
            self._rpc_clients.pop(principal, None)

    async def deliver_waiting(self, principal: str) -> None:
        """A connection of the principal opened: its calls nobody received are `sent` now
        (the change is pushed to that connection too, also when it did not recover)."""
        for pending in list(self._pending.values()):
            if pending.owner == principal and pending.record.state is ToolCallState.PENDING:
                await self._advance(pending, ToolCallTrigger.DELIVER)

    async def delivered(self, call_ids: list[str]) -> None:
        """A connection of the owner received these calls (`pending` Rtcs): now `sent`."""
        for call_id in call_ids:
            pending = self._pending.get(call_id)
            if pending is not None:
                if pending.record.state is ToolCallState.PENDING:
                    await self._advance(pending, ToolCallTrigger.DELIVER)
                continue
            record = await self._store.get_tool_call(call_id)
            # A call whose turn is gone (a restart) is still delivered and answerable.
            if record is not None and record.state is ToolCallState.PENDING:
                await self._save(record, ToolCallTrigger.DELIVER)

    async def rtc_status(
        self, record: ToolCallRecord, status: Literal["executing", "rejected"], client_id: str
    ) -> ToolCallRecord:
        """`v1.rtc.update_status`; the caller checked that the record is the principal's."""
        _check_client(record, client_id)
        step = RtcStep(kind="status", status=status, client_id=client_id)
        if (forwarded := await self._forwarded(record, step)) is not None:
            return forwarded
        if status == "executing":
            if record.state is ToolCallState.EXECUTING:
                return record  # a repeat by the client that owns it
            return await self._rtc_step(record, ToolCallTrigger.ACK, client_id)
        if record.state is ToolCallState.REJECTED or record.id in self._ending:
            return await self._final(record)  # a repeat: rejected once is enough
        outcome = ToolOutcome(status="denied", error="rejected by the user")
        return await self._rtc_end(record, ToolCallTrigger.NACK, outcome, client_id)

    async def rtc_submit(
        self, record: ToolCallRecord, *, success: bool, result: Any, error: str, client_id: str
    ) -> ToolCallRecord:
        """`v1.rtc.submit_result`: a call already ended returns as it is (idempotent)."""
        if record.state in TERMINAL_TOOL_CALL_STATES or record.id in self._ending:
            return await self._final(record)
        _check_client(record, client_id)
        step = RtcStep(
            kind="submit", success=success, result=result, error=error, client_id=client_id
        )
        if (forwarded := await self._forwarded(record, step)) is not None:
            return forwarded
        trigger, outcome = _answer_outcome(success, result, error)
        return await self._rtc_end(record, trigger, outcome, client_id)

    async def _forwarded(self, record: ToolCallRecord, step: RtcStep) -> ToolCallRecord | None:
        """The step applied by the replica whose turn waits for the call, if another."""
        if self.relay is None or record.id in self._pending or record.id in self._ending:
            return None
        return await self.relay.forward_rtc(record, step)

    async def rtc_here(self, record: ToolCallRecord, step: RtcStep) -> ToolCallRecord:
        """`step` forwarded by another replica, for a call a turn here waits for."""
        if step.kind == "status":
            return await self.rtc_status(record, step.status, step.client_id)
        return await self.rtc_submit(
            record,
            success=step.success,
            result=step.result,
            error=step.error,
            client_id=step.client_id,
        )

    async def _rtc_step(
        self, record: ToolCallRecord, trigger: ToolCallTrigger, client_id: str
    ) -> ToolCallRecord:
        _check_transition(record, trigger)
        pending = self._pending.get(record.id)
        changes = {"client_id": client_id or record.client_id}
        if pending is None:
            return await self._save(record, trigger, **changes)
        await self._advance(pending, trigger, **changes)
        return pending.record

    async def _rtc_end(
        self,
        record: ToolCallRecord,
        trigger: ToolCallTrigger,
        outcome: ToolOutcome,
        client_id: str,
    ) -> ToolCallRecord:
        _check_transition(record, trigger)
        changes = {
            "client_id": client_id or record.client_id,
            "result": outcome.result,
            "error": outcome.error or "",
        }
        pending = self._pending.pop(record.id, None)
        if pending is None:
            # No turn waits for it (its turn ended with a restart): archive the end only.
            ended = await self._save(record, trigger, **changes)
            await self._archive_output(ended, _no_offset)
            return ended
        # Archived here, in the request, so the reply carries the updates it produced.
        await self._end(pending, trigger, **changes)
        pending.outcome.set_result((trigger, outcome, True))
        return pending.record

    async def _final(self, record: ToolCallRecord) -> ToolCallRecord:
        ending = self._ending.get(record.id)
        if ending is not None:
            return await asyncio.shield(ending)
        return await self._store.get_tool_call(record.id) or record


def _answer_outcome(success: bool, result: Any, error: str) -> tuple[ToolCallTrigger, ToolOutcome]:
    if success:
        return ToolCallTrigger.RESULT, ToolOutcome(status="completed", result=result)
    return ToolCallTrigger.ERROR, ToolOutcome(status="error", error=error)


def _check_client(record: ToolCallRecord, client_id: str) -> None:
    """The first client to move an Rtc owns it; another client may not move it further."""
    if record.client_id and client_id and client_id != record.client_id:
        raise Forbidden(f"rtc {record.id} belongs to another client")


def _check_transition(record: ToolCallRecord, trigger: ToolCallTrigger) -> None:
    try:
        next_tool_call_state(record.state, trigger)
    except IllegalTransition as exc:
        raise RtcInvalidTransition(
            f"rtc {record.id} cannot go from {record.state.value} on {trigger.value}"
        ) from exc


class NoClientTools:
    """Denies every client tool call at once: for agents served where no client answers."""

    archives_calls = False

    async def call(
        self,
        owner: str,
        session_id: str,
        turn_id: str,
        call: ToolCall,
        emit: Emit,
        next_offset: Callable[[], int] = _no_offset,
    ) -> ToolOutcome:
        return ToolOutcome(status="denied", error="client tools are not available")
