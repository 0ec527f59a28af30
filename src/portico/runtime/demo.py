"""The `demo` runtime: a friendly built-in agent that needs no model.

It streams its replies word by word so a newcomer sees streaming at once, and
answers a few keywords that show what Portico does (listed in the README).
"""

from __future__ import annotations

import asyncio
import re

from portico.core.model import message_text
from portico.runtime.base import Chunk, Done, TurnInput, TurnStream

GREETING = (
    "Hello! I'm the Portico demo agent. I run inside the server, so you can try "
    "Portico without a model. Every reply streams to you word by word, and every "
    "conversation is archived: reconnect with the same session_id and I remember "
    "what you said. Try: help, echo <text>, history, or slow."
)
HELP = (
    "Things to try: `echo <text>` repeats your text; `history` counts this "
    "session's messages from the archive; `slow` streams a long answer slowly "
    "(good for testing disconnects: the reply is archived even if you leave); "
    "anything else gets a short reply."
)
SLOW_TEXT = " ".join(f"step {n} of 40," for n in range(1, 41)) + " done."


async def _reply_for(text: str, turn: TurnInput) -> tuple[str, float]:
    """The reply and the delay factor for one user message."""
    lowered = text.strip().lower()
    if lowered in {"", "hi", "hello", "hey"} or re.fullmatch(r"(hi|hello|hey)\W*", lowered):
        return GREETING, 1.0
    if lowered == "help":
        return HELP, 1.0
    if lowered.startswith("echo "):
        return text.strip()[5:], 1.0
    if lowered == "history":
        earlier = len(await turn.history())
        return f"This session's archive holds {earlier} earlier messages before this one.", 1.0
    if lowered == "slow":
        return SLOW_TEXT, 5.0
    words = len(text.split())
    return (
        f"You said {words} word{'s' if words != 1 else ''}. I'm a demo agent without a "
        "model, so I can't really answer, but Portico is streaming this reply to you "
        "token by token. Type `help` to see what I can show you.",
        1.0,
    )


class DemoRuntime:
    def __init__(self, *, word_delay: float = 0.03) -> None:
        self._word_delay = word_delay

    async def run(self, turn: TurnInput) -> TurnStream:
        reply, slowness = await _reply_for(message_text(turn.message), turn)
        words = reply.split(" ")
        for index, word in enumerate(words):
            yield Chunk(word if index == len(words) - 1 else word + " ")
            if self._word_delay:
                await asyncio.sleep(self._word_delay * slowness)
        yield Done()
