"""One at a time, in arrival order, free when nobody else is waiting.

`LiveCall.send` hands the runtime one caller frame at a time (the duplex port's rule:
in order, never concurrently). One connection already sends its frames one after
another, awaiting each (its read loop awaits the frame's handling before it reads the
next), so the only contention is a call taken over by a newer connection (`?resume`)
while the older one's frame is still going in: a runtime whose `send` suspends (grpc
and openai-realtime write to a socket) could then see two frames at once. An
`asyncio.Lock` covers that, but costs two coroutines on every frame of every call; here
an uncontended entry is a flag, and only a real wait makes a future.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class Turnstile:
    def __init__(self) -> None:
        self.busy = False  # someone is through and has not left
        self._waiting: deque[asyncio.Future[None]] = deque()

    async def wait(self) -> None:
        """Wait for the turn (`busy` was True); `leave()` after, as when through at once."""
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.leave()  # given the turn, then cancelled: the next one's now
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(turn)
            raise

    def leave(self) -> None:
        """The turn passes to the first still waiting (`busy` stays True), else ends."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.busy = False
