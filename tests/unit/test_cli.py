"""The `portico` command in process: flags reach the settings, refusals exit 2."""

from __future__ import annotations

import os
from typing import Any

import pytest
import yaml

from portico import cli
from portico.config import Settings

REFUSAL = (
    "portico: refusing to serve on 0.0.0.0 without authentication; "
    "set auth=apikey or pass --allow-unauthenticated\n"
)


@pytest.fixture(autouse=True)
def no_portico_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the flags under test decide: the developer's PORTICO_* variables do not."""
    for name in [name for name in os.environ if name.startswith("PORTICO_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """`serve` replaced by a recorder: what the CLI would have served with."""
    calls: list[Settings] = []

    async def serve(settings: Settings, **_: Any) -> None:
        calls.append(settings)

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    return calls


def shown(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    assert cli.main(["config", "show", *flags]) == 0
    settings: dict[str, Any] = yaml.safe_load(capsys.readouterr().out)
    return settings


def test_config_show_reflects_allow_unauthenticated(capsys: pytest.CaptureFixture[str]) -> None:
    with_flag = shown(capsys, "--host", "0.0.0.0", "--allow-unauthenticated")
    assert (with_flag["host"], with_flag["allow_unauthenticated"]) == ("0.0.0.0", True)
    without = shown(capsys, "--host", "0.0.0.0")
    assert (without["host"], without["allow_unauthenticated"]) == ("0.0.0.0", False)


def test_serve_on_an_open_bind_without_auth_is_refused(
    capsys: pytest.CaptureFixture[str], served: list[Settings]
) -> None:
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert capsys.readouterr().err == REFUSAL
    assert served == []


def test_allow_unauthenticated_flag_lets_serve_start_on_an_open_bind(
    capsys: pytest.CaptureFixture[str], served: list[Settings]
) -> None:
    assert cli.main(["serve", "--host", "0.0.0.0", "--port", "0", "--allow-unauthenticated"]) == 0
    assert capsys.readouterr().err == ""
    (settings,) = served
    assert (settings.host, settings.auth, settings.allow_unauthenticated) == (
        "0.0.0.0",
        "none",
        True,
    )


def test_the_cli_turns_off_grpcs_fork_handlers_unless_the_operator_chose(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # grpc/grpc#43055: with them on, a child spawned while a channel is active can die
    # before its exec (an MCP server, the archive's writer process).
    monkeypatch.delenv("GRPC_ENABLE_FORK_SUPPORT", raising=False)
    shown(capsys)
    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "false"
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "true")
    shown(capsys)
    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "true"
