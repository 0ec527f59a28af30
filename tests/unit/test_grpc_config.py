"""Settings of the grpc runtime: the default agent from `PORTICO_GRPC_*`, agents in the
file, and the start-up refusals that name the setting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from portico.config import Settings, load_settings
from portico.errors import ConfigError
from portico.runtime.grpc.runtime import GrpcRuntime, classify
from portico.server.services import build_runtime


def test_the_default_agent_needs_only_the_target(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("roots")
    env = {
        "PORTICO_RUNTIME": "grpc",
        "PORTICO_GRPC_TARGET": "agent.internal:50051",
        "PORTICO_GRPC_TLS": "true",
        "PORTICO_GRPC_CA_FILE": str(ca),
    }
    settings = load_settings(env=env)
    settings.check_startable(env={})
    default = settings.agent("default")
    assert default is not None
    assert (default.runtime, default.grpc_target, default.grpc_tls, default.grpc_ca_file) == (
        "grpc",
        "agent.internal:50051",
        True,
        str(ca),
    )
    assert not default.runtime_owns_context
    assert isinstance(build_runtime(default, settings), GrpcRuntime)


def test_tls_is_off_by_default() -> None:
    settings = load_settings(env={"PORTICO_RUNTIME": "grpc", "PORTICO_GRPC_TARGET": "h:1"})
    default = settings.agent("default")
    assert default is not None
    assert (default.grpc_tls, default.grpc_ca_file, default.grpc_token_env) == (False, None, None)


def agent(**fields: Any) -> Settings:
    return load_settings(env={}, flags={"agents": {"bot": {"runtime": "grpc", **fields}}})


@pytest.mark.parametrize(
    ("fields", "env", "message"),
    [
        ({}, {}, "needs grpc_target as host:port"),
        ({"grpc_target": "no-port"}, {}, "needs grpc_target as host:port"),
        ({"grpc_target": "h:1", "grpc_ca_file": "/nonexistent/ca.pem"}, {}, "grpc_ca_file"),
        ({"grpc_target": "h:1", "grpc_token_env": "TOKEN"}, {}, "TOKEN, which is not set"),
    ],
)
def test_an_agent_the_runtime_cannot_dial_is_refused(
    fields: dict[str, Any], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        agent(**fields).check_startable(env=env)
    assert "agent 'bot'" in str(refused.value)


def test_the_default_agent_refusal_names_the_environment_variable() -> None:
    with pytest.raises(ConfigError, match="PORTICO_GRPC_TARGET"):
        load_settings(env={"PORTICO_RUNTIME": "grpc"}).check_startable(env={})


def test_a_token_from_the_environment_is_accepted() -> None:
    agent(grpc_target="h:1", grpc_token_env="TOKEN").check_startable(env={"TOKEN": "t"})


@pytest.mark.parametrize(
    ("code", "details", "cause"),
    [
        (
            "UNAVAILABLE",
            "failed to connect; last error: ipv4:127.0.0.1:9: Connection refused",
            "connection refused",
        ),
        ("UNAVAILABLE", "DNS resolution failed for nowhere.invalid:1", "name resolution failed"),
        ("UNAVAILABLE", "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED", "TLS handshake failed"),
        ("UNAVAILABLE", "Connection reset by peer", "connection reset"),
        ("UNAUTHENTICATED", "bad token", "unauthenticated"),
        ("INTERNAL", "something else", "internal"),
    ],
)
def test_connection_failures_are_classified_for_the_log(
    code: str, details: str, cause: str
) -> None:
    error = grpc.aio.AioRpcError(
        getattr(grpc.StatusCode, code), grpc.aio.Metadata(), grpc.aio.Metadata(), details
    )
    assert classify(error) == cause
