"""`/readyz`'s verdict (server/readiness.py) and the bounded check (portico/health.py)."""

from __future__ import annotations

import asyncio

from portico.core.lifecycle import Phase
from portico.health import IN_PROCESS, Health, failure_reason, probe
from portico.server.readiness import check_all, verdict

DOWN = Health(False, "ConnectionError: Error 111 connecting to 127.0.0.1:1")


def backends(**overrides: Health) -> dict[str, Health]:
    found = dict.fromkeys(("archive", "bus", "session_state", "media"), IN_PROCESS)
    return {**found, **overrides}


def test_ready_when_admitting_with_every_backend_up() -> None:
    status, body = verdict(Phase.ADMITTING, backends(), {})
    assert status == 200
    assert body["status"] == "ready"
    assert body["backends"]["bus"] == {"state": "ready", "reason": "in process"}
    assert "agents" not in body


def test_one_backend_down_is_503_naming_it_and_why() -> None:
    status, body = verdict(Phase.ADMITTING, backends(bus=DOWN), {})
    assert status == 503
    assert body["status"] == "backend unavailable"
    assert body["backends"]["bus"] == {"state": "down", "reason": DOWN.reason}
    assert body["backends"]["archive"]["state"] == "ready"


def test_draining_and_starting_are_503_whatever_the_backends_say() -> None:
    for phase in (Phase.STARTING, Phase.DRAINING, Phase.STOPPED):
        status, body = verdict(phase, backends(), {})
        assert (status, body["status"]) == (503, phase.value)


def test_an_unhealthy_runtime_is_503_with_its_reason() -> None:
    status, body = verdict(Phase.ADMITTING, backends(), {"default": "model not loaded"})
    assert (status, body["status"], body["agents"]) == (
        503,
        "runtime unhealthy",
        {"default": "model not loaded"},
    )


async def test_probe_names_the_failure_and_bounds_the_wait() -> None:
    async def refuse() -> None:
        raise ConnectionRefusedError(111, "Connect call failed")

    assert await probe(refuse(), 1.0) == Health(
        False, "ConnectionRefusedError: [Errno 111] Connect call failed"
    )
    never = asyncio.Event()
    assert await probe(never.wait(), 0.01) == Health(False, "no answer within 0.01s")
    assert await probe(asyncio.sleep(0), 1.0) == Health(True, "ok")


def test_a_reason_is_one_short_line() -> None:
    reason = failure_reason(RuntimeError("first line\nsecond line " + "x" * 500))
    assert reason == "RuntimeError: first line"
    assert len(failure_reason(RuntimeError("y" * 500))) == 200


async def test_check_all_holds_the_deadline_for_a_check_that_does_not() -> None:
    async def hangs() -> Health:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def crashes() -> Health:
        raise ValueError("bug")

    async def fine() -> Health:
        return IN_PROCESS

    found = await check_all({"a": hangs(), "b": crashes(), "c": fine()}, 0.01)
    assert found == {
        "a": Health(False, "no answer within 0.01s"),
        "b": Health(False, "ValueError: bug"),
        "c": IN_PROCESS,
    }
