"""The session state port: a `/v1/session` stream's ledger, shared between replicas.

The exactly-once rule (docs/replicas.md, "Session state"):

- outgoing: a numbered message is recorded (`record_sent`) *before* it is written to
  the socket, so whichever replica resumes resends it;
- incoming: `record_handled(seq)` is a compare-and-set from `seq - 1` to `seq`; only its
  winner applies the message. The effect itself is idempotent through the archive's
  idempotency key, so a replica that dies between the effect and the mark lets the
  next one re-run the message without a second effect;
- fencing: every connection that takes a session `claim`s it and gets a new epoch; a
  write carrying an older epoch raises `SessionMoved`, so a stale socket stops. A
  `create` over an existing ledger (a continued conversation's new numbering) carries
  the epoch on, so the old numbering's holders are fenced too.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from portico.health import Health


class SessionSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a replica needs to resume a stream; serialisable with msgspec."""

    epoch: int
    next_seq: int  # the seq the server's next numbered message gets
    handled: int  # the highest client seq handled
    peer_acked: int  # the highest server seq the client acknowledged
    unacknowledged: tuple[tuple[int, bytes], ...]  # the resend buffer, in order
    capabilities: bytes = b""  # the negotiated capabilities, as encoded on the wire
    window_deadline: float | None = None  # when a dropped session may no longer resume
    # The latest turns whose terminal message is recorded (newest first, at most
    # ENDED_TURNS_KEPT): a replica taking the session over answers the others.
    ended_turns: tuple[str, ...] = ()
    # The turn and step (core/events.py) of the latest turn event recorded: a replica
    # taking the session over mid-turn replays that turn's events after it.
    last_step: tuple[str, int] = ("", 0)


class TurnMark(msgspec.Struct, frozen=True):
    """What a numbered message says about the turn it belongs to, for a takeover."""

    ends: str = ""  # it is this turn's terminal message (`ended_turns`)
    step: tuple[str, int] | None = None  # it is the last message of (turn, step)'s event


NO_MARK = TurnMark()


class SessionHeader(msgspec.Struct, frozen=True, kw_only=True):
    """A session's fields without its buffers: what deciding who may take it needs."""

    epoch: int
    capabilities: bytes = b""
    window_deadline: float | None = None


ENDED_TURNS_KEPT = 64


class BufferLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_messages: int
    max_bytes: int


class SessionStates(Protocol):
    async def create(self, session_id: str, *, capabilities: bytes) -> int:
        """Start a session's ledger; returns its epoch (1, or past the ledger it replaces)."""
        ...

    async def claim(self, session_id: str) -> int:
        """Take the session for a new connection; a fresh epoch fences the older ones.
        The session has a connection again: its window deadline is cleared."""
        ...

    async def load(self, session_id: str) -> SessionSnapshot | None: ...

    async def claim_and_load(self, session_id: str) -> SessionSnapshot:
        """`claim`, then `load`, in one step: the snapshot of the session as this claim
        left it (its epoch the claim's). What a resume on another replica does."""
        ...

    async def header(self, session_id: str) -> SessionHeader | None:
        """The session's epoch, capabilities and window, none of its buffered messages:
        a resume checks ownership with it before it claims (one `load` after)."""
        ...

    async def record_sent(
        self, session_id: str, epoch: int, seq: int, data: bytes, mark: TurnMark = NO_MARK
    ) -> None:
        """Keep `data` as server message `seq` (the next one) until it is acknowledged;
        `mark.ends`, `mark.step`: kept in `ended_turns` and `last_step`, same step."""
        ...

    async def record_ack(self, session_id: str, epoch: int, seq: int) -> None: ...

    async def record_handled(
        self, session_id: str, epoch: int, seq: int, *, capabilities: bytes | None = None
    ) -> bool:
        """True if `seq` is the next client message and is now handled; False: duplicate.
        `capabilities` (a `context` message's effect) replaces them in the same step."""
        ...

    async def set_window(self, session_id: str, epoch: int, deadline: float | None) -> None: ...

    async def remove(self, session_id: str, epoch: int | None = None) -> None:
        """Forget the session; with `epoch`, only while that epoch still holds it."""
        ...

    async def health(self, within: float) -> Health:
        """Readiness: the ledger's store answers within `within` seconds."""
        ...

    async def close(self) -> None: ...
