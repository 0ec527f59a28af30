"""Context compaction: a `summary` message that replaces older messages as history.

The built-in summariser is extractive (each earlier message shortened to a line),
so compaction works with every runtime; a model runtime can write a real summary
in its place. A runtime's history starts at the latest summary.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from portico.core.model import Message, message_text

ITEM_CHARS = 280  # each summarised message keeps at most this many characters
MAX_ITEMS = 100  # the newest items are kept when there are more


class SummaryItem(msgspec.Struct, frozen=True):
    role: str
    text: str


_items_decoder = msgspec.json.Decoder(list[SummaryItem])


def since_latest_summary(messages: Sequence[Message]) -> list[Message]:
    """The messages from the latest summary on (all of them when there is none)."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].content_type == "summary":
            return list(messages[index:])
    return list(messages)


def summarize(history: Sequence[Message], instruction: str = "") -> list[SummaryItem]:
    items: list[SummaryItem] = []
    if instruction:
        items.append(SummaryItem("instruction", instruction[:ITEM_CHARS]))
    for message in history:
        if message.content_type == "summary":
            items.extend(_earlier_items(message))
        elif message.content_type in ("text", "markdown") and message_text(message):
            items.append(SummaryItem(message.role, _shorten(message_text(message))))
    return items[-MAX_ITEMS:]


def _earlier_items(summary: Message) -> list[SummaryItem]:
    try:
        return [
            item for item in _items_decoder.decode(summary.content) if item.role != "instruction"
        ]
    except msgspec.DecodeError:
        return []


def _shorten(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= ITEM_CHARS else flat[: ITEM_CHARS - 1] + "…"
