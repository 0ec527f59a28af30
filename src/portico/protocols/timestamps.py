"""RFC 3339 timestamps for server frames, from a monotonic `now`, cheap enough per chunk.

A sans-I/O core never reads a clock: it is told the wall-clock time once, next to
the monotonic `now` its timers use, and stamps each frame with `now` moved by that
offset. The monotonic clock is slewed with the wall clock (NTP adjusts its rate),
so the two drift apart only when the wall clock is stepped.
"""

from __future__ import annotations

import time


class Timestamps:
    """UTC, to the millisecond (`2025-01-09T12:00:00.123Z`), as Omnia's clients parse them.

    Consecutive frames of a stream fall in the same millisecond or second, so the
    text is formatted once per millisecond and its date-and-time prefix once per
    second: a stamp costs a multiplication and a comparison on the streaming path.
    """

    __slots__ = ("_millisecond", "_offset", "_prefix", "_second", "_text")

    def __init__(self, *, now: float, wall: float) -> None:
        self._offset = wall - now  # wall-clock seconds at monotonic `now`
        self._millisecond = -1
        self._text = ""
        self._second = -1
        self._prefix = ""

    def at(self, now: float) -> str:
        """The wall-clock time at monotonic `now`."""
        millisecond = int((now + self._offset) * 1000)
        if millisecond != self._millisecond:
            self._millisecond = millisecond
            second, fraction = divmod(millisecond, 1000)
            if second != self._second:
                self._second = second
                self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._text = f"{self._prefix}.{fraction:03d}Z"
        return self._text
