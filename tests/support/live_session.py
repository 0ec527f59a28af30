"""A `/v1/session` `LiveSession` on the in-process session-state port, for unit tests of
the adapter's side of the ledger (no socket, no engine)."""

from __future__ import annotations

from portico.protocols.session.channel import Channel
from portico.server.session_ledger import SessionLedger
from portico.server.session_ws import LiveSession
from portico.sessionstate.base import BufferLimits
from portico.sessionstate.memory import InProcessSessionStates

LIMIT = 100  # messages, each side
BYTES = 100_000


async def in_process_session(
    session_id: str = "s-1", *, counts_steps: bool | None = None
) -> tuple[InProcessSessionStates, LiveSession, int]:
    """The port, a session on it and the session's epoch. `counts_steps`: True to keep
    turn steps as on a port replicas share (None: the in-process default, which keeps
    none)."""
    states = InProcessSessionStates(BufferLimits(max_messages=LIMIT, max_bytes=BYTES))
    epoch = await states.create(session_id, capabilities=b"{}")
    live = LiveSession(
        session_id=session_id,
        owner="u",
        agent="a",
        capabilities=(),
        tools=(),
        context={},
        channel=Channel(max_messages=LIMIT, max_bytes=BYTES),
        ledger=SessionLedger(states, session_id, epoch),
        sessions={},
        counts_steps=counts_steps,
    )
    return states, live, epoch
