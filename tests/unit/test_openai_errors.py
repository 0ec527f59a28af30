"""The Omnia error table, row by row, against the fake OpenAI server: which failures are
retried (and how often), the code each ends the turn with, and messages that name the
model and provider type but never the provider's response."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from portico.runtime.base import Chunk, Failure, RuntimeEvent
from portico.runtime.openai import OpenAIRuntime
from portico.runtime.provider import retry_delay
from support.fake_openai import (
    ENV,
    FakeOpenAI,
    Pause,
    Reply,
    agent_settings,
    chunk,
    drive,
    failure,
    text,
    turn_input,
)

RETRIES = 2  # agent_settings' default: three attempts in all
LABEL = "model fake-model (fake)"


async def run(base_url: str, **settings: Any) -> list[RuntimeEvent]:
    runtime = OpenAIRuntime(agent_settings(base_url, **settings), env=ENV)
    try:
        events, _ = await drive(runtime, turn_input())
    finally:
        await runtime.close()
    return events


def only_failure(events: list[RuntimeEvent]) -> Failure:
    """The turn's one terminal event, a failure, last; it never carries the response body."""
    failures = [e for e in events if isinstance(e, Failure)]
    assert failures == [events[-1]], events
    assert "SECRET" not in failures[0].message
    assert failures[0].message.startswith(LABEL + ": ")
    return failures[0]


# -- HTTP statuses --------------------------------------------------------------------------


async def test_429_is_retried_then_ends_rate_limited(fake: FakeOpenAI) -> None:
    fake.push(*[failure(429)] * (RETRIES + 1))
    ended = only_failure(await run(fake.base_url))
    assert (ended.code, ended.message) == (
        "PROVIDER_RATE_LIMITED",
        f"{LABEL}: rate limited (HTTP 429) after 3 attempts",
    )
    assert len(fake.requests) == RETRIES + 1


async def test_a_429_that_clears_within_the_retries_is_invisible(fake: FakeOpenAI) -> None:
    fake.push(failure(429, headers={"Retry-After": "0.01"}), failure(429), text("fine"))
    events = await run(fake.base_url)
    assert [e for e in events if isinstance(e, Chunk)] == [Chunk("fine")]
    assert len(fake.requests) == 3


async def test_the_number_of_retries_is_a_setting(fake: FakeOpenAI) -> None:
    fake.push(failure(503))
    ended = only_failure(await run(fake.base_url, retries=0))
    assert (ended.code, ended.message) == (
        "PROVIDER_UNAVAILABLE",
        f"{LABEL}: unavailable (HTTP 503)",
    )
    assert len(fake.requests) == 1


@pytest.mark.parametrize("status", [502, 503, 504])
async def test_502_503_504_are_retried_then_end_unavailable(fake: FakeOpenAI, status: int) -> None:
    fake.push(*[failure(status)] * (RETRIES + 1))
    ended = only_failure(await run(fake.base_url))
    assert (ended.code, ended.message) == (
        "PROVIDER_UNAVAILABLE",
        f"{LABEL}: unavailable (HTTP {status}) after 3 attempts",
    )
    assert len(fake.requests) == RETRIES + 1


async def test_500_is_not_retried(fake: FakeOpenAI) -> None:
    fake.push(failure(500), text("never asked for"))
    ended = only_failure(await run(fake.base_url))
    assert (ended.code, ended.message) == ("PROVIDER_UNAVAILABLE", f"{LABEL}: failed (HTTP 500)")
    assert len(fake.requests) == 1


@pytest.mark.parametrize("status", [401, 403])
async def test_401_403_end_auth_failed_without_retry(fake: FakeOpenAI, status: int) -> None:
    fake.push(failure(status))
    ended = only_failure(await run(fake.base_url))
    assert (ended.code, ended.message) == (
        "PROVIDER_AUTH_FAILED",
        f"{LABEL}: the credentials were refused (HTTP {status})",
    )
    assert len(fake.requests) == 1


async def test_another_4xx_is_not_a_spec_code(fake: FakeOpenAI) -> None:
    """The engine turns it into INTERNAL_ERROR for the client; the log has the status."""
    fake.push(failure(400))
    ended = only_failure(await run(fake.base_url))
    assert (ended.code, ended.message) == (
        "PROVIDER_REQUEST_REFUSED",
        f"{LABEL}: refused the request (HTTP 400)",
    )
    assert len(fake.requests) == 1


async def test_an_unreachable_provider_is_retried_then_unavailable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    ended = only_failure(await run(f"http://127.0.0.1:{port}/v1"))
    assert (ended.code, ended.message) == (
        "PROVIDER_UNAVAILABLE",
        f"{LABEL}: could not be reached after 3 attempts",
    )


# -- timeouts and broken streams ------------------------------------------------------------


async def test_no_response_within_the_first_token_timeout_is_provider_timeout(
    fake: FakeOpenAI,
) -> None:
    fake.push(Reply(delay=3.0, events=(chunk({"content": "late"}),)))
    ended = only_failure(await run(fake.base_url, first_token_timeout=0.3))
    assert (ended.code, ended.message) == (
        "PROVIDER_TIMEOUT",
        f"{LABEL}: sent nothing within 0.3 s",
    )
    assert len(fake.requests) == 1  # not retried


async def test_headers_without_an_event_within_the_first_token_timeout_is_provider_timeout(
    fake: FakeOpenAI,
) -> None:
    fake.push(Reply(events=(b": keep-alive comments are not tokens\n\n", Pause(3.0))))
    ended = only_failure(await run(fake.base_url, first_token_timeout=0.3))
    assert ended.code == "PROVIDER_TIMEOUT"


async def test_a_stream_silent_past_the_idle_timeout_is_stalled_and_keeps_its_text(
    fake: FakeOpenAI,
) -> None:
    fake.push(Reply(events=(chunk({"content": "partial "}), Pause(3.0), chunk({}, "stop"))))
    events = await run(fake.base_url, stream_idle_timeout=0.3)
    assert events[0] == Chunk("partial ")
    ended = only_failure(events)
    assert (ended.code, ended.message) == (
        "PROVIDER_STALLED",
        f"{LABEL}: the stream stalled (nothing for 0.3 s)",
    )
    assert len(fake.requests) == 1  # text has streamed: never retried


async def test_a_connection_dropped_mid_stream_is_stalled(fake: FakeOpenAI) -> None:
    fake.push(Reply(events=(chunk({"content": "partial"}),), drop=True))
    events = await run(fake.base_url)
    assert events[0] == Chunk("partial")
    ended = only_failure(events)
    assert (ended.code, ended.message) == ("PROVIDER_STALLED", f"{LABEL}: the stream broke off")


async def test_a_stream_ending_before_the_reply_finished_is_stalled(fake: FakeOpenAI) -> None:
    fake.push(Reply(events=(chunk({"content": "partial"}),), done=False))
    ended = only_failure(await run(fake.base_url))
    assert (ended.code, ended.message) == (
        "PROVIDER_STALLED",
        f"{LABEL}: the stream ended before the reply did",
    )


async def test_a_stream_closed_before_its_first_event_is_retried(fake: FakeOpenAI) -> None:
    fake.push(Reply(done=False), Reply(events=(), done=False, drop=True), text("third time"))
    events = await run(fake.base_url)
    assert events[0] == Chunk("third time")
    assert len(fake.requests) == 3


async def test_a_request_outlasting_the_request_timeout_is_provider_timeout(
    fake: FakeOpenAI,
) -> None:
    trickle = [event for _ in range(30) for event in (chunk({"content": "."}), Pause(0.05))]
    fake.push(Reply(events=tuple(trickle)))
    ended = only_failure(await run(fake.base_url, request_timeout=0.5))
    assert (ended.code, ended.message) == (
        "PROVIDER_TIMEOUT",
        f"{LABEL}: did not finish within 0.5 s",
    )


async def test_a_stream_ending_after_the_finish_without_done_is_complete(fake: FakeOpenAI) -> None:
    fake.push(Reply(events=(chunk({"content": "all"}, "stop"),), done=False))
    events = await run(fake.base_url)
    assert not [e for e in events if isinstance(e, Failure)]


# -- malformed responses --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "what"),
    [
        (Reply(content_type="application/json"), "answered with JSON, not an event stream"),
        (Reply(events=("{not json",)), "sent a malformed event"),
        (Reply(events=('{"error": {"message": "SECRET"}}',)), "reported an error in the stream"),
        (Reply(events=(b"data: " + b"x" * 2048,)), "an event is larger than 1024 bytes"),
    ],
)
async def test_a_malformed_response_is_unavailable(
    fake: FakeOpenAI, reply: Reply, what: str
) -> None:
    fake.push(reply)
    ended = only_failure(await run(fake.base_url, max_stream_event_bytes=1024))
    assert (ended.code, ended.message) == ("PROVIDER_UNAVAILABLE", f"{LABEL}: {what}")


# -- backoff ----------------------------------------------------------------------------------


def test_the_retry_delay_doubles_honours_retry_after_and_is_capped() -> None:
    def no_jitter() -> float:
        return 1.0

    assert [retry_delay(n, None, 0.5, 8.0, no_jitter) for n in (1, 2, 3, 6)] == [0.5, 1, 2, 8]
    assert retry_delay(1, 3.0, 0.5, 8.0, no_jitter) == 3.0
    assert retry_delay(1, 60.0, 0.5, 8.0, no_jitter) == 8.0
    assert 0.25 <= retry_delay(1, None, 0.5, 8.0) <= 0.5
