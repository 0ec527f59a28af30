"""The replica harness itself: three replicas on one archive behind round-robin HAProxy,
one killed with SIGKILL leaves the rotation and comes back when restarted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from support.postgres import create_schema, drop_schemas, require_postgres, schema_url
from support.replicas import REPLICAS, Replicas, require_haproxy


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Replicas]:
    require_postgres()
    require_haproxy()
    schema = await create_schema()
    group = Replicas(tmp_path, database_url=schema_url(schema))
    try:
        yield group.start()
    finally:
        group.stop()
        await drop_schemas([schema])


def rotation(group: Replicas, requests: int) -> set[str]:
    return {name for _ in range(requests) if (name := group.replica_behind())}


async def test_round_robin_reaches_every_replica(replicas: Replicas) -> None:
    assert rotation(replicas, 2 * REPLICAS) == {f"r{i}" for i in range(REPLICAS)}


async def test_a_killed_replica_leaves_the_rotation_and_rejoins_on_restart(
    replicas: Replicas,
) -> None:
    replicas.kill(1)
    replicas.await_out_of_rotation("r1")
    assert rotation(replicas, 4 * REPLICAS) == {"r0", "r2"}
    replicas.restart(1)
    assert rotation(replicas, 2 * REPLICAS) == {f"r{i}" for i in range(REPLICAS)}
