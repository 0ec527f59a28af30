"""The bounded queue of encoded frames every protocol core writes into."""

from __future__ import annotations

from collections import deque


class BinaryData(bytes):
    """A queued frame to send as a WebSocket binary frame; every other frame is text.

    A marker subclass rather than a (kind, bytes) pair, so the cores and sockets of
    the text-only protocols stay as they are.
    """


class Outbox:
    """Frames waiting for the socket, bounded in bytes.

    The bound is on the backlog: a frame is taken while the frames already waiting
    are under `max_bytes`, so an empty queue takes any frame (a `done` larger than
    the bound reaches a client that keeps up) and the queue holds at most the bound
    plus one frame. A client that stops reading fills it; then it refuses frames and
    stays `overflowed`, and the core closes the connection. Never unbounded.
    """

    # Slots and a deque made at the first frame: one per connection, most of them idle
    # (an empty deque allocates its first block of 64 entries, about 600 bytes).
    __slots__ = ("_bytes", "_frames", "_max_bytes", "overflowed")

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._frames: deque[bytes] | None = None  # None: empty
        self._bytes = 0
        self.overflowed = False

    def put(self, data: bytes, *, bounded: bool = True) -> bool:
        """Queue `data`; False (and overflowed from now on) when it does not fit."""
        if self.overflowed:
            return False
        if bounded and self._frames and self._bytes >= self._max_bytes:
            self.overflowed = True
            return False
        if self._frames is None:
            self._frames = deque()
        self._frames.append(data)
        self._bytes += len(data)
        return True

    def pop(self) -> bytes | None:
        if not self._frames:
            return None
        data = self._frames.popleft()
        self._bytes -= len(data)
        if not self._frames:
            self._frames = None  # an idle connection holds no block
        return data

    def drain(self) -> list[bytes]:
        out = list(self._frames) if self._frames else []
        self._frames = None
        self._bytes = 0
        return out

    def has_room(self, size: int) -> bool:
        """Whether `size` more bytes fit within the bound, without marking the queue
        overflowed. Plain byte arithmetic (no one-frame allowance): for lossy frames,
        dropped rather than let the queue pass the bound."""
        return not self.overflowed and self._bytes + size <= self._max_bytes
