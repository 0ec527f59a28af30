"""Which agents take calls, and with which duplex runtime, from the settings."""

from __future__ import annotations

import pytest

from portico.config import AgentSettings, Settings
from portico.errors import ConfigError
from portico.runtime.duplex.embedded import EmbeddedVoiceRuntime
from portico.runtime.duplex.grpc import GrpcDuplexRuntime
from portico.runtime.duplex.scripted import ScriptedDuplexRuntime
from portico.server.duplex import UnavailableRuntime, build_duplex_runtime
from support.server import FIXTURES


def test_a_scripted_duplex_runtime_needs_its_script_to_start() -> None:
    settings = Settings(agents={"voice": AgentSettings(runtime="echo", duplex_runtime="scripted")})
    with pytest.raises(ConfigError, match="duplex_script"):
        settings.check_startable(env={})


def test_each_agent_gets_the_duplex_runtime_its_settings_name() -> None:
    settings = Settings()
    scripted = AgentSettings(duplex_runtime="scripted", duplex_script=str(FIXTURES / "voice.yaml"))
    assert isinstance(build_duplex_runtime(scripted, settings), ScriptedDuplexRuntime)
    assert build_duplex_runtime(AgentSettings(runtime="echo"), settings) is None
    grpc_agent = AgentSettings(runtime="grpc", grpc_target="127.0.0.1:50051")
    assert isinstance(build_duplex_runtime(grpc_agent, settings), GrpcDuplexRuntime)


def test_a_grpc_duplex_runtime_beside_another_text_runtime_needs_its_target_to_start() -> None:
    agent = AgentSettings(runtime="echo", duplex_runtime="grpc")
    with pytest.raises(ConfigError, match="grpc_target"):
        Settings(agents={"voice": agent}).check_startable(env={})


def test_the_demo_agent_takes_calls_with_the_embedded_voice_agent_or_says_why_not() -> None:
    runtime = build_duplex_runtime(AgentSettings(runtime="demo"), Settings())
    if isinstance(runtime, UnavailableRuntime):
        assert runtime.error.code == "DUPLEX_ERROR"  # a call gets it, naming the extra
    else:
        assert isinstance(runtime, EmbeddedVoiceRuntime)
