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

    Consecutive frames of a stream fall in the same millisecond, so the text is
    formatted once per millisecond (its date-and-time prefix once per second) and
    kept with the span of `now` it holds for: `since <= now < until` means `text`
    is the stamp, a comparison a hot path can make without calling `at`.
    """

    __slots__ = ("_offset", "_prefix", "_second", "since", "text", "until")

    def __init__(self, *, now: float, wall: float) -> None:
        self._offset = wall - now  # wall-clock seconds at monotonic `now`
        self.forget()

    @property
    def offset(self) -> float:
        """Wall-clock minus monotonic seconds: `Timestamps(now=0.0, wall=offset)` stamps
        as this one does."""
        return self._offset

    def forget(self) -> None:
        """Drop the cached text (about 250 bytes): for a connection that may now be
        idle for long; the next stamp formats afresh."""
        self._second = -1
        self._prefix = ""
        self.since = self.until = 0.0
        self.text = ""

    def at(self, now: float) -> str:
        """The wall-clock time at monotonic `now`."""
        if self.since <= now < self.until:
            return self.text
        millisecond = int((now + self._offset) * 1000)
        second, fraction = divmod(millisecond, 1000)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        self.text = f"{self._prefix}.{fraction:03d}Z"
        self.since = millisecond / 1000 - self._offset
        self.until = self.since + 0.001
        return self.text
