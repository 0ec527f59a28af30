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
