"""Voice handlers for the SDK tests: the call's `system_instruction` picks what they do."""

from __future__ import annotations

import asyncio
from pathlib import Path

from portico.agent import AgentError, AudioFormat, VoiceCall


async def voice(call: VoiceCall) -> None:
    scenario = call.system_instruction
    if scenario == "echo":
        # Every frame straight back, numbered by the call; the caller's end ends it.
        async for frame in call.audio():
            await call.speak(frame.data)
        await call.say("bye")
        await call.turn_done()
    elif scenario == "offer":
        await call.accept(AudioFormat(codec="pcm16", sample_rate=24000, channels=1))
        await call.transcript("you spoke")
        await call.say("hi")
        await call.interrupted()
        await call.turn_done("hi there")
    elif scenario == "agent_error":
        await call.say("one moment")
        raise AgentError("PROVIDER_UNAVAILABLE", "the voice model is down")
    elif scenario == "crash":
        raise ValueError("a bug in the handler")
    elif scenario == "hang_up":
        return
    elif scenario == "hold":
        # Stays on the line until cancelled; leaves a mark when it is.
        try:
            await call.accept()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            # A few bytes, once, as the task ends: not worth a thread.
            Path(call.session_id).write_text("cancelled")  # noqa: ASYNC240
            raise
    elif scenario == "twice":
        await call.accept()
        try:
            await call.accept()
        except RuntimeError as exc:
            await call.say(str(exc))
        await call.turn_done()


async def not_a_coroutine(call: VoiceCall):  # type: ignore[no-untyped-def]
    yield None
