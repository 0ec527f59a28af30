"""The duplex (voice) runtime of each agent, built from the settings."""

from __future__ import annotations

import logging
import os

from portico.calls.directory import CallDirectory
from portico.calls.service import CallHandover, CallService, CallTelemetry
from portico.config import DEFAULT_AGENT, AgentSettings, Settings
from portico.core.engine import Engine
from portico.errors import ConfigError, PorticoError
from portico.protocols.omnia.voice import VoiceLimits
from portico.runtime.duplex import duplex_runtime_of
from portico.runtime.duplex.base import DuplexCall, DuplexRuntime, DuplexStart
from portico.store.base import Store

log = logging.getLogger("portico.calls")


class UnavailableRuntime:
    """A runtime that cannot run here (its extra is missing): every call is refused
    with the error that names the fix, so the server still starts and serves text."""

    def __init__(self, error: PorticoError) -> None:
        self.error = error

    async def start(self, start: DuplexStart) -> DuplexCall:
        raise self.error


def voice_limits(settings: Settings, calls: CallService, agent: str) -> VoiceLimits | None:
    """The per-call limits of calls to `agent` (`/ws` and `/v1/session` alike); None
    when it takes no calls."""
    if not calls.takes_calls(agent):
        return None
    return VoiceLimits(
        bytes_per_second=settings.max_audio_bytes_per_second,
        burst_bytes=settings.audio_burst_bytes,
    )


def build_duplex_runtime(
    agent: AgentSettings, settings: Settings, *, name: str = DEFAULT_AGENT
) -> DuplexRuntime | None:
    """The agent's duplex runtime; None when it takes no calls."""
    kind = duplex_runtime_of(agent)
    if kind == "scripted":
        if not agent.duplex_script:
            raise ConfigError(f"agent {name!r}: the scripted duplex runtime needs duplex_script")
        from portico.runtime.duplex.scripted import ScriptedDuplexRuntime

        return ScriptedDuplexRuntime.from_file(agent.duplex_script)
    if kind == "openai-realtime":
        from portico.runtime.duplex import openai_realtime

        return openai_realtime.build(agent, os.environ)
    if kind == "embedded":
        from portico.runtime.duplex import embedded

        try:
            return embedded.build(settings)
        except PorticoError as exc:  # VoiceUnavailable: the speech extra is not installed
            log.info("agent %r: voice calls unavailable: %s", name, exc.message)
            return UnavailableRuntime(exc)
    if kind == "grpc":
        # Imported here: grpcio is an optional extra (`portico[grpc]`), which the text
        # runtime of the same agent needs too, so startup has already said so if missing.
        from portico.runtime.duplex import grpc as grpc_duplex

        return grpc_duplex.build(name, agent)
    return None


def build_calls(
    settings: Settings,
    agents: dict[str, AgentSettings],
    store: Store,
    engine: Engine,
    telemetry: CallTelemetry,
    *,
    directory: CallDirectory,
    replica_id: str,
    handover: CallHandover | None,
) -> CallService:
    """The call service over every agent that takes calls."""
    runtimes = {
        name: runtime
        for name, agent in agents.items()
        if (runtime := build_duplex_runtime(agent, settings, name=name)) is not None
    }
    return CallService(
        runtimes=runtimes,
        store=store,
        open_session=engine.open_session,
        grace_window=settings.realtime_grace_window,
        max_sessions=settings.max_audio_sessions,
        # As for connections: without authentication every client is the one principal.
        max_sessions_per_principal=(
            None if settings.auth == "none" else settings.max_audio_sessions_per_principal
        ),
        telemetry=telemetry,
        directory=directory,
        replica_id=replica_id,
        handover=handover,
    )
