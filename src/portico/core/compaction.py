"""Context compaction: a `summary` message that replaces older messages as history.

The built-in summariser is extractive (each earlier message shortened to a line),
so compaction works with every runtime; a model runtime (a `Summarizer`) writes a
real summary in its place. A runtime's history starts at the latest summary.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from portico.domain.model import Message, message_text
from portico.domain.summary import SummaryItem, summary_items
from portico.runtime.base import Summarizer

log = logging.getLogger("portico.compaction")

ITEM_CHARS = 280  # each summarised message keeps at most this many characters
MAX_ITEMS = 100  # the newest items are kept when there are more
# A summary's metadata: the `global_offset` of the last message it covers.
SUMMARY_THROUGH = "summary_through"


def since_latest_summary(messages: Sequence[Message]) -> list[Message]:
    """The latest summary and every message it does not cover (all when there is none).

    A model takes seconds to write a summary; a message archived meanwhile lands
    before the summary but is not in it, so it follows the summary in the history.
    """
    for index in range(len(messages) - 1, -1, -1):
        summary = messages[index]
        if summary.content_type == "summary":
            through = _covered_through(summary)
            raced = [
                m for m in messages[:index] if through is not None and m.global_offset > through
            ]
            return [summary, *raced, *messages[index + 1 :]]
    return list(messages)


def _covered_through(summary: Message) -> int | None:
    try:
        return int(summary.metadata[SUMMARY_THROUGH])
    except (KeyError, ValueError):
        return None  # an older summary: it covers every message before it


def summarize(history: Sequence[Message], instruction: str = "") -> list[SummaryItem]:
    items: list[SummaryItem] = []
    if instruction:
        items.append(SummaryItem("instruction", instruction[:ITEM_CHARS]))
    for message in history:
        if message.content_type == "summary":
            items.extend(summary_items(message))
        elif message.content_type in ("text", "markdown") and message_text(message):
            items.append(SummaryItem(message.role, _shorten(message_text(message))))
    return items[-MAX_ITEMS:]


async def compose_summary(
    history: Sequence[Message], instruction: str, summarizer: Summarizer | None
) -> list[SummaryItem]:
    """The summary's items: the model's summary when the agent has one, else extractive.

    A model that fails falls back to the extractive summary: the compaction was
    accepted (`queued`), so it must still happen.
    """
    if summarizer is not None:
        try:
            text = await summarizer.summarize(history, instruction)
        except Exception as exc:
            # The type only: a message could quote the conversation.
            log.warning("model summary failed (%s); the extractive one is used", type(exc).__name__)
        else:
            if text.strip():
                return model_summary_items(text, instruction)
    return summarize(history, instruction)


def model_summary_items(text: str, instruction: str = "") -> list[SummaryItem]:
    """A model's summary in the same list-of-items format as the extractive one."""
    items = [SummaryItem("instruction", instruction[:ITEM_CHARS])] if instruction else []
    return [*items, SummaryItem("summary", text.strip())]


def _shorten(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= ITEM_CHARS else flat[: ITEM_CHARS - 1] + "…"
