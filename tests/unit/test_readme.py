"""The README's quick-start commands are the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.+?)\n```", quick_start)


def test_readme_starts_with_the_serve_and_test_commands() -> None:
    serve, test = readme_commands()[:2]
    assert serve.endswith("portico serve")
    assert "pytest" in test


def test_ci_runs_the_readme_test_command() -> None:
    test_command = readme_commands()[1]
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert test_command in ci_lines


def test_the_test_command_installs_what_the_browser_tests_need() -> None:
    """Without the `e2e` extra the browser tests would be skipped, not run."""
    test_command = readme_commands()[1]
    assert "'.[dev,e2e]'" in test_command
    assert "apt-get install" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
