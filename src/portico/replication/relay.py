"""Which topics this replica reads and which of their entries its listeners get: no I/O.

A replica reads a topic while at least one listener here wants it (a session's `/ws`
or `/v1/session` connection, an owner's `/v1/rpc` connection). It delivers an entry to
those listeners unless this replica published it (its own listeners had the event
directly from the turn) and only once: an entry at or before the topic's last
delivered position is a repeat (a read restarted from an older position).
"""

from __future__ import annotations


def session_topic(session_id: str) -> str:
    return f"turns:session:{session_id}"


def owner_topic(owner: str) -> str:
    return f"turns:owner:{owner}"


def position_key(position: str) -> tuple[int, int]:
    """Redis stream ids (`ms-seq`) and the memory bus's counters, in their order."""
    first, _, second = position.partition("-")
    return int(first), int(second or 0)


class Relay:
    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self._watchers: dict[str, int] = {}
        self._last: dict[str, tuple[int, int]] = {}
        self._positions: dict[str, str] = {}  # the last position as the bus wrote it

    def watch(self, topic: str) -> bool:
        """One more listener wants `topic`; True when a read must start."""
        count = self._watchers.get(topic, 0)
        self._watchers[topic] = count + 1
        return count == 0

    def unwatch(self, topic: str) -> bool:
        """A listener left; True when the topic's read must stop (nobody wants it)."""
        count = self._watchers.get(topic, 0) - 1
        if count > 0:
            self._watchers[topic] = count
            return False
        self._watchers.pop(topic, None)
        self._last.pop(topic, None)
        self._positions.pop(topic, None)
        return count == 0

    def topics(self) -> list[str]:
        return list(self._watchers)

    def watched(self, topic: str) -> bool:
        return topic in self._watchers

    def accept(self, topic: str, position: str, origin: str) -> bool:
        """Whether the entry goes to this replica's listeners of `topic`."""
        if topic not in self._watchers:
            return False
        key = position_key(position)
        last = self._last.get(topic)
        if last is not None and key <= last:
            return False
        self._last[topic] = key
        self._positions[topic] = position
        return origin != self.replica_id

    def start(self, topic: str, position: str) -> None:
        """A read of `topic` begins after `position` (the topic's newest entry when the
        first listener came): a read restarted before any entry arrived goes on from
        there, not from what is newest by then."""
        if topic in self._watchers and topic not in self._positions:
            self._positions[topic] = position
            self._last[topic] = position_key(position)

    def last_position(self, topic: str) -> str:
        """Where a restarted read of `topic` goes on from ("": only new entries)."""
        return self._positions.get(topic, "")
