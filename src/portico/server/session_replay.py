"""What a replica taking a `/v1/session` over mid-turn owes its client.

A turn runs on the replica that started it; every replica hears its events, each
numbered with its `step` (core/events.py), over the session's bus topic. The replica
holding the session numbers them into the session's ledger, recording with each the
turn and step it carries (`last_step`). When another replica claims the session (the
client resumed there), the claim fences the old holder: the events it had not recorded
would be lost to the client. So the new holder, before numbering anything of the turn:

1. holds the events it hears from the moment it attaches (`LiveSession.hold_events`);
2. reads the topic's newest events once its reader knows where it starts and its own
   emitted events are on the bus (`Engine.recent_events`): with those it holds, nothing
   is missed between;
3. numbers, in order, the events the ledger did not record (`to_replay`), then those
   it held, each turn's steps once (`LiveSession.replay`);
4. answers from the archive what the bus no longer has (`session_catchup.catch_up`).

Media chunks are not replayed: their binary frames are lossy by the protocol (a
client judges an item whole by its sequence), and an item the old holder opened is
not the new holder's to continue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable

from portico.core.events import TurnEvent, TurnMediaChunk

log = logging.getLogger("portico.session")
REPLAY_TIMEOUT = 2.0  # seconds a takeover waits for the bus before it goes on without


def to_replay(
    newest_first: Iterable[TurnEvent], *, ended: Collection[str], last_step: tuple[str, int]
) -> list[TurnEvent]:
    """The events a taking-over holder numbers, oldest first: the newest ones back to
    the first the ledger holds (the recorded step, or a turn it ended). One turn runs
    at a time per session, so everything before that is older still."""
    last_turn, last = last_step
    picked: list[TurnEvent] = []
    for event in newest_first:
        if event.turn_id in ended or (event.turn_id == last_turn and event.step <= last):
            break
        if event.step and not isinstance(event, TurnMediaChunk):
            picked.append(event)
    picked.reverse()
    return picked


RecentEvents = Callable[[str, int, str], Awaitable[list[TurnEvent]]]


async def replayed_events(
    recent: RecentEvents,
    session_id: str,
    *,
    count: int,
    after: str,
    ended: Collection[str],
    last_step: tuple[str, int],
    within: float = REPLAY_TIMEOUT,
) -> list[TurnEvent]:
    """`to_replay` over the bus's newest `count` events of the session since `after`;
    none when the bus does not answer within `within` (the archive answers the turn's
    end then, without the chunks the client missed)."""
    try:
        async with asyncio.timeout(within):
            events = await recent(session_id, count, after)
    except Exception:
        log.warning("takeover replay unavailable session=%s; the archive answers", session_id)
        return []
    return to_replay(events, ended=ended, last_step=last_step)
