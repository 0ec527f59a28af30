"""The `echo` runtime: one `done` whose content is `Echo: <text>`."""

from __future__ import annotations

from portico.domain.model import message_text
from portico.runtime.base import Done, TurnInput, TurnStream


class EchoRuntime:
    async def run(self, turn: TurnInput) -> TurnStream:
        yield Done(content=f"Echo: {message_text(turn.message)}")
