"""The token bucket behind every rate limit (sans-I/O: time comes in as `now`)."""

from __future__ import annotations

import math

from portico.domain.limits import TokenBucket


def test_a_full_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    bucket = TokenBucket(rate=10, burst=5, now=0.0)
    assert bucket.allow(0.0, 5)
    assert not bucket.allow(0.0)  # empty
    assert bucket.allow(0.1)  # one token back after 0.1 s
    assert not bucket.allow(0.1)
    assert bucket.allow(100.0, 5)  # refilled, but never past the burst
    assert not bucket.allow(100.0)


def test_a_refused_request_takes_nothing() -> None:
    bucket = TokenBucket(rate=1, burst=4, now=0.0)
    assert not bucket.allow(0.0, 5)
    assert bucket.allow(0.0, 4)


def test_an_infinite_rate_is_a_full_bucket_at_any_instant() -> None:
    # inf * 0 s is NaN: the bucket still holds its burst, as min(burst, NaN) gave.
    bucket = TokenBucket(rate=math.inf, burst=10, now=1.0)
    assert bucket.allow(1.0, 10)
    assert bucket.allow(1.0, 10)
    assert not bucket.allow(1.0, 11)
