"""CPU per relayed voice frame through Portico's own code, in process (no sockets).

    python bench/voice_path.py [--calls 100] [--frames 100000] [--repeats 5] [--profile]

What a `/ws?binary=true` voice call does with each caller frame, minus aiohttp: the
connection core decodes the OMNI frame (`receive_binary`), the call takes it
(`LiveCall.send`), the scripted runtime in `echo` mode turns it into agent audio, the
call's pump hands that to the connection (`send_duplex_event`, the OMNI encode) and
the socket's batch write takes the queued frames (`_write_batch`'s framing, without
the transport); the socket's frame counts (`portico_frames_in`/`_out`) are bumped as
sockets.py does. `--calls` calls take one frame each per loop round, as concurrent
callers do. Prints µs of process CPU per relayed frame (in and its echo out) for each
repeat, then the median; `--profile` prints a cProfile of one repeat instead.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from portico.calls.service import CallService, LiveCall
from portico.domain.model import Session
from portico.protocols.omnia.binary import media_frames
from portico.protocols.omnia.connection import ConnectionLimits, OmniaConnection
from portico.protocols.omnia.voice import CallAudio, CallRequested, VoiceLimits
from portico.protocols.outbox import BinaryData
from portico.runtime.duplex.scripted import ScriptedDuplexRuntime, VoiceScript
from portico.server.metrics import Metrics
from portico.server.sockets import text_frame_header

FRAME = bytes(640)  # 20 ms of 16 kHz mono PCM16


class Caller:
    def __init__(self, service: CallService, index: int, now: float, metrics: Metrics) -> None:
        self.service = service
        self.frames = metrics.frames.of("omnia")  # the socket counts each frame (sockets.py)
        self.core = OmniaConnection(
            session_id=f"s{index}",
            binary=True,
            limits=ConnectionLimits(max_payload_size=1 << 20, ping_interval=30, pong_timeout=10),
            now=now,
            wall=time.time(),
            voice=VoiceLimits(),
        )
        self.call: LiveCall | None = None
        self.first = media_frames(
            media_id="c",
            mime_type="audio/pcm",
            payload=FRAME,
            session_id=f"s{index}",
            sample_rate=16000,
            channels=1,
            codec="pcm16",
            is_last_of_stream=False,
        )[0]
        self.next = media_frames(
            media_id="c",
            mime_type="audio/pcm",
            payload=FRAME,
            session_id=f"s{index}",
            is_last_of_stream=False,
        )[0]
        self.written = 0

    def listener(self, event: Any) -> None:
        if event is not None:
            self.core.send_duplex_event(event, time.monotonic())

    async def frame(self, now: float) -> None:
        data = self.next if self.call is not None else self.first
        self.frames.inbound += 1
        for event in self.core.receive_binary(data, now):
            if isinstance(event, CallRequested):
                self.call = await self.service.start(
                    principal="p",
                    binding="",
                    agent="a",
                    session_id=self.core.session_id,
                    format=event.format,
                    listener=self.listener,
                )
                await self.call.send(event.audio)
            elif isinstance(event, CallAudio) and self.call is not None:
                await self.call.send(event.audio)

    def write(self) -> None:
        """What `_write_batch` does with the queued frames, minus the transport."""
        frames: list[bytes] = []
        while (frame := self.core.next_frame()) is not None:
            frames.append(text_frame_header(len(frame), binary=isinstance(frame, BinaryData)))
            frames.append(frame)
        if frames:
            b"".join(frames)
            self.written += len(frames) // 2
            self.frames.outbound += len(frames) // 2


async def open_session(**kwargs: Any) -> Session:
    return Session(
        id=kwargs["session_id"],
        owner="p",
        agent="a",
        created_at=0,
        updated_at=0,
        last_activity_at=0,
    )


async def run(calls: int, frames: int) -> tuple[float, int]:
    metrics = Metrics()
    service = CallService(
        runtimes={"a": ScriptedDuplexRuntime(VoiceScript(echo=True))},
        store=None,  # type: ignore[arg-type]  # an echo call archives nothing
        open_session=open_session,
        grace_window=30,
        max_sessions=100_000,
        max_sessions_per_principal=None,
        telemetry=metrics,
    )
    callers = [Caller(service, i, time.monotonic(), metrics) for i in range(calls)]
    for caller in callers:  # started (and its session_config out) before the window
        await caller.frame(time.monotonic())
    for _ in range(5):
        await asyncio.sleep(0)
    for caller in callers:
        caller.write()
        caller.written = 0
    rounds = max(1, frames // calls)
    started = time.process_time()
    for _ in range(rounds):
        now = time.monotonic()
        for caller in callers:
            await caller.frame(now)
        await asyncio.sleep(0)  # the calls' pumps run
        await asyncio.sleep(0)
        for caller in callers:
            caller.write()
    spent = time.process_time() - started
    echoed = sum(c.written for c in callers)
    for caller in callers:
        assert caller.call is not None
        await caller.call.hangup()
        await caller.call.wait()
    return spent, echoed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--asyncio", action="store_true", help="asyncio's loop, not uvloop")
    args = parser.parse_args()
    # The server's loop (portico serve runs on uvloop).
    runner: Callable[[Coroutine[Any, Any, tuple[float, int]]], tuple[float, int]] = (
        asyncio.run if args.asyncio else uvloop.run
    )
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        runner(run(args.calls, args.frames))
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        return
    figures = []
    for _ in range(args.repeats):
        spent, echoed = runner(run(args.calls, args.frames))
        sent = max(1, args.frames // args.calls) * args.calls
        assert echoed == sent, f"{echoed} echoed of {sent}"
        figures.append(spent / sent * 1e6)
        print(f"{figures[-1]:.2f} µs per relayed frame ({sent} frames)")
    print(
        f"median {statistics.median(figures):.2f} µs, spread {min(figures):.2f}-{max(figures):.2f}"
    )


if __name__ == "__main__":
    main()
