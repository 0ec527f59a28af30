"""Session state in this process: live objects, no serialisation per message."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from portico.errors import BufferOverflow, ProtocolViolation, ResumeFailed, SessionMoved
from portico.health import IN_PROCESS, Health
from portico.sessionstate.base import (
    ENDED_TURNS_KEPT,
    NO_MARK,
    BufferLimits,
    SessionHeader,
    SessionSnapshot,
    TurnMark,
)


@dataclass(slots=True)
class _Ledger:
    capabilities: bytes
    epoch: int = 1
    next_seq: int = 1
    handled: int = 0
    peer_acked: int = 0
    buffer: deque[tuple[int, bytes]] = field(default_factory=deque)
    buffer_bytes: int = 0
    window_deadline: float | None = None
    ended_turns: deque[str] = field(default_factory=lambda: deque(maxlen=ENDED_TURNS_KEPT))
    last_step: tuple[str, int] = ("", 0)


class InProcessSessionStates:
    def __init__(self, limits: BufferLimits) -> None:
        self._limits = limits
        self._max_messages, self._max_bytes = limits.max_messages, limits.max_bytes
        self._ledgers: dict[str, _Ledger] = {}

    async def create(self, session_id: str, *, capabilities: bytes) -> int:
        previous = self._ledgers.get(session_id)
        epoch = 1 if previous is None else previous.epoch + 1
        self._ledgers[session_id] = _Ledger(capabilities=capabilities, epoch=epoch)
        return epoch

    async def claim(self, session_id: str) -> int:
        ledger = self._existing(session_id)
        ledger.epoch += 1
        ledger.window_deadline = None
        return ledger.epoch

    async def claim_and_load(self, session_id: str) -> SessionSnapshot:
        await self.claim(session_id)
        snapshot = await self.load(session_id)
        assert snapshot is not None  # claimed: it exists
        return snapshot

    async def load(self, session_id: str) -> SessionSnapshot | None:
        ledger = self._ledgers.get(session_id)
        if ledger is None:
            return None
        return SessionSnapshot(
            epoch=ledger.epoch,
            next_seq=ledger.next_seq,
            handled=ledger.handled,
            peer_acked=ledger.peer_acked,
            unacknowledged=tuple(ledger.buffer),
            capabilities=ledger.capabilities,
            window_deadline=ledger.window_deadline,
            ended_turns=tuple(reversed(ledger.ended_turns)),
            last_step=ledger.last_step,
        )

    async def header(self, session_id: str) -> SessionHeader | None:
        ledger = self._ledgers.get(session_id)
        if ledger is None:
            return None
        return SessionHeader(
            epoch=ledger.epoch,
            capabilities=ledger.capabilities,
            window_deadline=ledger.window_deadline,
        )

    async def record_sent(
        self, session_id: str, epoch: int, seq: int, data: bytes, mark: TurnMark = NO_MARK
    ) -> None:
        self.record_sent_now(session_id, epoch, seq, data, mark)

    def record_sent_now(
        self, session_id: str, epoch: int, seq: int, data: bytes, mark: TurnMark = NO_MARK
    ) -> None:
        """`record_sent` in the caller's step: one process needs no task per message.
        On every numbered message of every session: kept to the fewest lookups."""
        ledger = self._ledgers.get(session_id)
        if ledger is None:
            raise ResumeFailed()
        if epoch != ledger.epoch:
            raise SessionMoved()
        if seq != ledger.next_seq:
            raise ProtocolViolation(f"server seq {seq} is not the next ({ledger.next_seq})")
        size = len(data)
        buffer = ledger.buffer
        if len(buffer) >= self._max_messages or ledger.buffer_bytes + size > self._max_bytes:
            raise BufferOverflow()
        buffer.append((seq, data))
        ledger.buffer_bytes += size
        ledger.next_seq = seq + 1
        if mark is not NO_MARK:
            if mark.ends:
                ledger.ended_turns.append(mark.ends)
            if mark.step is not None:
                ledger.last_step = mark.step

    async def record_ack(self, session_id: str, epoch: int, seq: int) -> None:
        self.record_ack_now(session_id, epoch, seq)

    def record_ack_now(self, session_id: str, epoch: int, seq: int) -> None:
        """`record_ack` in the caller's step (a client acks every few messages)."""
        ledger = self._current(session_id, epoch)
        if seq >= ledger.next_seq:
            raise ProtocolViolation(f"ack {seq} is beyond the highest seq sent")
        if seq <= ledger.peer_acked:
            return
        ledger.peer_acked = seq
        while ledger.buffer and ledger.buffer[0][0] <= seq:
            ledger.buffer_bytes -= len(ledger.buffer.popleft()[1])

    async def record_handled(
        self, session_id: str, epoch: int, seq: int, *, capabilities: bytes | None = None
    ) -> bool:
        ledger = self._current(session_id, epoch)
        if seq <= ledger.handled:
            return False
        if seq != ledger.handled + 1:
            raise ProtocolViolation(f"seq {seq} skips ahead: expected {ledger.handled + 1}")
        ledger.handled = seq
        if capabilities is not None:
            ledger.capabilities = capabilities
        return True

    async def set_window(self, session_id: str, epoch: int, deadline: float | None) -> None:
        self._current(session_id, epoch).window_deadline = deadline

    async def remove(self, session_id: str, epoch: int | None = None) -> None:
        self.remove_now(session_id, epoch)

    def unacknowledged_now(self, session_id: str) -> tuple[tuple[int, bytes], ...]:
        """The session's resend buffer, in order (empty for an unknown session)."""
        ledger = self._ledgers.get(session_id)
        return () if ledger is None else tuple(ledger.buffer)

    def remove_now(self, session_id: str, epoch: int | None = None) -> None:
        """`remove` in the caller's step."""
        ledger = self._ledgers.get(session_id)
        if ledger is not None and (epoch is None or ledger.epoch == epoch):
            del self._ledgers[session_id]

    async def health(self, within: float) -> Health:
        return IN_PROCESS

    def _existing(self, session_id: str) -> _Ledger:
        ledger = self._ledgers.get(session_id)
        if ledger is None:
            raise ResumeFailed()
        return ledger

    def _current(self, session_id: str, epoch: int) -> _Ledger:
        ledger = self._existing(session_id)
        if epoch != ledger.epoch:
            raise SessionMoved()
        return ledger

    async def close(self) -> None:
        self._ledgers.clear()
