"""A plugin that cannot be loaded stops `portico serve` (and `portico agent serve`) at
start with one line naming it: exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.agent_process import REPO, agent_env

CASES = [
    ("support.broken_plugin:handler", "cannot import support.broken_plugin: ImportError"),
    ("support.agents:missing", "support.agents has no attribute missing"),
    ("support.agents:not_a_generator", "expected an async generator function"),
    ("support.agents:two_arguments", "the handler must take exactly one argument"),
]


def portico(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`portico ARGS`, expected to refuse to start (a deadline in case it does not)."""
    return subprocess.run(
        [sys.executable, "-m", "portico", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**agent_env(), **(env or {})},
        cwd=REPO,
        check=False,
    )


def assert_refused(result: subprocess.CompletedProcess[str], words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("portico: plugin ")
    assert words in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("spec", "words"), CASES)
def test_serve_refuses_a_default_agent_plugin_it_cannot_load(
    tmp_path: Path, spec: str, words: str
) -> None:
    result = portico(
        "serve",
        "--port",
        "0",
        "--data-dir",
        str(tmp_path),
        env={"PORTICO_RUNTIME": "python", "PORTICO_PLUGIN": spec},
    )
    assert_refused(result, words)
    assert spec in result.stderr


def test_serve_refuses_a_named_agents_plugin(tmp_path: Path) -> None:
    config = tmp_path / "portico.yaml"
    config.write_text(
        yaml.safe_dump(
            {"agents": {"mine": {"runtime": "python", "plugin": "support.agents:sync_generator"}}}
        )
    )
    result = portico("serve", "--port", "0", "--data-dir", str(tmp_path), "--config", str(config))
    assert_refused(result, "a plain generator function")


def test_serve_refuses_the_python_runtime_without_a_plugin(tmp_path: Path) -> None:
    result = portico(
        "serve", "--port", "0", "--data-dir", str(tmp_path), env={"PORTICO_RUNTIME": "python"}
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "portico: agent 'default': the python runtime needs plugin: module:attr (PORTICO_PLUGIN)"
    )


@pytest.mark.parametrize(("spec", "words"), CASES)
def test_agent_serve_refuses_a_handler_it_cannot_load(spec: str, words: str) -> None:
    assert_refused(portico("agent", "serve", spec, "--port", "0"), words)


def test_agent_serve_refuses_an_invalid_limit() -> None:
    result = portico("agent", "serve", "support.agents:handler", "--max-queued-turns", "0")
    assert result.returncode == 2
    assert result.stderr.startswith("portico: invalid agent option: Expected `int` >= 1")
    assert "max_queued_turns" in result.stderr


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("support.voice_agents:not_a_coroutine", "an async generator function"),
        ("support.voice_agents:nothing", "has no attribute nothing"),
        ("support.agents:handler", "expected a coroutine function"),
    ],
)
def test_agent_serve_refuses_a_voice_handler_it_cannot_load(spec: str, words: str) -> None:
    result = portico("agent", "serve", "support.agents:handler", "--voice", spec, "--port", "0")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("portico: ")
    assert spec in line
    assert words in line
