"""Process-level behaviour: start-up, probes, logs, shutdown and restart."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import aiohttp
import pytest

from portico.domain.states import TurnState
from support.archive import open_archive, wait_for_messages, wait_for_open_reply
from support.omnia import OmniaClient, scenario
from support.server import SCRIPT, ServerProcess, run_cli


def scripted(tmp_path: Path) -> ServerProcess:
    return ServerProcess(tmp_path / "data", args=("--runtime", "scripted", "--script", str(SCRIPT)))


async def open_client(http: aiohttp.ClientSession, server: ServerProcess) -> OmniaClient:
    return OmniaClient(await http.ws_connect(server.ws_url))


def writer_of(server_pid: int) -> str:
    """What /readyz says of the SQLite archive: its writer process (a child of the
    server's) on two CPUs or more (`sqlite_writer: auto`), else the thread."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    writers = [
        pid for pid in children if "sqlite_process" in Path(f"/proc/{pid}/cmdline").read_text()
    ]
    return f"writer process {writers[0]}" if writers else "in process"


async def test_probes_report_live_and_ready(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    server = scripted(tmp_path).start()
    try:
        async with http.get(server.http_url + "/healthz") as live:
            assert live.status == 200
        async with http.get(server.http_url + "/readyz") as ready:
            assert ready.status == 200
            body = await ready.json()
        assert server.process is not None
        archive = body["backends"].pop("archive")
        assert archive["state"] == "ready"
        assert archive["reason"] == writer_of(server.process.pid), archive
    finally:
        server.stop()
    assert body["status"] == "ready"
    # Every backend is named with its state; the embedded ones run in this process.
    assert body["backends"] == {
        "bus": {"state": "ready", "reason": "in process"},
        "session_state": {"state": "ready", "reason": "in process"},
        "media": {"state": "ready", "reason": "in process"},
    }


async def test_logs_name_connections_and_turns_but_never_bodies(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = scripted(tmp_path).start()
    try:
        client = await open_client(http, server)
        session_id = (await client.connected())["session_id"]
        secret = "my card number is 4111-1111"
        await client.ask(secret, **scenario("echo"))
        await client.ws.close()
        await asyncio.sleep(0.2)
    finally:
        server.stop()
    log = server.log_text()
    assert f"connection opened protocol=omnia session={session_id}" in log
    assert f"turn ended session={session_id}" in log
    assert f"connection closed protocol=omnia session={session_id}" in log
    assert "4111" not in log


async def test_turns_left_running_by_a_killed_server_are_interrupted_at_start(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = scripted(tmp_path).start()
    client = await open_client(http, server)
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "message", "content": "slow", **scenario("slow")})
    await client.recv()
    await wait_for_open_reply(server.archive_path, session_id)
    server.stop(signal.SIGKILL)
    server.start()
    try:
        async with open_archive(server.archive_path) as store:
            (turn,) = await store.list_turns(session_id)
        assert turn.state is TurnState.INTERRUPTED
        # The session survives the restart and takes new turns.
        resumed = await open_client(http, server)
        await resumed.connected()
        frames = await resumed.ask("again", session_id=session_id)
        assert {f["session_id"] for f in frames} == {session_id}
        messages = await wait_for_messages(server.archive_path, session_id, 4)
        assert [m.global_offset for m in messages] == [1, 2, 3, 4]
        # The reply the kill cut short is marked failed, not left streaming forever.
        assert (messages[1].role, messages[1].status) == ("assistant", "failed")
    finally:
        server.stop()


def test_config_show_prints_effective_settings_with_masked_keys() -> None:
    result = run_cli(
        "config",
        "show",
        "--port",
        "9999",
        env={"PORTICO_API_KEYS": "s3cret=alice", "PORTICO_CONTEXT_TTL": "12.5"},
    )
    assert result.returncode == 0, result.stderr
    assert "port: 9999" in result.stdout
    assert "context_ttl: 12.5" in result.stdout
    assert "alice" in result.stdout
    assert "s3cret" not in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("serve", "--host", "0.0.0.0", "--port", "0"), "without authentication"),
        (("serve", "--auth", "apikey", "--port", "0"), "api_keys"),
        (("serve", "--auth", "jwt", "--port", "0"), "auth=jwt needs jwt_issuer or jwt_jwks_url"),
        (("serve", "--runtime", "scripted", "--port", "0"), "script"),
        (("serve", "--store", "postgres", "--port", "0"), "store=postgres needs database_url"),
    ],
)
def test_serve_refuses_unsafe_or_incomplete_settings(args: tuple[str, ...], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert message in result.stderr


async def test_allow_unauthenticated_flag_serves_an_open_bind(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    shown = run_cli("config", "show", "--host", "0.0.0.0", "--allow-unauthenticated")
    assert shown.returncode == 0, shown.stderr
    assert "allow_unauthenticated: true" in shown.stdout.splitlines()
    # The later --host wins over the one ServerProcess passes first.
    server = ServerProcess(
        tmp_path / "data", args=("--host", "0.0.0.0", "--allow-unauthenticated")
    ).start()
    try:
        async with http.get(server.http_url + "/readyz") as ready:
            assert ready.status == 200
    finally:
        server.stop()


def test_invalid_environment_value_is_a_clear_error() -> None:
    result = run_cli("config", "show", env={"PORTICO_PORT": "eighty"})
    assert result.returncode == 2
    assert "port" in result.stderr


def draining_server(tmp_path: Path, *, drain_timeout: float) -> ServerProcess:
    return ServerProcess(
        tmp_path / "data",
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={"PORTICO_DRAIN_TIMEOUT": str(drain_timeout)},
    ).start()


async def start_slow_turn(
    http: aiohttp.ClientSession, server: ServerProcess
) -> tuple[OmniaClient, str]:
    """A client whose `slow` turn has streamed its first chunk and now sleeps."""
    client = await open_client(http, server)
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "message", "content": "slow", **scenario("slow")})
    assert (await client.recv())["content"] == "a"
    return client, session_id


async def _wait_status(http: aiohttp.ClientSession, url: str, status: int) -> None:
    """Poll until the probe answers `status` (the signal is delivered asynchronously)."""
    for _ in range(100):
        async with http.get(url) as response:
            if response.status == status:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never answered {status}")


async def test_sigterm_drain_finishes_the_running_turn_then_closes_1001(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = draining_server(tmp_path, drain_timeout=20)
    # A turn held by its client tool call: it runs until answered, however slow this
    # machine is, so the socket cannot be closed (turn done) before the checks below.
    client = await open_client(http, server)
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "message", "content": "where?", **scenario("tool")})
    call_id = (await client.recv())["tool_call"]["id"]
    await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call_id}})
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)

    await _wait_status(http, server.http_url + "/readyz", 503)
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await http.ws_connect(server.ws_url)
    assert refused.value.status == 503
    # A new message on the open socket is shed; the running turn is not.
    await client.send({"type": "message", "content": "more", "session_id": "other-session"})
    assert (await client.recv())["error"]["code"] == "RATE_LIMITED"

    await client.send({"type": "tool_result", "tool_result": {"call_id": call_id, "result": "x"}})
    assert (await client.turn())[-1] == {
        "type": "done",
        "content": 'status=completed result="x" error=',
        "session_id": session_id,
    }
    closing = await client.ws.receive(timeout=10)
    assert (closing.type, closing.data) == (aiohttp.WSMsgType.CLOSE, 1001)
    assert server.stop() == 0
    async with open_archive(server.archive_path) as store:
        (turn,) = await store.list_turns(session_id)
    assert turn.state is TurnState.COMPLETED


async def test_drain_timeout_interrupts_with_a_terminal_frame_then_closes_1001(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = draining_server(tmp_path, drain_timeout=0.2)
    client, session_id = await start_slow_turn(http, server)
    assert server.stop(signal.SIGTERM) == 0
    terminal = await client.recv()
    assert terminal["type"] == "error"
    assert terminal["session_id"] == session_id
    closing = await client.ws.receive(timeout=10)
    assert (closing.type, closing.data) == (aiohttp.WSMsgType.CLOSE, 1001)
    async with open_archive(server.archive_path) as store:
        (turn,) = await store.list_turns(session_id)
        messages = await store.list_messages(session_id)
    assert turn.state is TurnState.INTERRUPTED
    # The partial reply is archived.
    assert [(m.role, m.content) for m in messages] == [("user", "slow"), ("assistant", "a")]


async def test_a_second_server_on_the_same_data_dir_is_refused(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    server = ServerProcess(tmp_path / "data").start()
    try:
        second = run_cli("serve", "--port", "0", "--data-dir", str(tmp_path / "data"))
        assert second.returncode == 1
        assert "is in use by another Portico process" in second.stderr
        assert "Traceback" not in second.stderr
        async with http.get(server.http_url + "/readyz") as ready:
            assert ready.status == 200  # the first one serves on
    finally:
        server.stop()
    # Once the first has stopped, the archive is free again.
    ServerProcess(tmp_path / "data").start().stop()
