"""A `summary` message's format: its content is a JSON list of items, each a role and a text.

The extractive summary has one item per earlier message; a model's summary is one item
with role `summary`. An `instruction` item records the request's instruction and is not
part of what the summary says. The engine writes these messages (core/compaction.py) and
the model runtimes read them (runtime/chat_messages.py).
"""

from __future__ import annotations

import msgspec

from portico.domain.model import Message


class SummaryItem(msgspec.Struct, frozen=True):
    role: str
    text: str


_items_decoder = msgspec.json.Decoder(list[SummaryItem])


def summary_text(summary: Message) -> str:
    """A summary message as text for a model: the model's summary, or one line per item."""
    return "\n".join(
        item.text if item.role == "summary" else f"{item.role}: {item.text}"
        for item in summary_items(summary)
    )


def summary_items(summary: Message) -> list[SummaryItem]:
    """A summary message's items without its instruction; none when its content is not a list
    of items."""
    try:
        return [
            item for item in _items_decoder.decode(summary.content) if item.role != "instruction"
        ]
    except msgspec.DecodeError:
        return []
