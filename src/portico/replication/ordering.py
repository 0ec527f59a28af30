"""An owner's updates in offset order, each once, from two sources: no I/O.

With replicas, an owner's updates are written by any of them. This replica's own
arrive from its archive listener; another replica's are announced on the bus (the
offset only) and read back from the archive, which holds them once announced (an
update is published after its commit, and an owner's writes commit in offset order).
A `/v1/rpc` connection takes updates in offset order (a lower one after a higher one
is dropped as seen), so both sources go through `UpdateOrder` before it: it delivers
offset n only after n - 1, and says which range the archive must fill.
"""

from __future__ import annotations

from portico.domain.model import Update


class UpdateOrder:
    def __init__(self) -> None:
        self._next: dict[str, int] = {}  # the next offset to deliver, once begun
        self._held: dict[str, dict[int, Update]] = {}
        self._known: dict[str, int] = {}  # the highest offset known to exist

    def begun(self, owner: str) -> bool:
        return owner in self._next

    def begin(self, owner: str, head: int) -> list[Update]:
        """Deliver from `head + 1` (the archive's last offset when the owner's first
        listener came); what was held meanwhile and is newer is ready now."""
        if owner in self._next:
            return []
        self._next[owner] = head + 1
        return self._drain(owner)

    def end(self, owner: str) -> None:
        self._next.pop(owner, None)
        self._held.pop(owner, None)
        self._known.pop(owner, None)

    def offer(self, update: Update) -> list[Update]:
        """An update from either source; the updates now deliverable, in order."""
        owner = update.owner
        following = self._next.get(owner)
        if following is not None and update.offset < following:
            return []  # delivered already
        self._held.setdefault(owner, {})[update.offset] = update
        self._announce(owner, update.offset)
        return self._drain(owner) if following is not None else []

    def announce(self, owner: str, offset: int) -> None:
        """Another replica wrote `offset`: it exists in the archive."""
        self._announce(owner, offset)

    def _announce(self, owner: str, offset: int) -> None:
        self._known[owner] = max(self._known.get(owner, 0), offset)

    def missing(self, owner: str) -> tuple[int, int] | None:
        """(after, limit): the range to read from the archive, or None."""
        following = self._next.get(owner)
        known = self._known.get(owner, 0)
        if following is None or known < following or following in self._held.get(owner, {}):
            return None
        return following - 1, known - following + 1

    def skip_to(self, owner: str, offset: int) -> list[Update]:
        """The archive has nothing before `offset` any more (pruned): go on from it."""
        if owner in self._next and offset > self._next[owner]:
            self._next[owner] = offset
        return self._drain(owner)

    def _drain(self, owner: str) -> list[Update]:
        held = self._held.get(owner, {})
        following = self._next[owner]
        for stale in [offset for offset in held if offset < following]:
            del held[stale]
        ready: list[Update] = []
        while following in held:
            ready.append(held.pop(following))
            following += 1
        self._next[owner] = following
        return ready
