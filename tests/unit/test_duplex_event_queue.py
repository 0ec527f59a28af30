"""The call event queue every duplex runtime shares, and its `hand_over` rules
(runtime/duplex/base.py `EventQueue`): an event is offered only while the reader waits
with nothing unread, the order the reader and the taker see never changes, and after
the end nothing is offered."""

from __future__ import annotations

import asyncio

from portico.runtime.duplex.base import (
    AgentText,
    AudioOut,
    CallEvents,
    DuplexEvent,
    EventQueue,
    SpokenTurnDone,
)


def audio(sequence: int) -> AudioOut:
    return AudioOut(data=b"\x00\x00", sequence=sequence)


class Taker:
    """Takes agent audio (as the call service does), recording what it took; what it
    took is also put on `seen`, the order the listener hears things in."""

    def __init__(self) -> None:
        self.seen: list[DuplexEvent] = []
        self.taken: list[DuplexEvent] = []
        self.accepting = True

    def __call__(self, event: DuplexEvent) -> bool:
        if not self.accepting or not isinstance(event, AudioOut):
            return False
        self.taken.append(event)
        self.seen.append(event)
        return True


async def waiting(events: CallEvents) -> asyncio.Future[DuplexEvent | None]:
    """The reader, waiting for its next event."""
    reading = asyncio.ensure_future(events.get())
    await asyncio.sleep(0)  # it runs up to its wait
    assert events.idle
    return reading


async def test_nothing_is_offered_while_the_reader_is_not_waiting() -> None:
    events, taker = CallEvents(), Taker()
    events.hand_over(taker)
    events.push(audio(0))  # nobody reads yet
    assert taker.taken == []
    assert await events.get() == audio(0)


async def test_a_waiting_reader_with_nothing_unread_has_its_next_event_taken() -> None:
    events, taker = CallEvents(), Taker()
    events.hand_over(taker)
    reading = await waiting(events)
    events.push(audio(0))
    events.push(audio(1))  # still waiting, still nothing unread
    assert taker.taken == [audio(0), audio(1)]
    assert not reading.done()
    events.push(AgentText("hi"))  # declined: it wakes the reader
    assert await reading == AgentText("hi")


async def test_the_order_never_changes_behind_an_unread_event() -> None:
    events, taker = CallEvents(), Taker()
    seen = taker.seen
    events.hand_over(taker)
    reading = await waiting(events)
    events.push(AgentText("first"))  # declined: queued, the reader woken
    events.push(audio(0))  # the reader has not read the text yet: queued behind it
    events.push(audio(1))
    assert taker.taken == []
    seen.append(await reading)
    seen.append(await events.get())
    seen.append(await events.get())
    assert seen == [AgentText("first"), audio(0), audio(1)]
    # Caught up and waiting again: the next one is taken, after all of those.
    reading = await waiting(events)
    events.push(audio(2))
    assert seen == [AgentText("first"), audio(0), audio(1), audio(2)]
    reading.cancel()


async def test_a_declined_event_goes_to_the_reader() -> None:
    events, taker = CallEvents(), Taker()
    taker.accepting = False
    events.hand_over(taker)
    reading = await waiting(events)
    events.push(audio(0))
    assert await reading == audio(0)
    assert taker.taken == []


async def test_after_the_end_events_go_to_the_reader_and_none_is_offered() -> None:
    events, taker = CallEvents(), Taker()
    events.hand_over(taker)
    reading = await waiting(events)
    events.push(SpokenTurnDone())
    events.close()
    assert await reading == SpokenTurnDone()
    assert [event async for event in events.drain()] == []  # the end: None
    reading = asyncio.ensure_future(events.get())
    await asyncio.sleep(0)
    events.push(audio(9))  # a late frame of a runtime that went on speaking
    assert taker.taken == []
    assert await reading == audio(9)


async def test_a_reader_whose_wait_was_cancelled_is_not_waiting() -> None:
    """A deadline cancels the reader's wait; until it runs again it is not idle, so
    an event arriving then is queued, not taken behind its back."""
    events, taker = CallEvents(), Taker()
    events.hand_over(taker)
    reading = await waiting(events)
    reading.cancel()
    events.push(audio(0))
    assert taker.taken == []
    assert await events.get() == audio(0)


async def test_a_bounded_queue_holds_its_producer_until_there_is_room() -> None:
    inbox: EventQueue[int] = EventQueue(limit=2)
    await inbox.put_wait(1)
    await inbox.put_wait(2)
    assert inbox.full()
    third = asyncio.ensure_future(inbox.put_wait(3))
    await asyncio.sleep(0)
    assert not third.done()
    assert await inbox.get() == 1
    await asyncio.wait_for(third, 5)
    assert [await inbox.get(), await inbox.get()] == [2, 3]
