"""A user message whose client-chosen key (`client_id`) the archive already holds.

`/v1/session` messages carry an optional idempotency key so a client may send a
message again when it cannot know whether the first attempt arrived (a server that
restarted under it). The archive's client ids are the keys, scoped per principal,
as for RPC `v1.message.send`; this module describes the earlier message so the
client can show it instead of a second copy (docs/session.md, "Idempotency keys").
"""

from __future__ import annotations

from typing import Any

from portico.domain.model import Message
from portico.domain.states import TurnState
from portico.errors import DuplicateMessage
from portico.store.base import Store

# How many messages after the user's are read to find its reply: a turn writes its
# reply (and tool-call rounds) right behind its user message.
REPLY_SCAN_LIMIT = 50


async def earlier_send(store: Store, principal: str, client_id: str) -> DuplicateMessage | None:
    """The refusal for a repeated key, or None when the key is new for `principal`."""
    if not client_id:
        return None
    earlier = await store.find_message_by_client_id(principal, client_id)
    if earlier is None:
        return None
    return DuplicateMessage(client_id, await _describe(store, earlier))


def running_duplicate(earlier: Message, turn_id: str) -> DuplicateMessage:
    """The refusal while the turn answering `earlier` still runs: its frames follow."""
    details = {
        "client_id": earlier.client_id,
        "session_id": earlier.session_id,
        "message_id": earlier.id,
        "turn_id": turn_id,
        "turn_state": str(TurnState.RUNNING),
    }
    return DuplicateMessage(earlier.client_id, details)


async def _describe(store: Store, earlier: Message) -> dict[str, Any]:
    turn = await store.get_turn(earlier.turn_id) if earlier.turn_id else None
    answering = turn
    if turn is not None and turn.state is TurnState.MERGED and turn.merged_into:
        # Its message is in the history of the turn that absorbed it: that one answers.
        answering = await store.get_turn(turn.merged_into) or turn
    details: dict[str, Any] = {
        "client_id": earlier.client_id,
        "session_id": earlier.session_id,
        "message_id": earlier.id,
        "turn_id": answering.id if answering is not None else "",
        "turn_state": str(answering.state) if answering is not None else "",
    }
    if answering is not None:
        reply = await _reply_text(store, earlier, answering.id)
        if reply:
            details["reply"] = reply
    return details


async def _reply_text(store: Store, earlier: Message, turn_id: str) -> str:
    """The turn's archived assistant text so far (all of it once the turn ended)."""
    after = await store.list_messages(
        earlier.session_id, after_offset=earlier.global_offset, limit=REPLY_SCAN_LIMIT
    )
    texts = [m.content for m in after if m.turn_id == turn_id and m.role == "assistant"]
    return "".join(text for text in texts if text)
