"""`/readyz`: whether this replica should get new connections, and why not.

Ready means admitting (started, not draining) with every backend answering its
check (archive, bus, session state, media; each within `readiness_timeout`) and every
runtime readiness depends on healthy. The body names each backend's state and reason,
so an operator sees which one took the replica out of rotation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from typing import Any

from portico.core.lifecycle import Phase
from portico.health import Health, probe

DOWN_STATUS = "backend unavailable"
RUNTIME_STATUS = "runtime unhealthy"


def verdict(
    phase: Phase, backends: Mapping[str, Health], agents: Mapping[str, str]
) -> tuple[int, dict[str, Any]]:
    """The probe's status code and body. `agents`: unhealthy runtimes and their reasons."""
    body: dict[str, Any] = {
        "backends": {
            name: {"state": "ready" if health.ready else "down", "reason": health.reason}
            for name, health in backends.items()
        }
    }
    if agents:
        body["agents"] = dict(agents)
    if phase is not Phase.ADMITTING:
        status = phase.value  # starting, draining, stopped
    elif not all(health.ready for health in backends.values()):
        status = DOWN_STATUS
    elif agents:
        status = RUNTIME_STATUS
    else:
        return 200, {"status": "ready", **body}
    return 503, {"status": status, **body}


async def check_all(checks: Mapping[str, Awaitable[Health]], within: float) -> dict[str, Health]:
    """Every check at once. Each backend bounds its own check; the same deadline here
    holds against a backend that does not, and turns a crash into a reason."""
    answers = await asyncio.gather(*(_bounded(check, within) for check in checks.values()))
    return dict(zip(checks, answers, strict=True))


async def _bounded(check: Awaitable[Health], within: float) -> Health:
    found: list[Health] = []

    async def run() -> None:
        found.append(await check)

    failed = await probe(run(), within)
    return found[0] if found else failed
