"""Portico verifies tokens from a real OpenID provider no one here wrote.

`oidc-provider` issues JWT access tokens (client_credentials grant, resource
indicator, `accessTokenFormat: jwt`); `portico serve --auth jwt` finds its keys by
OIDC discovery and JWKS and admits the token on every protocol and a media route.
Restarting the provider with a new key set is a key rotation: the new `kid` is
fetched, the old tokens stop working.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import jwt
import pytest

from support.jwks import jwt_server
from support.oidc_provider import CLIENT, OidcProvider, require_provider
from support.rpc import RpcProbe
from support.server import ServerProcess
from support.session import SessionProbe


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OidcProvider]:
    require_provider()
    started = OidcProvider(tmp_path_factory.mktemp("oidc")).start("RS256")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, provider: OidcProvider
) -> Iterator[ServerProcess]:
    # A refetch may follow any earlier fetch at once: the rotation below is seen on the
    # first token with the new kid.
    process = jwt_server(
        tmp_path_factory.mktemp("portico-oidc"),
        provider.issuer,
        PORTICO_JWT_JWKS_REFRESH_INTERVAL="0.01",
        PORTICO_LOG_LEVEL="DEBUG",
    )
    yield process
    process.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def ws_status(http: aiohttp.ClientSession, server: ServerProcess, token: str) -> int:
    try:
        async with http.ws_connect(
            server.ws_url, protocols=(f"portico.bearer.{token}", "omnia")
        ) as ws:
            first = await ws.receive_json(timeout=10)
            assert first["type"] == "connected"
            return 101
    except aiohttp.WSServerHandshakeError as refused:
        return refused.status


async def test_tokens_from_a_real_provider_through_discovery_and_rotation(
    http: aiohttp.ClientSession, server: ServerProcess, provider: OidcProvider, tmp_path: Path
) -> None:
    first = provider.token()
    assert jwt.get_unverified_header(first)["kid"] == provider.kid
    assert await ws_status(http, server, first) == 101
    headers = {"Authorization": f"Bearer {first}"}
    async with http.ws_connect(server.ws_url, headers=headers) as ws:
        assert (await ws.receive_json(timeout=10))["type"] == "connected"

    rpc = await RpcProbe.open(http, f"ws://127.0.0.1:{server.port}/v1/rpc", token=first)
    assert (rpc.connected["type"], rpc.connected["user_id"]) == ("connected", CLIENT[0])
    await rpc.ws.close()
    session = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
    assert (await session.hello(credential=first, agent="default"))["type"] == "ready"
    await session.ws.close()
    body = {"session_id": "sess-oidc", "filename": "a.txt", "mime_type": "text/plain"}
    async with http.post(
        f"{server.http_url}/media/request-upload", json={**body, "size_bytes": 1}, headers=headers
    ) as granted:
        assert granted.status == 200

    old_kid = provider.kid
    provider.restart("ES256")  # a new key set: the old key is gone
    assert provider.kid != old_kid
    second = provider.token()
    assert jwt.get_unverified_header(second) == {
        "alg": "ES256",
        "typ": "at+jwt",
        "kid": provider.kid,
    }
    assert await ws_status(http, server, second) == 101
    assert await ws_status(http, server, first) == 401  # signed by a key no longer published

    log = server.log_path.read_text()
    for token in (first, second):
        assert token not in log
        assert token.split(".")[2] not in log
