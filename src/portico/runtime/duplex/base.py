"""The duplex runtime port: a live voice call, beside the text `Runtime`.

A text runtime turns one message into one reply. A duplex runtime holds a call:
the caller's audio goes in frame by frame while the agent's events come out on
their own schedule (it may speak, be interrupted, transcribe, speak again). So
the port is a call object with an inbound method and an outbound iterator, not
a generator per turn. The shape mirrors the runtime contract's duplex half
(spec/runtime-contract.md): `duplex_start` is `start()`, `audio_input` is
`send()`, and the events are `runtime_hello`, `media_chunk`, `chunk` (agent
text, or the caller's transcript with role "user"), `interruption`, `done`
per spoken turn and `error`.

Rules every implementation keeps (the duplex contract suite checks them):

- The first event is exactly one `Hello` (the counter-offer), before any audio.
- `AudioOut`, `AgentText`, `Transcript`, `Interruption` and `SpokenTurnDone`
  may follow in any number; a spoken turn ends with one `SpokenTurnDone`.
- The call ends with the iterator's end (hangup, `is_last`, `close()`), or with
  one `DuplexFailure`, after which the iterator ends: nothing follows a failure.
- `send()` after the call ended is ignored (the caller may still be talking);
  `close()` is idempotent and ends `events()` promptly.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Generic, Protocol, TypeVar, runtime_checkable

import msgspec

from portico.domain.memory import AgentMemory
from portico.runtime.base import HistoryReader

PCM16 = "pcm16"  # signed 16-bit little-endian linear PCM, the format every runtime hears


class AudioFormat(msgspec.Struct, frozen=True, kw_only=True):
    """A media format as the binary frame metadata and `MediaNegotiation` name it.

    `frame_rate` and `resolution` are video: a runtime offering either non-zero is
    answered `UNSATISFIABLE_FORMAT` (Portico carries audio only)."""

    codec: str = PCM16
    sample_rate: int = 16000
    channels: int = 1
    frame_rate: int = 0
    resolution: int = 0

    @property
    def is_video(self) -> bool:
        return self.frame_rate != 0 or self.resolution != 0

    @property
    def mime_type(self) -> str:
        """The MIME type audio of this format travels as (`media_chunk.mime_type`)."""
        if self.codec == PCM16:
            return f"audio/pcm;rate={self.sample_rate};channels={self.channels}"
        return f"audio/{self.codec}"


class DuplexStart(msgspec.Struct, frozen=True, kw_only=True):
    """What a call opens with: who, which agent, and the caller's format."""

    session_id: str
    agent: str
    owner: str  # the principal the session belongs to
    format: AudioFormat
    system_instruction: str = ""
    history_reader: HistoryReader | None = None
    memory: AgentMemory | None = None


class AudioIn(msgspec.Struct, frozen=True):
    """One frame of the caller's audio, in the caller's format, in order."""

    data: bytes
    sequence: int
    is_last: bool = False


# Outbound events -----------------------------------------------------------------


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    """The runtime's counter-offer: the format it speaks and hears (`session_config`)."""

    format: AudioFormat
    capabilities: tuple[str, ...] = ()


class AudioOut(msgspec.Struct, frozen=True, kw_only=True):
    """Agent speech, in the `Hello` format."""

    data: bytes
    media_id: str = ""
    sequence: int = 0
    is_last: bool = False


class AgentText(msgspec.Struct, frozen=True):
    """The text of what the agent says (a `chunk`)."""

    text: str


class Transcript(msgspec.Struct, frozen=True):
    """Recognised speech of the caller (a `chunk` with role "user"); `final` ends an
    utterance, which the archive keeps as one user message."""

    text: str
    final: bool = True


class Interruption(msgspec.Struct, frozen=True):
    """The caller barged in: the agent stopped speaking; clients drop buffered audio."""


class SpokenTurnDone(msgspec.Struct, frozen=True):
    """The end of one spoken agent turn; `content` None means the turn's `AgentText`."""

    content: str | None = None


class DuplexFailure(msgspec.Struct, frozen=True):
    """The call failed (`DUPLEX_ERROR` on the wire); the last event of the call."""

    code: str
    message: str


DuplexEvent = (
    Hello | AudioOut | AgentText | Transcript | Interruption | SpokenTurnDone | DuplexFailure
)


class DuplexCall(Protocol):
    """One live call with a runtime."""

    async def send(self, audio: AudioIn) -> None:
        """Hand the runtime one frame of caller audio (in order, never concurrently)."""

    def events(self) -> AsyncIterator[DuplexEvent]:
        """The runtime's events, `Hello` first; iterated once, by one reader."""

    async def close(self) -> None:
        """End the call (hangup, or the session ended); idempotent."""


# Optional on a DuplexCall: `hand_over(taker)`. While the reader of `events()` waits with
# nothing unread, the call may offer an event to `taker` instead of queueing it; True
# means taken (it must not be queued too), False that it goes to the reader as usual.
# It saves the reader's wakeup per frame of agent audio (docs/performance.md, "Voice
# calls"); a runtime without it is read through `events()` alone. The four runtimes
# here have it, through `EventQueue` below (the rules live there, once).
EventTaker = Callable[[DuplexEvent], bool]

Item = TypeVar("Item")


class EventQueue(Generic[Item]):
    """What a call has for the one reader of its `events()`, with the `hand_over` fast
    path every runtime shares.

    A deque and one future rather than an `asyncio.Queue`: every frame of agent audio
    passes here, and that queue's per-item bookkeeping was a third of the hop's cost
    (docs/performance.md, "Voice calls"). The hand-over rules:

    - an event is offered to the taker only while the reader waits with nothing
      unread, so the taker gets exactly what the reader would have got next and the
      order never changes; declined (or not offered) it is queued;
    - after `end()` nothing is offered: whatever follows goes to the reader.

    Items are what the runtime's reader maps to events (`DuplexEvent`s for most, a
    stream's messages for grpc). `limit` bounds the queue for `put_wait` (a producer
    reading a stream then stops, and the stream's flow control holds the peer)."""

    def __init__(self, limit: int = 0) -> None:
        self._items: deque[Item] = deque()
        self._reader: asyncio.Future[None] | None = None  # the reader, waiting for one
        self._room: asyncio.Future[None] | None = None  # a producer, waiting for room
        self._taker: EventTaker | None = None
        self._limit = limit
        self.ended = False

    def hand_over(self, taker: EventTaker) -> None:
        self._taker = taker

    @property
    def idle(self) -> bool:
        """The reader waits with nothing unread (what arrives now is its next); not a
        reader whose wait was cancelled (a deadline) and has yet to see it."""
        reader = self._reader
        return reader is not None and not reader.done() and not self._items

    @property
    def taking(self) -> bool:
        """An event arriving now would be offered to a taker."""
        return self._taker is not None and not self.ended and self.idle

    def full(self) -> bool:
        return 0 < self._limit <= len(self._items)

    def offer(self, event: DuplexEvent) -> bool:
        """True when the taker took `event` (then it must not be queued too)."""
        # `taking`, inlined (this runs per frame); a waiting reader has nothing unread:
        # `put` wakes and forgets it, and `get` waits only for an empty queue.
        taker, reader = self._taker, self._reader
        return (
            taker is not None
            and reader is not None
            and not reader.done()
            and not self.ended
            and taker(event)
        )

    def put(self, item: Item) -> None:
        self._items.append(item)
        reader, self._reader = self._reader, None
        if reader is not None and not reader.done():
            reader.set_result(None)

    async def put_wait(self, item: Item) -> None:
        """`put`, once the queue is under its limit."""
        while self.full():
            self._room = asyncio.get_running_loop().create_future()
            await self._room
        self.put(item)

    def end(self, last: Item) -> None:
        """Queue the reader's last item; nothing is offered from now on."""
        self.ended = True
        self.put(last)

    def clear(self) -> None:
        self._items.clear()
        self._wake_producer()

    async def get(self) -> Item:
        while not self._items:
            self._reader = asyncio.get_running_loop().create_future()
            try:
                await self._reader
            finally:
                self._reader = None  # woken, or cancelled (a deadline): not waiting now
        item = self._items.popleft()
        if self._room is not None:
            self._wake_producer()
        return item

    def _wake_producer(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)


class CallEvents(EventQueue[DuplexEvent | None]):
    """A call's events, None after the last: `push` offers one, else queues it."""

    def push(self, event: DuplexEvent) -> None:
        if not self.offer(event):
            self.put(event)

    def close(self) -> None:
        if not self.ended:
            self.end(None)

    async def drain(self) -> AsyncIterator[DuplexEvent]:
        while (event := await self.get()) is not None:
            yield event


class FailedCall:
    """A call that never got going (its runtime unreachable): its events are one
    `DuplexFailure`; audio sent to it is ignored."""

    def __init__(self, failure: DuplexFailure) -> None:
        self._failure = failure

    async def send(self, audio: AudioIn) -> None:
        return None

    async def events(self) -> AsyncIterator[DuplexEvent]:
        yield self._failure

    async def close(self) -> None:
        return None


@runtime_checkable
class DuplexRuntime(Protocol):
    async def start(self, start: DuplexStart) -> DuplexCall:
        """Open a call; raises a `PorticoError` (its wire code) when it cannot."""
