"""`PROVIDER_UNAVAILABLE` from a real `portico serve`: the client reads a generic message,
the server's log line names the endpoint and the cause.

Each agent points the OpenAI-compatible runtime at a provider that fails one way: a
closed port (connection refused), an unresolvable name (`.invalid` never resolves, so
the lookup fails without a query leaving for the internet), a plain-TCP server spoken
to over https (TLS), and the fake OpenAI server answering 500 and 503.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
import yaml

from support.fake_openai import ENV, FAST, KEY, KEY_ENV, SECRET_BODY, FakeOpenAI, failure
from support.omnia import OmniaClient
from support.server import ServerProcess

LABEL = "model fake-model (fake)"
USER_TEXT = "a private question for the model"


class PlainTcpServer:
    """Accepts on 127.0.0.1 and answers every connection with plain HTTP, so a TLS
    client's handshake fails on the first bytes it reads."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        self._socket.settimeout(0.2)
        self.port: int = self._socket.getsockname()[1]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> PlainTcpServer:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopped.set()
        self._thread.join(5)
        self._socket.close()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            with connection:
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain_tcp() -> Iterator[PlainTcpServer]:
    with PlainTcpServer() as server:
        yield server


@pytest.fixture(scope="module")
def endpoints(fake: FakeOpenAI, plain_tcp: PlainTcpServer) -> dict[str, str]:
    """Agent name -> the provider's base URL."""
    return {
        "refused": f"http://127.0.0.1:{closed_port()}/v1",
        "dns": "http://nonexistent.invalid/v1",
        "tls": f"https://127.0.0.1:{plain_tcp.port}/v1",
        "status": fake.base_url,
    }


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, endpoints: dict[str, str]
) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("provider-unavailable")
    agent = {
        "runtime": "openai",
        "model": "fake-model",
        "provider": "fake",
        "api_key_env": KEY_ENV,
        **FAST,
        "retries": 0,
    }
    agents = {name: {**agent, "base_url": url} for name, url in endpoints.items()}
    config = data_dir / "portico.yaml"
    config.write_text(yaml.safe_dump({"agents": agents}))
    # No proxy between the runtime and these providers: the failures are their own.
    env = {**ENV, "NO_PROXY": "*", "no_proxy": "*"}
    process = ServerProcess(data_dir, args=("--config", str(config)), env=env).start()
    yield process
    process.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def failed_turn(
    http: aiohttp.ClientSession, server: ServerProcess, agent: str
) -> dict[str, str]:
    client = OmniaClient(await http.ws_connect(f"{server.ws_url}?agent={agent}"))
    await client.connected()
    frames = await client.ask(USER_TEXT)
    await client.ws.close()
    assert [frame["type"] for frame in frames] == ["error"], frames
    error: dict[str, str] = frames[0]["error"]
    return error


def failure_line(server: ServerProcess, base_url: str) -> str:
    """The server's one log line for the failed turn against `base_url`."""
    endpoint = base_url + "/chat/completions"
    lines = [
        line
        for line in server.log_text().splitlines()
        if "model turn failed" in line and f"endpoint={endpoint} " in line
    ]
    assert len(lines) == 1, server.log_text()
    log = server.log_text()
    for secret in (KEY, "SECRET", USER_TEXT):  # the key, the provider's body, the message
        assert secret not in log
    return lines[0]


@pytest.mark.parametrize(
    ("agent", "cause"),
    [
        ("refused", 'cause="connection refused"'),
        ("dns", re.compile(r'cause="DNS lookup failed \([^)"]+\)"')),
        ("tls", 'cause="TLS handshake failed (wrong version number)"'),
    ],
)
async def test_a_provider_that_cannot_be_reached(
    http: aiohttp.ClientSession,
    server: ServerProcess,
    endpoints: dict[str, str],
    agent: str,
    cause: str | re.Pattern[str],
) -> None:
    error = await failed_turn(http, server, agent)
    assert error == {"code": "PROVIDER_UNAVAILABLE", "message": f"{LABEL}: could not be reached"}
    line = failure_line(server, endpoints[agent])
    assert "code=PROVIDER_UNAVAILABLE" in line
    if isinstance(cause, str):
        assert cause in line
    else:
        assert cause.search(line), line


@pytest.mark.parametrize(
    ("status", "message", "cause"),
    [
        (500, "failed (HTTP 500)", "HTTP 500 Internal Server Error"),
        (503, "unavailable (HTTP 503)", "HTTP 503 Service Unavailable"),
    ],
)
async def test_a_provider_answering_a_server_error(
    http: aiohttp.ClientSession,
    server: ServerProcess,
    fake: FakeOpenAI,
    endpoints: dict[str, str],
    status: int,
    message: str,
    cause: str,
) -> None:
    fake.reset()
    fake.push(failure(status, body=SECRET_BODY))
    before = server.log_text()
    error = await failed_turn(http, server, "status")
    assert error == {"code": "PROVIDER_UNAVAILABLE", "message": f"{LABEL}: {message}"}
    new_lines = server.log_text()[len(before) :]
    lines = [line for line in new_lines.splitlines() if "model turn failed" in line]
    assert len(lines) == 1, new_lines
    assert f"endpoint={endpoints['status']}/chat/completions " in lines[0]
    assert f'cause="{cause}"' in lines[0]
    assert "SECRET" not in server.log_text()
