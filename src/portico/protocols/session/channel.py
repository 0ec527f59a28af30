"""The session-scoped half of the protocol: numbering, acks, the resend buffer.

A `Channel` belongs to a session, not to a connection: it survives drops, and a
resuming connection picks it up. It is role-agnostic (the server and the
Python client each keep one) and pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import deque

import msgspec

from portico.errors import BufferOverflow, ProtocolViolation
from portico.protocols.session.frames import ClientNumbered, ServerNumbered, encode

Numbered = ClientNumbered | ServerNumbered


class Channel:
    def __init__(self, *, max_messages: int, max_bytes: int) -> None:
        self._max_messages = max_messages
        self._max_bytes = max_bytes
        self.next_seq = 1  # the seq our next numbered message gets
        self.handled = 0  # the highest peer seq handled (everything up to it)
        self.peer_acked = 0  # the highest of our seqs the peer acknowledged
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffer_bytes = 0

    @classmethod
    def restore(
        cls,
        *,
        max_messages: int,
        max_bytes: int,
        next_seq: int,
        handled: int,
        peer_acked: int,
        unacknowledged: tuple[tuple[int, bytes], ...],
    ) -> Channel:
        """A channel picked up where a ledger left it (a resume on another replica)."""
        channel = cls(max_messages=max_messages, max_bytes=max_bytes)
        channel.next_seq, channel.handled, channel.peer_acked = next_seq, handled, peer_acked
        for seq, data in unacknowledged:
            channel.keep(seq, data)
        return channel

    # -- outgoing -----------------------------------------------------------------------

    def send(self, frame: Numbered) -> bytes:
        """Number `frame`, keep it until acknowledged, and return its encoding."""
        seq, data = self.number(frame)
        if (
            len(self._buffer) >= self._max_messages
            or self._buffer_bytes + len(data) > self._max_bytes
        ):
            self.next_seq -= 1
            raise BufferOverflow()
        self.keep(seq, data)
        return data

    def number(self, frame: Numbered) -> tuple[int, bytes]:
        """Give `frame` the next seq and encode it, without keeping it yet: a server
        keeps a message only once its ledger (the session-state port) holds it."""
        seq = self.next_seq
        if frame.seq != seq:  # a frame built with its number needs no copy
            frame = msgspec.structs.replace(frame, seq=seq)
        self.next_seq += 1
        return seq, encode(frame)

    def keep(self, seq: int, data: bytes) -> None:
        """Hold message `seq` for a resend until it is acknowledged (bounds checked by
        `send` or by the ledger that recorded it)."""
        if seq <= self.peer_acked:
            return  # acknowledged while it was being recorded: nothing to resend
        self._buffer.append((seq, data))
        self._buffer_bytes += len(data)

    def replace_backlog(self, unacknowledged: tuple[tuple[int, bytes], ...]) -> None:
        """Hold exactly these messages for a resend (read back from a port that keeps
        the resend buffer itself, so this channel kept none meanwhile)."""
        self._buffer.clear()
        self._buffer_bytes = 0
        for seq, data in unacknowledged:
            self.keep(seq, data)

    def acknowledge(self, seq: int) -> None:
        """A cumulative ack: forget everything up to `seq`. A regressing ack is ignored."""
        if seq >= self.next_seq:
            raise ProtocolViolation(
                f"ack {seq} is beyond the highest seq sent ({self.next_seq - 1})"
            )
        if seq <= self.peer_acked:
            return
        self.peer_acked = seq
        while self._buffer and self._buffer[0][0] <= seq:
            self._buffer_bytes -= len(self._buffer.popleft()[1])

    def unacknowledged(self) -> list[bytes]:
        """What the peer has not acknowledged, in order: the resend backlog."""
        return [data for _, data in self._buffer]

    @property
    def buffered(self) -> tuple[int, int]:
        """(messages, bytes) waiting for an acknowledgement."""
        return len(self._buffer), self._buffer_bytes

    # -- incoming -----------------------------------------------------------------------

    def receive(self, seq: int) -> bool:
        """True for the next message in order, False for a duplicate; a gap is an error."""
        if seq <= self.handled:
            return False
        if seq != self.handled + 1:
            raise ProtocolViolation(f"seq {seq} skips ahead: expected {self.handled + 1}")
        self.handled = seq
        return True
