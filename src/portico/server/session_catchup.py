"""The turns a replica taking a `/v1/session` over must answer itself.

A turn runs on the replica that started it, and its messages reach the session only
through that replica's ledger writes. When another replica claims the session (the
client resumed there, or the first one died), the claim fences those writes: a turn
whose terminal message the ledger does not hold would never end for the client. The
same holds on the replica running the turn when its copy of the session was dropped
(its session state failed: Redis away) and the turn ended before the resume: the new
copy hears only the events after it attached. A turn still running here reaches the
new copy through the engine too; the copy numbers one terminal message per turn.
The new holder replays the turn's events from the bus first (session_replay.py);
what the bus no longer has it answers from the archive, once the turn has ended
there: a `done` with the archived reply (the `done` carries the whole text), or an
`error` with the turn's code; a turn whose replica died ends `interrupted` by the engine's
orphan sweep (within 1.5 `replica_lease`) and is answered with an `error`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from portico.domain.model import Turn
from portico.domain.states import TurnState
from portico.errors import InternalError
from portico.protocols.session import frames as f
from portico.protocols.session.channel import Numbered
from portico.store.base import Store

POLL_INTERVAL = 0.25  # seconds between archive reads while a turn runs elsewhere
GRACE = 2.0  # seconds after a claim during which new turns of others are looked for
# A turn created this long before its numbering's ledger still counts as its own
# (clock skew between replicas, a turn started while the ledger was being created).
SKEW = 0.5
_REPLY_TYPES = ("text", "markdown")  # not the tool-call records a reply sits beside
INTERRUPTED_MESSAGE = "the turn was interrupted: the replica running it stopped"
_TERMINAL = frozenset(
    {
        TurnState.COMPLETED,
        TurnState.FAILED,
        TurnState.CANCELLED,
        TurnState.INTERRUPTED,
        TurnState.MERGED,
    }
)


class TurnAnswering(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def ended(self) -> bool: ...

    def end_turn(self, frame: Numbered, turn_id: str) -> None: ...


async def _never(session_ids: Iterable[str]) -> bool:
    return False


async def catch_up(
    session: TurnAnswering,
    store: Store,
    *,
    since: float,
    ended: tuple[str, ...],
    grace: float = GRACE,
    runs_elsewhere: Callable[[Iterable[str]], Awaitable[bool]] = _never,
) -> None:
    """Answer this numbering's turns that other replicas run or ran and whose terminal
    message the ledger does not hold, each once its archive entry ends. New ones are
    looked for during `grace` seconds: the archive groups its writes, so a turn the
    previous holder had just started may show up a little after the claim. Turns
    created before the latest one the ledger ended had ended before it (one turn runs
    at a time) and were answered then: only `ended`'s last 64 are kept, so they are
    told apart by time, not by id. A turn ended in the archive is answered only once no
    other replica holds the session's turn lock (`runs_elsewhere`): the archive has the
    end a moment before the replica that ran it frees the session, and a client that
    gets the answer and sends its next message at once must find the session free."""
    loop = asyncio.get_running_loop()
    stop_looking = loop.time() + grace
    answered = set(ended)
    waiting: dict[str, Turn] = {}
    while not session.ended:
        looking = loop.time() < stop_looking
        if looking:
            turns = await store.list_turns(session.id)
            floor = max((t.created_at for t in turns if t.id in answered), default=since - SKEW)
            for turn in turns:
                if (
                    turn.id not in answered
                    and turn.id not in waiting
                    and turn.created_at >= max(floor, since - SKEW)
                    and turn.state is not TurnState.MERGED  # another turn answers it
                ):
                    waiting[turn.id] = turn
        for turn_id, turn in sorted(waiting.items(), key=lambda item: item[1].created_at):
            current = turn if turn.state in _TERMINAL else await store.get_turn(turn_id)
            if current is None or current.state not in _TERMINAL:
                break  # in order: a later turn is not answered before an earlier one
            if await runs_elsewhere((session.id,)):
                waiting[turn_id] = current  # ended: only the lock's release is awaited
                break
            del waiting[turn_id]
            answered.add(turn_id)
            frame = await terminal_frame(store, current)
            if frame is not None and not session.ended:
                session.end_turn(frame, turn_id)
        if not waiting and not looking:
            return
        await asyncio.sleep(POLL_INTERVAL)


async def terminal_frame(store: Store, turn: Turn) -> Numbered | None:
    match turn.state:
        case TurnState.COMPLETED | TurnState.CANCELLED:
            messages = await store.list_messages(turn.session_id)
            reply = "".join(
                m.content
                for m in messages
                if m.turn_id == turn.id and m.role == "assistant" and m.content_type in _REPLY_TYPES
            )
            cancelled = turn.state is TurnState.CANCELLED
            return f.Done(seq=0, turn_id=turn.id, content=reply, cancelled=cancelled)
        case TurnState.INTERRUPTED:
            info = f.ErrorInfo(
                code=InternalError.code,
                message=INTERRUPTED_MESSAGE,
                details={"turn_state": TurnState.INTERRUPTED.value},
            )
            return f.Error(seq=0, turn_id=turn.id, error=info)
        case TurnState.FAILED:
            code = turn.error_code or InternalError.code
            info = f.ErrorInfo(code=code, message=turn.error_message or "the turn failed")
            return f.Error(seq=0, turn_id=turn.id, error=info)
    return None
