"""Housekeeping that repeats while the server runs (prunes, sweeps, leases)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("portico.periodic")


async def every(
    interval: float, name: str, job: Callable[[], Awaitable[int | None]], *, at_once: bool
) -> None:
    """Run `job` every `interval` seconds until cancelled, first at once if `at_once`.

    A failure is logged and the next round tries again (the archive may be back by
    then); a job that returns how many things it removed has the count logged.
    """
    if not at_once:
        await asyncio.sleep(interval)
    while True:
        try:
            removed = await job()
            if removed:
                log.info("%s removed=%d", name, removed)
        except Exception:
            log.exception("%s failed", name)
        await asyncio.sleep(interval)
