"""What an operator reads when `portico` cannot do what it was asked: real subprocesses,
each failure a user can cause one line on stderr and a non-zero status, no traceback.

Permission failures need an unprivileged process: as root the command runs under
`setpriv` without the capabilities that bypass them (binding ports below 1024,
overriding file permissions).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.server import ServerProcess, run_cli

DROPPED = "-net_bind_service,-dac_override,-dac_read_search"


def refusal(result: subprocess.CompletedProcess[str], status: int = 2) -> str:
    """The one line a refused command wrote, after checking it wrote nothing else."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == status, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def unprivileged() -> tuple[str, ...]:
    """The prefix that runs a command without root's permission bypasses."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv to drop its capabilities")
    return (setpriv, f"--bounding-set={DROPPED}")


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 this test holds, listening."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


# -- portico serve: the address ---------------------------------------------------------------


def test_a_port_in_use_is_one_line_naming_the_address(tmp_path: Path, taken_port: int) -> None:
    result = run_cli("serve", "--port", str(taken_port), "--data-dir", str(tmp_path / "data"))
    assert refusal(result) == (
        f"portico: cannot listen on 127.0.0.1:{taken_port}: the address is already in use "
        "(another server has the port); stop it or pick another port with --port"
    )
    # Refused before the archive was opened: nothing was created.
    assert not (tmp_path / "data").exists()


def test_a_port_in_use_through_the_environment(tmp_path: Path, taken_port: int) -> None:
    env = {"PORTICO_PORT": str(taken_port), "PORTICO_DATA_DIR": str(tmp_path)}
    assert f"127.0.0.1:{taken_port}: the address is already in use" in refusal(
        run_cli("serve", env=env)
    )


def test_a_host_that_does_not_resolve(tmp_path: Path) -> None:
    result = run_cli(
        "serve",
        *("--host", "nonexistent.invalid", "--port", "0", "--allow-unauthenticated"),
        *("--data-dir", str(tmp_path)),
    )
    assert refusal(result) == (
        "portico: cannot listen on nonexistent.invalid:0: "
        "the host name 'nonexistent.invalid' does not resolve; check --host"
    )


def test_a_host_that_is_not_this_machines(tmp_path: Path) -> None:
    # 192.0.2.0/24 is TEST-NET-1: never assigned, so no interface has it.
    result = run_cli(
        "serve",
        *("--host", "192.0.2.1", "--port", "0", "--allow-unauthenticated"),
        *("--data-dir", str(tmp_path)),
    )
    assert refusal(result) == (
        "portico: cannot listen on 192.0.2.1:0: "
        "192.0.2.1 is not an address of this machine; check --host"
    )


def test_a_privileged_port_without_the_privilege(tmp_path: Path) -> None:
    prefix = unprivileged()
    if not prefix and int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text()) <= 1:
        pytest.skip("every port is unprivileged on this machine")
    result = run_cli("serve", "--port", "1", "--data-dir", str(tmp_path), prefix=prefix)
    assert refusal(result) == (
        "portico: cannot listen on 127.0.0.1:1: permission denied "
        "(ports below 1024 need privileges); pick another port with --port"
    )


# -- portico serve: the data dir -----------------------------------------------------------------


def test_a_data_dir_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_text("not a folder")
    result = run_cli("serve", "--port", "0", "--data-dir", str(path))
    assert refusal(result) == (
        f"portico: cannot use the data dir {path}: it is not a directory; "
        "pick another with --data-dir"
    )
    nested = path / "inner"
    assert refusal(run_cli("serve", "--port", "0", "--data-dir", str(nested))) == (
        f"portico: cannot use the data dir {nested}: not a directory; pick another with --data-dir"
    )


def test_a_data_dir_that_cannot_be_written(tmp_path: Path) -> None:
    prefix = unprivileged()
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    for path in (locked, locked / "inner"):
        result = run_cli("serve", "--port", "0", "--data-dir", str(path), prefix=prefix)
        assert refusal(result) == (
            f"portico: cannot use the data dir {path}: permission denied; "
            "pick another with --data-dir"
        )


def test_media_storage_blocked_by_a_file(tmp_path: Path) -> None:
    (tmp_path / "media").write_text("in the way")
    result = run_cli("serve", "--port", "0", "--data-dir", str(tmp_path))
    assert refusal(result, status=1) == (
        f"portico: cannot open media storage at {tmp_path / 'media'}: not a directory"
    )


# -- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [("serve",), ("config", "show")])
def test_config_file_errors_are_one_line_naming_file_and_key(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    config = tmp_path / "portico.yaml"
    cases = {
        "prot: 80\n": f"config file {config}: unknown setting 'prot' (did you mean 'port'?)",
        "runtime: gpt\n": (
            f"config file {config}, key runtime: invalid value 'gpt'; "
            "valid values: demo, echo, scripted, openai, openai-realtime, grpc, python"
        ),
        "port: [80\n": (
            f"config file {config}: invalid YAML at line 2, column 1: "
            "expected ',' or ']', but got '<stream end>'"
        ),
    }
    for text, expected in cases.items():
        config.write_text(text)
        result = run_cli(*command, "--config", str(config), "--data-dir", str(tmp_path))
        assert refusal(result) == f"portico: {expected}"


def test_a_script_with_broken_yaml(tmp_path: Path) -> None:
    script = tmp_path / "script.yaml"
    script.write_text("scenarios: [\n")
    result = run_cli(
        "serve", "--runtime", "scripted", "--script", str(script), "--data-dir", str(tmp_path)
    )
    assert refusal(result) == (
        f"portico: script {script}: invalid YAML at line 2, column 1: "
        "expected the node content, but found '<stream end>'"
    )


def test_a_flag_error_names_the_flag_and_the_choices(tmp_path: Path) -> None:
    result = run_cli("serve", "--log-level", "chatty", "--data-dir", str(tmp_path))
    assert refusal(result) == (
        "portico: --log-level: invalid value 'chatty'; valid values: DEBUG, INFO, WARNING, ERROR"
    )


def test_a_missing_or_unreadable_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert refusal(run_cli("config", "show", "--config", str(missing))) == (
        f"portico: cannot read config file {missing}: no such file or directory"
    )
    secret = tmp_path / "secret.yaml"
    secret.write_text("port: 1\n")
    secret.chmod(0)
    result = run_cli("config", "show", "--config", str(secret), prefix=unprivileged())
    assert refusal(result) == f"portico: cannot read config file {secret}: permission denied"


def test_an_environment_error_names_the_variable_and_the_choices(tmp_path: Path) -> None:
    result = run_cli("serve", "--data-dir", str(tmp_path), env={"PORTICO_STORE": "mongo"})
    assert refusal(result) == (
        "portico: PORTICO_STORE: invalid value 'mongo'; valid values: sqlite, memory, postgres"
    )


def test_unknown_portico_variables_are_warned_about_at_start(tmp_path: Path) -> None:
    env = {"PORTICO_PROT": "9999", "PORTICO_RUNTIME": "echo"}
    server = ServerProcess(tmp_path, env=env).start()
    try:
        log = server.log_text()
    finally:
        server.stop()
    assert (
        "portico: warning: PORTICO_PROT is not a Portico setting and is ignored "
        "(did you mean PORTICO_PORT?)\n"
    ) in log
    result = run_cli("config", "show", env=env)
    assert result.returncode == 0
    assert result.stderr.startswith("portico: warning: PORTICO_PROT is not a Portico setting")


# -- other commands -----------------------------------------------------------------------------


def test_chat_with_a_url_that_is_not_a_websocket() -> None:
    assert refusal(run_cli("chat", "--url", "127.0.0.1:8080")) == (
        "portico: --url must start with ws:// or wss://, not '127.0.0.1:8080'"
    )


def test_version_comes_from_the_package_metadata() -> None:
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"portico {importlib.metadata.version('portico')}\n"
