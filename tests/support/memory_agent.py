"""A `portico.agent` handler using `turn.memory`, the same in process (`runtime: python`)
and behind `portico agent serve`: "save TEXT", "search QUERY", "latest" (the newest
entry only), "forget ID" (answers "no memory" when the turn has none)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from portico.agent import Reply, Turn
from portico.errors import InvalidMessage, MemoryFull


async def handler(turn: Turn) -> AsyncIterator[Reply]:
    if turn.memory is None:
        yield "no memory"
        return
    command, _, argument = turn.text.partition(" ")
    if command == "save":
        try:
            entry = await turn.memory.save(argument)
        except MemoryFull as exc:
            yield f"full: {exc.message}"
        except InvalidMessage as exc:
            yield f"invalid: {exc.message}"
        else:
            yield f"{entry.id} {entry.principal}/{entry.agent}/{entry.facet}"
    elif command in ("search", "latest"):
        found = await turn.memory.search(argument, limit=1 if command == "latest" else None)
        yield json.dumps([entry.content for entry in found])
    elif command == "forget":
        yield "forgotten" if await turn.memory.forget(argument) else "unknown"
