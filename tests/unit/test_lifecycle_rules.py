"""The lifecycle and drain rules (core/lifecycle.py), without a socket or a clock."""

from __future__ import annotations

import math

import pytest

from portico.core.lifecycle import Lifecycle, Phase
from portico.errors import IllegalTransition


def draining(timeout: float = 10.0, now: float = 100.0) -> Lifecycle[str]:
    life: Lifecycle[str] = Lifecycle(drain_timeout=timeout)
    life.started()
    life.stop_requested(now)
    return life


def test_admits_only_between_start_and_the_stop_signal() -> None:
    life: Lifecycle[str] = Lifecycle(drain_timeout=5)
    assert (life.phase, life.admitting) == (Phase.STARTING, False)
    life.started()
    assert (life.phase, life.admitting) == (Phase.ADMITTING, True)
    life.stop_requested(1.0)
    assert (life.phase, life.admitting, life.deadline) == (Phase.DRAINING, False, 6.0)
    with pytest.raises(IllegalTransition):
        life.started()


def test_nothing_is_closed_before_the_drain() -> None:
    life: Lifecycle[str] = Lifecycle(drain_timeout=5)
    life.started()
    step = life.step(0.0, {"a": False}, turns_running=0)
    assert (step.close, step.interrupt, step.wake_at) == ((), False, math.inf)


def test_idle_connections_are_told_at_once_busy_ones_when_their_turn_ends() -> None:
    life = draining()
    step = life.step(100.0, {"idle": False, "busy": True}, turns_running=1)
    assert (step.close, step.interrupt, step.wake_at) == (("idle",), False, 110.0)
    assert life.phase is Phase.DRAINING
    # The turn ended: the busy connection goes, and with it the drain.
    step = life.step(101.0, {"idle": False, "busy": False}, turns_running=0)
    assert (step.close, step.interrupt) == (("busy",), False)
    assert life.phase is Phase.STOPPED


def test_each_connection_is_told_once() -> None:
    life = draining()
    assert life.step(100.0, {"a": False, "b": True}, turns_running=1).close == ("a",)
    assert life.step(100.5, {"a": False, "b": True}, turns_running=1).close == ()


def test_a_connection_arriving_during_the_drain_is_told_too() -> None:
    life = draining()
    life.step(100.0, {"a": True}, turns_running=1)
    assert life.step(100.1, {"a": True, "late": False}, turns_running=1).close == ("late",)


def test_turns_past_the_deadline_are_interrupted_before_any_busy_socket_closes() -> None:
    life = draining(timeout=2.0)
    life.step(100.0, {"busy": True}, turns_running=1)
    step = life.step(102.0, {"busy": True}, turns_running=1)
    assert (step.close, step.interrupt) == ((), True)
    # Interrupted: every connection left is closed, busy or not, and the drain is over.
    step = life.step(102.1, {"busy": True}, turns_running=0)
    assert (step.close, step.interrupt) == (("busy",), False)
    assert life.phase is Phase.STOPPED


def test_interruption_is_asked_once() -> None:
    life = draining(timeout=1.0)
    assert life.step(101.0, {"busy": True}, turns_running=1).interrupt
    step = life.step(101.2, {"busy": True}, turns_running=1)  # a turn that ignored it
    assert (step.close, step.interrupt) == (("busy",), False)
    assert life.phase is Phase.STOPPED


def test_a_connection_still_busy_without_a_turn_is_closed_at_the_deadline() -> None:
    """An RPC request still in flight at the deadline does not hold the process."""
    life = draining(timeout=1.0)
    assert life.step(100.0, {"rpc": True}, turns_running=0).close == ()
    step = life.step(101.0, {"rpc": True}, turns_running=0)
    assert (step.close, step.interrupt) == (("rpc",), False)
    assert life.phase is Phase.STOPPED


def test_a_second_signal_moves_the_deadline_to_now() -> None:
    life = draining(timeout=30.0)
    life.step(100.0, {"busy": True}, turns_running=1)
    life.stop_requested(105.0)
    assert life.deadline == 105.0
    assert life.step(105.0, {"busy": True}, turns_running=1).interrupt
    life.stop_requested(200.0)  # a later signal never moves it back
    assert life.deadline == 105.0


def test_a_drain_with_nothing_running_ends_at_once() -> None:
    life = draining()
    step = life.step(100.0, {}, turns_running=0)
    assert step.close == ()
    assert life.phase is Phase.STOPPED
    life.stop_requested(101.0)  # a signal after the stop changes nothing
    assert life.phase is Phase.STOPPED
    assert life.step(101.0, {"x": False}, turns_running=0).close == ()


def test_a_stop_before_start_up_finished_drains_too() -> None:
    life: Lifecycle[str] = Lifecycle(drain_timeout=3.0)
    life.stop_requested(0.0)
    assert (life.phase, life.admitting) == (Phase.DRAINING, False)
