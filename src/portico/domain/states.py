"""State machines as transition tables; an illegal transition names state and trigger."""

from __future__ import annotations

from enum import StrEnum

from portico.errors import IllegalTransition


class TurnState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"
    MERGED = "merged"


class TurnTrigger(StrEnum):
    START = "start"
    COMPLETE = "complete"
    FAIL = "fail"
    CANCEL = "cancel"
    INTERRUPT = "interrupt"  # the server stopped under the turn
    MERGE = "merge"  # a pending turn absorbed into another (RPC)


TURN_TRANSITIONS: dict[tuple[TurnState, TurnTrigger], TurnState] = {
    (TurnState.PENDING, TurnTrigger.START): TurnState.RUNNING,
    (TurnState.PENDING, TurnTrigger.CANCEL): TurnState.CANCELLED,
    (TurnState.PENDING, TurnTrigger.INTERRUPT): TurnState.INTERRUPTED,
    (TurnState.PENDING, TurnTrigger.MERGE): TurnState.MERGED,
    (TurnState.RUNNING, TurnTrigger.COMPLETE): TurnState.COMPLETED,
    (TurnState.RUNNING, TurnTrigger.FAIL): TurnState.FAILED,
    (TurnState.RUNNING, TurnTrigger.CANCEL): TurnState.CANCELLED,
    (TurnState.RUNNING, TurnTrigger.INTERRUPT): TurnState.INTERRUPTED,
}

TERMINAL_TURN_STATES = frozenset(
    {
        TurnState.COMPLETED,
        TurnState.FAILED,
        TurnState.CANCELLED,
        TurnState.INTERRUPTED,
        TurnState.MERGED,
    }
)


def next_turn_state(state: TurnState, trigger: TurnTrigger) -> TurnState:
    try:
        return TURN_TRANSITIONS[(state, trigger)]
    except KeyError:
        raise IllegalTransition("turn", state.value, trigger.value) from None


class ToolCallState(StrEnum):
    """A client-side tool call (the RPC spec's Rtc states)."""

    PENDING = "pending"  # created, not yet handed to a connection
    SENT = "sent"  # a connection of the owner received it
    EXECUTING = "executing"  # the client acknowledged it
    COMPLETED = "completed"
    FAILED = "failed"  # the client's tool reported an error
    TIMEOUT = "timeout"  # no ack, or no answer after the ack, in time
    REJECTED = "rejected"  # the client declined (nack), or the turn ended first


class ToolCallTrigger(StrEnum):
    DELIVER = "deliver"
    ACK = "ack"
    RESULT = "result"
    ERROR = "error"
    NACK = "nack"
    EXPIRE = "expire"


_OPEN_TOOL_STATES = (ToolCallState.PENDING, ToolCallState.SENT, ToolCallState.EXECUTING)

TOOL_CALL_TRANSITIONS: dict[tuple[ToolCallState, ToolCallTrigger], ToolCallState] = {
    (ToolCallState.PENDING, ToolCallTrigger.DELIVER): ToolCallState.SENT,
    (ToolCallState.PENDING, ToolCallTrigger.ACK): ToolCallState.EXECUTING,
    (ToolCallState.SENT, ToolCallTrigger.ACK): ToolCallState.EXECUTING,
    **{
        (state, trigger): end
        for state in _OPEN_TOOL_STATES
        for trigger, end in (
            (ToolCallTrigger.RESULT, ToolCallState.COMPLETED),
            (ToolCallTrigger.ERROR, ToolCallState.FAILED),
            (ToolCallTrigger.NACK, ToolCallState.REJECTED),
            (ToolCallTrigger.EXPIRE, ToolCallState.TIMEOUT),
        )
    },
}

TERMINAL_TOOL_CALL_STATES = frozenset(
    {
        ToolCallState.COMPLETED,
        ToolCallState.FAILED,
        ToolCallState.TIMEOUT,
        ToolCallState.REJECTED,
    }
)


def next_tool_call_state(state: ToolCallState, trigger: ToolCallTrigger) -> ToolCallState:
    try:
        return TOOL_CALL_TRANSITIONS[(state, trigger)]
    except KeyError:
        raise IllegalTransition("tool call", state.value, trigger.value) from None
