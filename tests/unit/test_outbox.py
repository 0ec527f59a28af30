"""The bounded send queue shared by the protocol cores."""

from __future__ import annotations

from portico.protocols.outbox import BinaryData, Outbox

BOUND = 100


def backlog() -> Outbox:
    """The bound is on the frames already waiting (every protocol's rule)."""
    return Outbox(BOUND)


def test_an_empty_queue_takes_a_frame_larger_than_the_bound() -> None:
    outbox = backlog()
    assert outbox.put(b"x" * (BOUND * 10))
    assert not outbox.overflowed
    assert outbox.pop() == b"x" * (BOUND * 10)


def test_a_large_frame_after_a_small_backlog_is_taken() -> None:
    # A chunk and a large `done` queued in the same step, before any write.
    outbox = backlog()
    assert outbox.put(b"c" * 10)
    assert outbox.put(b"d" * (BOUND * 10))
    assert not outbox.overflowed
    assert outbox.drain() == [b"c" * 10, b"d" * (BOUND * 10)]


def test_a_reader_that_keeps_up_never_overflows_whatever_the_frame_sizes() -> None:
    outbox = backlog()
    for size in (1, BOUND - 1, BOUND, BOUND + 1, BOUND * 100, 3):
        assert outbox.put(b"x" * size)
        assert outbox.pop() == b"x" * size
    assert not outbox.overflowed


def test_a_backlog_at_the_bound_refuses_the_next_frame_and_stays_overflowed() -> None:
    outbox = backlog()
    taken = 0
    while outbox.put(b"x" * 30):
        taken += 1
    # Taken while under the bound (0, 30, 60, 90 bytes waiting), refused at 120.
    assert taken == 4
    assert outbox.overflowed
    # Once overflowed, nothing is taken, even after the queue empties.
    outbox.drain()
    assert not outbox.put(b"y")
    assert outbox.pop() is None


def test_the_backlog_queue_holds_at_most_the_bound_plus_one_frame() -> None:
    outbox = backlog()
    accepted = [size for size in (40, 40, 40, 500, 1) if outbox.put(b"x" * size)]
    assert accepted == [40, 40, 40]  # 120 waiting: the large frame is refused
    assert sum(len(frame) for frame in outbox.drain()) < BOUND + 40


def test_unbounded_frames_are_taken_past_the_bound() -> None:
    outbox = backlog()
    assert outbox.put(b"x" * BOUND)
    assert outbox.put(b"y" * BOUND, bounded=False)
    assert not outbox.overflowed


def test_has_room_is_strict_byte_arithmetic_for_lossy_frames() -> None:
    outbox = backlog()
    assert outbox.has_room(BOUND)
    assert not outbox.has_room(BOUND + 1)  # no one-frame allowance for lossy frames
    outbox.put(BinaryData(b"x" * 60))
    assert outbox.has_room(40)
    assert not outbox.has_room(41)
    assert not outbox.overflowed
