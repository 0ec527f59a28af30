"""One `/v1/session` session's writes to the session-state port, in order, fenced.

The port (`portico.sessionstate`) is where the session's numbered streams live, so
any replica can resume them. This module is the adapter's side of it:

- `SessionProfile`: what a replica needs besides the positions to take a session
  over (owner, binding, agent, capabilities, audio, tools, context), stored as the
  ledger's `capabilities` bytes.
- `SessionLedger`: records each outbound numbered message *before* it is written
  (`send` calls back `on_recorded`, which writes it), in order, under the epoch of
  the connection that holds the session; marks inbound seqs, acks and the window
  under the lock that serialises them with a `claim`. A write refused with
  `SessionMoved` means another replica claimed the session: `on_moved` fences this
  process's copy.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from portico.errors import BufferOverflow, SessionMoved
from portico.protocols.session import frames as f
from portico.sessionstate.base import NO_MARK, SessionStates, TurnMark
from portico.sessionstate.memory import InProcessSessionStates

log = logging.getLogger("portico.session")


class SessionProfile(msgspec.Struct, frozen=True, kw_only=True):
    """The session's fixed terms (and its context), as the port keeps them."""

    owner: str
    binding: str = ""
    agent: str
    capabilities: tuple[str, ...]
    audio: f.AudioChoice | None = None
    tools: tuple[f.ToolSpec, ...] = ()
    context: dict[str, Any] = msgspec.field(default_factory=dict)
    opened_at: float = 0.0  # wall clock: this numbering's turns are the ones after it
    # Where the session's relayed turn events stood when this numbering began (a
    # continued conversation): a takeover replays none from before (session_replay.py).
    events_after: str = ""

    def encode(self) -> bytes:
        return _ENCODER.encode(self)


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(SessionProfile)


def decode_profile(data: bytes) -> SessionProfile | None:
    """The profile a ledger holds; None when it holds none this version can read."""
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


Recorded = Callable[[int, bytes], None]
Notice = Callable[[], None]
_Message = tuple[int, bytes, TurnMark]  # what `send` was given


class SessionLedger:
    def __init__(
        self,
        states: SessionStates,
        session_id: str,
        epoch: int,
        *,
        handled: int = 0,
    ) -> None:
        self.states = states
        self.session_id = session_id
        self.epoch = epoch  # the epoch of the connection that holds the session here
        self.handled = handled  # the highest client seq the port holds handled
        self.on_recorded: Recorded = _ignore_recorded
        self.on_moved: Notice = _ignore
        self.on_overflow: Notice = _ignore
        self.on_failure: Notice = _ignore
        self.stopped = False
        # The in-process backend records in the caller's step: one process keeps the
        # order and speed of a plain buffer (no task, no await per message).
        self._now = states if isinstance(states, InProcessSessionStates) else None
        self._lock = asyncio.Lock()
        # Messages to record, in order, and callbacks to run once those before them are.
        self._pending: deque[_Message | Notice] = deque()
        self._flushing: asyncio.Task[None] | None = None

    # -- outbound -------------------------------------------------------------------------

    def send(self, seq: int, data: bytes, mark: TurnMark = NO_MARK) -> None:
        """Record message `seq`, then hand it to `on_recorded` (which writes it).
        `mark`: the turn it ends, the turn event it ends (a takeover replays after it)."""
        now = self._now
        if now is not None and not self._pending and not self.stopped:
            try:
                now.record_sent_now(self.session_id, self.epoch, seq, data, mark)
            except Exception as exc:
                self._failed(exc)
                return
            self.on_recorded(seq, data)
            return
        if self.stopped:
            return
        self._pending.append((seq, data, mark))
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    def after_recorded(self, callback: Notice) -> None:
        """Run `callback` once every message handed to `send` so far is recorded and
        written: a binary frame never overtakes its item's `audio_start`."""
        if self.stopped:
            return
        if not self._pending:
            callback()
        else:
            self._pending.append(callback)

    async def _flush(self) -> None:
        try:
            while self._pending and not self.stopped:
                entry = self._pending[0]
                if callable(entry):
                    self._pending.popleft()
                    entry()
                    continue
                seq, data, mark = entry
                async with self._lock:
                    await self.states.record_sent(self.session_id, self.epoch, seq, data, mark)
                self._pending.popleft()
                self.on_recorded(seq, data)
        except Exception as exc:
            self._failed(exc)
        finally:
            self._flushing = None

    def _failed(self, exc: Exception) -> None:
        self._pending.clear()
        if isinstance(exc, SessionMoved):
            self.on_moved()
        elif isinstance(exc, BufferOverflow):
            self.on_overflow()
        else:
            log.error("session state write failed session=%s: %r", self.session_id, exc)
            self.on_failure()

    # -- claims and marks -----------------------------------------------------------------

    async def claim(self) -> bool:
        """Take the session for a new connection of this process. True when no other
        holder claimed it since this copy's epoch: the copy is current."""
        async with self._lock:
            epoch = await self.states.claim(self.session_id)
            current = epoch == self.epoch + 1
            self.epoch = epoch
            return current

    async def mark_handled(self, epoch: int, seq: int, capabilities: bytes | None) -> bool:
        """Client message `seq` is handled (before its effect shows); False: a duplicate."""
        async with self._lock:
            fresh = await self.states.record_handled(
                self.session_id, epoch, seq, capabilities=capabilities
            )
            if fresh:
                self.handled = seq
            return fresh

    @property
    def in_process(self) -> bool:
        """The port is this process's memory: it holds the resend buffer, so the
        session's `Channel` needs no copy of it (`backlog` reads it back for a resume)."""
        return self._now is not None

    def backlog(self) -> tuple[tuple[int, bytes], ...]:
        """The in-process port's resend buffer (empty for any other port)."""
        now = self._now
        return () if now is None else now.unacknowledged_now(self.session_id)

    def acknowledged_now(self, epoch: int, seq: int) -> bool:
        """`acknowledged` in the caller's step, on the in-process port while no claim or
        mark holds the lock (they never suspend there); False: await `acknowledged`."""
        now = self._now
        if now is None or self._lock.locked():
            return False
        now.record_ack_now(self.session_id, epoch, seq)
        return True

    async def acknowledged(self, epoch: int, seq: int) -> None:
        async with self._lock:
            await self.states.record_ack(self.session_id, epoch, seq)

    async def window(self, deadline: float | None) -> None:
        async with self._lock:
            await self.states.set_window(self.session_id, self.epoch, deadline)

    def forget(self) -> asyncio.Task[None] | None:
        """Forget the session in the port, unless a newer epoch holds it by now: at
        once in this process's port (a resume right after `end` must fail), else in a
        task (the caller spawns it)."""
        self.stop()
        if self._now is not None:
            self._now.remove_now(self.session_id, self.epoch)
            return None
        return asyncio.get_running_loop().create_task(
            self.states.remove(self.session_id, self.epoch)
        )

    def stop(self) -> None:
        """No more writes from this copy (ended, or fenced by another replica)."""
        self.stopped = True
        self._pending.clear()


def _ignore() -> None:
    return None


def _ignore_recorded(seq: int, data: bytes) -> None:
    return None
