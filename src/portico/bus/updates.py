"""Fan-out of committed archive updates to each user's RPC connections.

In-process here: the archive's update listener publishes, every `/v1/rpc`
connection of the update's owner receives. Across replicas a Redis pub/sub
implementation publishes the same updates to the other replicas' connections.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from portico.domain.model import Update

log = logging.getLogger("portico.bus")
UpdateSubscriber = Callable[[Update], None]


class InProcessUpdates:
    def __init__(self) -> None:
        self._subscribers: dict[str, list[UpdateSubscriber]] = {}

    def subscribe(self, owner: str, subscriber: UpdateSubscriber) -> None:
        self._subscribers.setdefault(owner, []).append(subscriber)

    def unsubscribe(self, owner: str, subscriber: UpdateSubscriber) -> None:
        subscribers = self._subscribers.get(owner)
        if subscribers and subscriber in subscribers:
            subscribers.remove(subscriber)
            if not subscribers:
                del self._subscribers[owner]

    def publish(self, update: Update) -> None:
        for subscriber in list(self._subscribers.get(update.owner, ())):
            try:
                subscriber(update)
            except Exception:
                log.exception("update subscriber failed owner=%s", update.owner)

    def subscribers(self, owner: str) -> int:
        return len(self._subscribers.get(owner, ()))
