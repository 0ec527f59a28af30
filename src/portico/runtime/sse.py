"""Server-sent events, decoded sans-I/O: feed the bytes as they arrive, get each event's data.

Only what chat-completions streams use: `data` fields (several lines of one event
are joined with a newline), comments and other fields ignored, lines ended by
CRLF, LF or CR (the WHATWG event-stream rules).
"""

from __future__ import annotations


class SseError(Exception):
    """The stream breaks a bound of the decoder."""


class SseDecoder:
    def __init__(self, *, max_event_bytes: int) -> None:
        self._max_event_bytes = max_event_bytes
        self._buffer = bytearray()
        self._data: list[str] = []
        self._data_bytes = 0

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event `chunk` completes."""
        self._buffer += chunk
        events: list[str] = []
        while (line := self._next_line()) is not None:
            event = self._line(line)
            if event is not None:
                events.append(event)
        self._check_size(len(self._buffer))
        return events

    def _check_size(self, unparsed: int) -> None:
        if self._data_bytes + unparsed > self._max_event_bytes:
            raise SseError(f"an event is larger than {self._max_event_bytes} bytes")

    def close(self) -> list[str]:
        """At the end of the stream: the last event, when only its blank line is missing."""
        line = bytes(self._buffer).rstrip(b"\r")
        self._buffer.clear()
        return [event for event in (self._line(line), self._line(b"")) if event is not None]

    def _next_line(self) -> bytes | None:
        buffer = self._buffer
        ends = [index for index in (buffer.find(b"\n"), buffer.find(b"\r")) if index >= 0]
        if not ends:
            return None
        end = min(ends)
        if buffer[end] == 13 and end + 1 == len(buffer):
            return None  # a CR at the end: wait, a LF may follow it in the next chunk
        width = 2 if buffer[end] == 13 and buffer[end + 1] == 10 else 1
        line = bytes(buffer[:end])
        del buffer[: end + width]
        return line

    def _line(self, line: bytes) -> str | None:
        if not line:
            return self._dispatch()
        field, _, value = line.partition(b":")
        if field == b"data":
            text = value.removeprefix(b" ").decode("utf-8", errors="replace")
            self._data.append(text)
            self._data_bytes += len(value)
            self._check_size(0)
        return None  # comments (an empty field name), `event`, `id` and `retry` are not used

    def _dispatch(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data.clear()
        self._data_bytes = 0
        return data
