"""Reconnect backoff shared by the SDK clients (spec §8): exponential, capped, jittered,
and a clock that gives up. Seeded RNGs and a frozen loop clock: no sleeps."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from aiohttp import web

from portico.client.supervision import ReconnectPolicy, Retries, open_socket

SEED = 20250101


class Lost(Exception):
    pass


def test_without_jitter_the_delay_doubles_from_initial_to_the_maximum() -> None:
    policy = ReconnectPolicy(initial=0.25, maximum=8.0, jitter=0.0)
    rng = random.Random(SEED)
    delays = [policy.delay(attempt, rng) for attempt in range(9)]
    assert delays == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]


def test_the_defaults_are_the_specs() -> None:
    policy = ReconnectPolicy()
    assert (policy.initial, policy.maximum, policy.factor) == (0.25, 8.0, 2.0)
    assert 0 < policy.jitter < 1


@pytest.mark.parametrize("jitter", [0.5, 0.2, 1.0])
def test_each_jittered_delay_lies_within_its_band(jitter: float) -> None:
    """Delay n is base_n * (1 - jitter * r), r from the RNG: in [base*(1-jitter), base]."""
    policy = ReconnectPolicy(initial=0.25, maximum=8.0, jitter=jitter)
    rng, mirror = random.Random(SEED), random.Random(SEED)
    for attempt in range(12):
        base = min(8.0, 0.25 * 2**attempt)
        delay = policy.delay(attempt, rng)
        assert base * (1 - jitter) <= delay <= base
        assert delay == pytest.approx(base * (1 - jitter * mirror.random()))


def test_jitter_spreads_clients_dropped_at_once() -> None:
    policy = ReconnectPolicy()
    firsts = {policy.delay(0, random.Random(seed)) for seed in range(50)}
    assert len(firsts) == 50
    assert min(firsts) >= 0.25 * (1 - policy.jitter)
    assert max(firsts) <= 0.25


def test_the_same_seed_gives_the_same_schedule() -> None:
    policy = ReconnectPolicy()
    one = [policy.delay(n, random.Random(SEED)) for n in range(6)]
    two = [policy.delay(n, random.Random(SEED)) for n in range(6)]
    assert one == two


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_retries_back_off_and_give_up_after_give_up_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = ReconnectPolicy(initial=1.0, maximum=4.0, jitter=0.0, give_up_after=10.0)
    retries = Retries(policy, random.Random(SEED), Lost)
    clock = Clock(100.0)
    with monkeypatch.context() as patch:
        patch.setattr(asyncio.get_running_loop(), "time", clock)
        delays = []
        # The clock starts at the first failure; each retry happens after its delay.
        for _ in range(4):
            delays.append(retries.next_delay())
            clock.now += delays[-1]
        assert delays == [1.0, 2.0, 4.0, 4.0]
        assert clock.now == 111.0
        with pytest.raises(Lost, match="no connection for 11 s; giving up"):
            retries.next_delay()
        # Exactly at the limit it gives up too; just before, it waits once more.
        retries = Retries(policy, random.Random(SEED), Lost)
        clock.now = 200.0
        retries.next_delay()
        clock.now = 209.99
        assert retries.next_delay() == 2.0
        clock.now = 210.0
        with pytest.raises(Lost):
            retries.next_delay()


async def test_a_connection_that_worked_restarts_the_backoff_and_the_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = ReconnectPolicy(initial=1.0, maximum=4.0, jitter=0.0, give_up_after=10.0)
    retries = Retries(policy, random.Random(SEED), Lost)
    clock = Clock(0.0)
    with monkeypatch.context() as patch:
        patch.setattr(asyncio.get_running_loop(), "time", clock)
        assert [retries.next_delay() for _ in range(3)] == [1.0, 2.0, 4.0]
        clock.now = 9.0
        retries.connected()
        clock.now = 50.0  # long after the first failure, but the link worked in between
        assert retries.next_delay() == 1.0
        clock.now = 59.0
        assert retries.next_delay() == 2.0


async def test_give_up_after_none_never_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = ReconnectPolicy(jitter=0.0, give_up_after=None)
    retries = Retries(policy, random.Random(SEED), Lost)
    clock = Clock(0.0)
    with monkeypatch.context() as patch:
        patch.setattr(asyncio.get_running_loop(), "time", clock)
        for _ in range(20):
            clock.now += 1e6
            assert retries.next_delay() <= policy.maximum


async def test_open_socket_accepts_a_server_frame_of_exactly_max_frame_bytes() -> None:
    """A real server on 127.0.0.1 sends N bytes, then N + 1: the first arrives, the
    second closes the socket with 1009."""
    limit = 4096

    async def serve(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_bytes(b"x" * limit)
        await ws.send_bytes(b"x" * (limit + 1))
        await ws.receive()  # until the client closes
        return ws

    app = web.Application()
    app.router.add_get("/", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as http:
            deadline = asyncio.get_running_loop().time() + 10
            ws = await open_socket(
                http, f"ws://127.0.0.1:{port}/", deadline, max_frame_bytes=limit, close_timeout=1
            )
            first = await ws.receive(timeout=10)
            assert (first.type, len(first.data)) == (aiohttp.WSMsgType.BINARY, limit)
            second = await ws.receive(timeout=10)
            assert second.type is aiohttp.WSMsgType.ERROR
            assert ws.close_code == 1009
    finally:
        await runner.cleanup()
