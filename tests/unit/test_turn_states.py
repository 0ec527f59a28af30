"""The turn state machine: its transition table, and refusals that name state and trigger."""

from __future__ import annotations

import itertools

import pytest

from portico.domain.states import (
    TERMINAL_TOOL_CALL_STATES,
    TERMINAL_TURN_STATES,
    TOOL_CALL_TRANSITIONS,
    TURN_TRANSITIONS,
    ToolCallState,
    ToolCallTrigger,
    TurnState,
    TurnTrigger,
    next_tool_call_state,
    next_turn_state,
)
from portico.errors import IllegalTransition

S, T = TurnState, TurnTrigger

# The table as the design states it, written out independently of the source.
EXPECTED_TRANSITIONS: dict[tuple[TurnState, TurnTrigger], TurnState] = {
    (S.PENDING, T.START): S.RUNNING,
    (S.PENDING, T.CANCEL): S.CANCELLED,
    (S.PENDING, T.INTERRUPT): S.INTERRUPTED,
    (S.PENDING, T.MERGE): S.MERGED,
    (S.RUNNING, T.COMPLETE): S.COMPLETED,
    (S.RUNNING, T.FAIL): S.FAILED,
    (S.RUNNING, T.CANCEL): S.CANCELLED,
    (S.RUNNING, T.INTERRUPT): S.INTERRUPTED,
}

ALL_PAIRS = list(itertools.product(TurnState, TurnTrigger))
ILLEGAL_PAIRS = [pair for pair in ALL_PAIRS if pair not in EXPECTED_TRANSITIONS]


def _pair_id(pair: tuple[TurnState, TurnTrigger]) -> str:
    return f"{pair[0].value}-{pair[1].value}"


def test_table_is_exactly_the_documented_one() -> None:
    assert TURN_TRANSITIONS == EXPECTED_TRANSITIONS


@pytest.mark.parametrize(
    ("pair", "target"),
    list(EXPECTED_TRANSITIONS.items()),
    ids=[_pair_id(pair) for pair in EXPECTED_TRANSITIONS],
)
def test_listed_transition(pair: tuple[TurnState, TurnTrigger], target: TurnState) -> None:
    state, trigger = pair
    assert next_turn_state(state, trigger) is target


@pytest.mark.parametrize("pair", ILLEGAL_PAIRS, ids=[_pair_id(pair) for pair in ILLEGAL_PAIRS])
def test_unlisted_transition_is_refused_naming_state_and_trigger(
    pair: tuple[TurnState, TurnTrigger],
) -> None:
    state, trigger = pair
    with pytest.raises(IllegalTransition) as caught:
        next_turn_state(state, trigger)
    error = caught.value
    assert repr(state.value) in str(error)
    assert repr(trigger.value) in str(error)
    assert (error.state, error.event) == (state.value, trigger.value)


def test_the_product_is_fully_covered() -> None:
    # Guards the parametrization: a new state or trigger must land in one of the two lists.
    assert len(EXPECTED_TRANSITIONS) + len(ILLEGAL_PAIRS) == len(TurnState) * len(TurnTrigger)


def test_terminal_states() -> None:
    assert {
        S.COMPLETED,
        S.FAILED,
        S.CANCELLED,
        S.INTERRUPTED,
        S.MERGED,
    } == TERMINAL_TURN_STATES


@pytest.mark.parametrize("state", sorted(TERMINAL_TURN_STATES), ids=str)
def test_terminal_state_has_no_outgoing_transition(state: TurnState) -> None:
    for trigger in TurnTrigger:
        with pytest.raises(IllegalTransition):
            next_turn_state(state, trigger)


@pytest.mark.parametrize("state", [S.PENDING, S.RUNNING], ids=str)
def test_every_non_terminal_state_can_be_left(state: TurnState) -> None:
    assert any(source is state for source, _ in TURN_TRANSITIONS)


def test_every_transition_target_is_reachable_from_pending() -> None:
    reachable = {S.PENDING}
    frontier = [S.PENDING]
    while frontier:
        state = frontier.pop()
        for (source, _), target in TURN_TRANSITIONS.items():
            if source is state and target not in reachable:
                reachable.add(target)
                frontier.append(target)
    assert reachable == set(TurnState)


# -- tool calls ---------------------------------------------------------------------

C, G = ToolCallState, ToolCallTrigger
_ENDINGS = {G.RESULT: C.COMPLETED, G.ERROR: C.FAILED, G.NACK: C.REJECTED, G.EXPIRE: C.TIMEOUT}
EXPECTED_TOOL_TRANSITIONS: dict[tuple[ToolCallState, ToolCallTrigger], ToolCallState] = {
    (C.PENDING, G.DELIVER): C.SENT,
    (C.PENDING, G.ACK): C.EXECUTING,
    (C.SENT, G.ACK): C.EXECUTING,
    **{
        (state, trigger): end
        for state in (C.PENDING, C.SENT, C.EXECUTING)
        for trigger, end in _ENDINGS.items()
    },
}
TOOL_PAIRS = [(s, t) for s in ToolCallState for t in ToolCallTrigger]


def test_tool_call_table_is_the_designed_one() -> None:
    assert TOOL_CALL_TRANSITIONS == EXPECTED_TOOL_TRANSITIONS


@pytest.mark.parametrize(("state", "trigger"), TOOL_PAIRS, ids=[f"{s}-{t}" for s, t in TOOL_PAIRS])
def test_tool_call_table_is_total_or_raises(state: ToolCallState, trigger: ToolCallTrigger) -> None:
    if (state, trigger) in EXPECTED_TOOL_TRANSITIONS:
        assert next_tool_call_state(state, trigger) is EXPECTED_TOOL_TRANSITIONS[(state, trigger)]
    else:
        with pytest.raises(IllegalTransition, match=f"{state.value}.*{trigger.value}"):
            next_tool_call_state(state, trigger)


@pytest.mark.parametrize("state", sorted(TERMINAL_TOOL_CALL_STATES))
def test_ended_tool_calls_have_no_way_out(state: ToolCallState) -> None:
    assert not [key for key in TOOL_CALL_TRANSITIONS if key[0] is state]


def test_open_tool_calls_can_end_every_way() -> None:
    for state in (ToolCallState.PENDING, ToolCallState.SENT, ToolCallState.EXECUTING):
        ends = {
            end for (start, _), end in TOOL_CALL_TRANSITIONS.items() if start is state
        } & TERMINAL_TOOL_CALL_STATES
        assert ends == TERMINAL_TOOL_CALL_STATES
