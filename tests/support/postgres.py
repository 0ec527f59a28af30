"""A fresh PostgreSQL schema per test: the tests' archives never see each other.

The server is `PORTICO_TEST_DATABASE_URL` (default: the local one `.ci/run` starts).
Without it the PostgreSQL tests are skipped locally and fail in CI.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

import asyncpg
import pytest

from portico.domain.model import new_id

DATABASE_URL = os.environ.get(
    "PORTICO_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


def postgres_reachable() -> bool:
    url = urlsplit(DATABASE_URL)
    try:
        with socket.create_connection((url.hostname or "127.0.0.1", url.port or 5432), 1.0):
            return True
    except OSError:
        return False


def require_postgres() -> None:
    if postgres_reachable():
        return
    message = f"PostgreSQL tests need a server at {DATABASE_URL}"
    if os.environ.get("CI"):
        pytest.fail(message)  # CI starts one (.ci/run): never skip there
    pytest.skip(message)


def schema_url(schema: str) -> str:
    """The test database's URL with `schema` first on the search path (asyncpg passes
    query parameters it does not know on as server settings)."""
    separator = "&" if "?" in DATABASE_URL else "?"
    return f"{DATABASE_URL}{separator}search_path={schema}"


async def create_schema() -> str:
    """A new, empty schema; returns its name."""
    schema = new_id("t").replace("-", "_")
    conn = await asyncpg.connect(DATABASE_URL)
    try:
        await conn.execute(f"CREATE SCHEMA {schema}")
    finally:
        await conn.close()
    return schema


async def drop_schemas(schemas: list[str]) -> None:
    if not schemas:
        return
    conn = await asyncpg.connect(DATABASE_URL)
    try:
        for schema in schemas:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    finally:
        await conn.close()
