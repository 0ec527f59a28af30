"""A `runtime: python` handler using `turn.memory`: "save TEXT", "search QUERY",
"forget ID" (answers "no memory" when the turn has none)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from portico.agent import Reply, Turn


async def handler(turn: Turn) -> AsyncIterator[Reply]:
    if turn.memory is None:
        yield "no memory"
        return
    command, _, argument = turn.text.partition(" ")
    if command == "save":
        yield (await turn.memory.save(argument)).id
    elif command == "search":
        found = await turn.memory.search(argument)
        yield json.dumps([entry.content for entry in found])
    elif command == "forget":
        yield "forgotten" if await turn.memory.forget(argument) else "unknown"
