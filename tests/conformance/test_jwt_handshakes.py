"""`portico serve --auth jwt` against locally minted tokens and a JWKS on 127.0.0.1.

Every protocol and a media route accept a valid token and refuse bad ones with
their defined answers; a browser's `/ws` upgrade carries the token as a
`portico.bearer.<token>` subprotocol entry and gets the real subprotocol back;
no token ever reaches the server's log.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import jwt
import pytest

from support.jwks import Issuer, jwt_server, served_issuer
from support.rpc import RpcClosed, RpcProbe
from support.server import ServerProcess
from support.session import SessionProbe

USED: list[str] = []  # every token this module sent; none may be in the server's log


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    yield from served_issuer()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, issuer: Issuer) -> Iterator[ServerProcess]:
    process = jwt_server(
        tmp_path_factory.mktemp("portico-jwt"), issuer.url, PORTICO_LOG_LEVEL="DEBUG"
    )
    yield process
    process.stop()


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession() as session:
        yield session


def valid(issuer: Issuer, alg: str = "RS256", **claims: Any) -> str:
    token = issuer.token(alg, **claims)
    USED.append(token)
    return token


def bad_tokens(issuer: Issuer) -> dict[str, str]:
    now = int(time.time())
    stranger = Issuer(algorithms=("RS256",))
    tokens = {
        "expired": issuer.token(exp=now - 600),
        "not yet valid": issuer.token(nbf=now + 600),
        "wrong issuer": issuer.token(iss="https://elsewhere.example"),
        "wrong audience": issuer.token(aud="another-api"),
        "none": jwt.encode(issuer.claims(), None, algorithm="none"),
        "another key": jwt.encode(
            issuer.claims(),
            stranger.keys["rs256-1"][1],
            algorithm="RS256",
            headers={"kid": issuer.kid("RS256")},
        ),
        "no subject": issuer.token(sub=None),
        "garbage": "not.a.token",
    }
    USED.extend(tokens.values())
    return tokens


def ws_url(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/ws?agent=default"


# -- /ws --------------------------------------------------------------------------------


@pytest.mark.parametrize("alg", ["RS256", "ES256", "EdDSA"])
async def test_ws_accepts_a_bearer_token(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer, alg: str
) -> None:
    token = valid(issuer, alg, sub=f"ws-{alg}")
    async with http.ws_connect(ws_url(server), headers={"Authorization": f"Bearer {token}"}) as ws:
        assert (await ws.receive_json(timeout=10))["type"] == "connected"
        await ws.send_json({"type": "message", "content": "ping"})
        frame = await ws.receive_json(timeout=10)
        while frame["type"] not in ("done", "error"):
            frame = await ws.receive_json(timeout=10)
        assert frame["type"] == "done", frame


async def test_ws_refuses_bad_tokens_with_401(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    for reason, token in bad_tokens(issuer).items():
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(ws_url(server), headers={"Authorization": f"Bearer {token}"})
        assert refused.value.status == 401, reason
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await http.ws_connect(ws_url(server))
    assert refused.value.status == 401


async def test_ws_takes_the_token_as_a_subprotocol_entry_and_selects_the_real_one(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    """What a browser sends: `new WebSocket(url, ["portico.bearer." + token, "omnia"])`."""
    token = valid(issuer, sub="browser")
    offered = (f"portico.bearer.{token}", "omnia")
    async with http.ws_connect(ws_url(server), protocols=offered) as ws:
        assert ws.protocol == "omnia"
        assert (await ws.receive_json(timeout=10))["type"] == "connected"
    async with http.get(
        f"http://127.0.0.1:{server.port}/ws?agent=default",
        headers={
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
            "Sec-WebSocket-Protocol": ", ".join(offered),
        },
    ) as response:
        assert response.status == 101
        assert response.headers["Sec-WebSocket-Protocol"] == "omnia"
        assert token not in str(response.headers)
    for token in bad_tokens(issuer).values():
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(ws_url(server), protocols=(f"portico.bearer.{token}", "omnia"))
        assert refused.value.status == 401


# -- /v1/session and /v1/rpc ---------------------------------------------------------------


async def test_session_hello_credential_is_verified(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    url = f"ws://127.0.0.1:{server.port}/v1/session"
    probe = await SessionProbe.connect(http, url)
    ready = await probe.hello(credential=valid(issuer, "ES256", sub="carol"), agent="default")
    assert ready["type"] == "ready", ready
    await probe.ws.close()
    for reason, token in bad_tokens(issuer).items():
        probe = await SessionProbe.connect(http, url)
        answer = await probe.hello(credential=token, agent="default")
        assert answer["error"]["code"] == "UNAUTHENTICATED", reason
        assert (await probe.closed())[0] == 4401


async def test_rpc_connect_token_is_verified(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    url = f"ws://127.0.0.1:{server.port}/v1/rpc"
    probe = await RpcProbe.open(http, url, token=valid(issuer, "EdDSA", sub="dave"))
    assert probe.connected["type"] == "connected", probe.connected
    assert probe.connected["user_id"] == "dave"
    await probe.ws.close()
    for reason, token in bad_tokens(issuer).items():
        probe = await RpcProbe.open(http, url, token=token)
        assert probe.connected["error"]["code"] == "unauthenticated", reason
        with pytest.raises(RpcClosed):
            await probe.next_frame()
        assert probe.ws.close_code == 4401


# -- media --------------------------------------------------------------------------------


async def test_media_routes_verify_the_bearer_token(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    url = f"http://127.0.0.1:{server.port}/media/request-upload"
    body = {"session_id": "sess-jwt", "filename": "a.txt", "mime_type": "text/plain"}
    body["size_bytes"] = 5  # type: ignore[assignment]
    token = valid(issuer, sub="erin")
    async with http.post(url, json=body, headers={"Authorization": f"Bearer {token}"}) as ok:
        assert ok.status == 200, await ok.text()
    base = f"http://127.0.0.1:{server.port}/media"
    reads = [f"{base}/info/sess-jwt/med-x", f"{base}/download/sess-jwt/med-x"]
    for reason, token in bad_tokens(issuer).items():
        headers = {"Authorization": f"Bearer {token}"}
        async with http.post(url, json=body, headers=headers) as refused:
            assert refused.status == 401, reason
            assert refused.headers["WWW-Authenticate"].startswith("Bearer")
        for read in reads:  # the token is checked before the media is looked up
            async with http.get(read, headers=headers) as refused:
                assert refused.status == 401, (reason, read)
    for read in reads:  # a good token reaches the lookup: no such media
        async with http.get(read, headers={"Authorization": f"Bearer {valid(issuer)}"}) as found:
            assert found.status == 404, read


# -- the log -------------------------------------------------------------------------------


async def test_no_token_reaches_the_server_log(
    http: aiohttp.ClientSession, server: ServerProcess, issuer: Issuer
) -> None:
    """Tokens this test sends on every protocol, and whatever this process's earlier
    tests sent to the same server (USED), are nowhere in its log."""
    good = valid(issuer, sub="logged")
    for token in (good, *bad_tokens(issuer).values()):
        with contextlib.suppress(aiohttp.WSServerHandshakeError):
            ws = await http.ws_connect(
                ws_url(server), protocols=(f"portico.bearer.{token}", "omnia")
            )
            await ws.close()
        session = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
        await session.hello(credential=token, agent="default")
        await session.ws.close()
        rpc = await RpcProbe.open(http, f"ws://127.0.0.1:{server.port}/v1/rpc", token=token)
        await rpc.ws.close()
        headers = {"Authorization": f"Bearer {token}"}
        async with http.get(f"{server.http_url}/media/info/sess-x/med-x", headers=headers):
            pass
    log = server.log_path.read_text()
    assert "connection opened protocol=omnia" in log
    for token in USED:
        for piece in {token, *token.split(".")[1:]}:  # nor its payload or signature
            if len(piece) > 16:
                assert piece not in log


# -- session binding (jwt_session_claim) ---------------------------------------------------


@pytest.fixture(scope="module")
def bound_server(
    tmp_path_factory: pytest.TempPathFactory, issuer: Issuer
) -> Iterator[ServerProcess]:
    process = jwt_server(
        tmp_path_factory.mktemp("portico-jwt-bound"), issuer.url, PORTICO_JWT_SESSION_CLAIM="sid"
    )
    yield process
    process.stop()


async def ws_turn(ws: aiohttp.ClientWebSocketResponse, **message: Any) -> dict[str, Any]:
    """Send a message; the frame that ends its turn (`done` or `error`)."""
    await ws.send_json({"type": "message", "content": "hi", **message})
    frame = await ws.receive_json(timeout=10)
    while frame["type"] not in ("done", "error"):
        frame = await ws.receive_json(timeout=10)
    result: dict[str, Any] = frame
    return result


async def test_ws_resumes_a_bound_session_only_with_the_same_claim_value(
    http: aiohttp.ClientSession, bound_server: ServerProcess, issuer: Issuer
) -> None:
    def auth(sid: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {valid(issuer, sub='frank', sid=sid)}"}

    url = ws_url(bound_server)
    async with http.ws_connect(url, headers=auth("device-a")) as ws:
        session_id = (await ws.receive_json(timeout=10))["session_id"]
        assert (await ws_turn(ws))["type"] == "done"
    for other in ("device-b", None):
        async with http.ws_connect(url, headers=auth(other)) as ws:
            await ws.receive_json(timeout=10)
            refused = await ws_turn(ws, session_id=session_id)
            assert refused["error"]["code"] == "SESSION_EXPIRED", other
    async with http.ws_connect(url, headers=auth("device-a")) as ws:
        await ws.receive_json(timeout=10)
        resumed = await ws_turn(ws, session_id=session_id)
        assert (resumed["type"], resumed["session_id"]) == ("done", session_id)


async def test_session_resume_needs_the_same_claim_value(
    http: aiohttp.ClientSession, bound_server: ServerProcess, issuer: Issuer
) -> None:
    url = f"ws://127.0.0.1:{bound_server.port}/v1/session"
    probe = await SessionProbe.connect(http, url)
    ready = await probe.hello(credential=valid(issuer, sub="gina", sid="tab-1"), agent="default")
    session_id = ready["session_id"]
    await probe.ws.close()
    for other in ("tab-2", None):
        probe = await SessionProbe.connect(http, url)
        answer = await probe.hello(
            credential=valid(issuer, sub="gina", sid=other), session_id=session_id, last_seq=0
        )
        assert answer["error"]["code"] == "RESUME_FAILED", other
    probe = await SessionProbe.connect(http, url)
    answer = await probe.hello(
        credential=valid(issuer, sub="gina", sid="tab-1"), session_id=session_id, last_seq=0
    )
    assert (answer["type"], answer["resumed"]) == ("ready", True), answer
    await probe.ws.close()


async def test_session_continue_needs_the_same_claim_value(
    http: aiohttp.ClientSession, bound_server: ServerProcess, issuer: Issuer
) -> None:
    # `hello.continue` is a resume path too (docs/session.md): another claim value gets
    # the answer of a failed resume, the same value a new numbering.
    url = f"ws://127.0.0.1:{bound_server.port}/v1/session"
    probe = await SessionProbe.connect(http, url)
    ready = await probe.hello(credential=valid(issuer, sub="hana", sid="tab-1"), agent="default")
    session_id = ready["session_id"]
    await probe.ws.close()
    for other in ("tab-2", None):
        probe = await SessionProbe.connect(http, url)
        answer = await probe.hello(
            credential=valid(issuer, sub="hana", sid=other), **{"continue": session_id}
        )
        assert answer["error"]["code"] == "RESUME_FAILED", other
    probe = await SessionProbe.connect(http, url)
    answer = await probe.hello(
        credential=valid(issuer, sub="hana", sid="tab-1"), **{"continue": session_id}
    )
    assert (answer["type"], answer["session_id"]) == ("ready", session_id), answer
    await probe.ws.close()


async def test_media_of_a_bound_session_needs_the_same_claim_value(
    http: aiohttp.ClientSession, bound_server: ServerProcess, issuer: Issuer
) -> None:
    # An upload URL into a session, or its media, is the session's: another claim value
    # of the same user is answered as a foreign session is.
    url = f"ws://127.0.0.1:{bound_server.port}/v1/session"
    probe = await SessionProbe.connect(http, url)
    ready = await probe.hello(credential=valid(issuer, sub="ivan", sid="tab-1"), agent="default")
    await probe.ws.close()
    base = f"http://127.0.0.1:{bound_server.port}/media"
    body = {"session_id": ready["session_id"], "filename": "a.txt", "mime_type": "text/plain"}
    body["size_bytes"] = 5  # type: ignore[assignment]

    def auth(sid: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {valid(issuer, sub='ivan', sid=sid)}"}

    for other in ("tab-2", None):
        async with http.post(f"{base}/request-upload", json=body, headers=auth(other)) as refused:
            assert refused.status == 404, (other, await refused.text())
            assert (await refused.json())["error"]["code"] == "SESSION_EXPIRED"
    async with http.post(f"{base}/request-upload", json=body, headers=auth("tab-1")) as granted:
        assert granted.status == 200, await granted.text()
        grant = await granted.json()
    async with http.put(grant["upload_url"], data=b"hello", headers=grant["headers"]) as put:
        assert put.status < 300, await put.text()
    media_id = grant["storage_ref"].rsplit("/", 1)[1]
    info = f"{base}/info/{ready['session_id']}/{media_id}"
    async with http.get(info, headers=auth("tab-2")) as foreign:
        assert foreign.status == 404
    async with http.get(info, headers=auth("tab-1")) as own:
        assert own.status == 200, await own.text()


async def test_rpc_sees_a_bound_session_only_with_the_same_claim_value(
    http: aiohttp.ClientSession, bound_server: ServerProcess, issuer: Issuer
) -> None:
    url = f"ws://127.0.0.1:{bound_server.port}/v1/rpc"
    owner = await RpcProbe.open(http, url, token=valid(issuer, sub="hana", sid="app-1"))
    sent = await owner.call("v1.message.send", {"content_data": "hi", "client_id": "b-1"})
    session_id = sent["session_id"]
    assert (await owner.call("v1.session.get", {"session_id": session_id}))["id"] == session_id
    await owner.ws.close()
    other = await RpcProbe.open(http, url, token=valid(issuer, sub="hana", sid="app-2"))
    for method in ("v1.session.get", "v1.session.close"):
        error = await other.error(method, {"session_id": session_id})
        assert error["code"] == "session.not_found", method
    params = {"content_data": "x", "client_id": "b-2", "server_session_id": session_id}
    assert (await other.error("v1.message.send", params))["code"] == "session.not_found"
    await other.ws.close()


# -- an identity provider that is down -------------------------------------------------


async def test_a_provider_that_is_down_costs_handshakes_a_defined_answer_not_the_server(
    http: aiohttp.ClientSession, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Keys unreachable: 503 with Retry-After on `/ws` and media (a client keeps its
    token and retries), UNAUTHENTICATED/4401 on `/v1/session` and `/v1/rpc`; the server
    goes on (recovery after the refetch interval: tests/unit/test_jwt_auth.py)."""
    issuer = Issuer().start()
    issuer.down = True
    server = jwt_server(
        tmp_path_factory.mktemp("portico-jwt-down"),
        issuer.url,
        PORTICO_JWT_JWKS_TIMEOUT="1",
    )
    try:
        token = valid(issuer)
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(ws_url(server), headers={"Authorization": f"Bearer {token}"})
        assert refused.value.status == 503
        assert refused.value.headers is not None
        assert refused.value.headers["Retry-After"] == "1"
        headers = {"Authorization": f"Bearer {token}"}
        async with http.get(f"{server.http_url}/media/info/sess-x/med-x", headers=headers) as media:
            assert media.status == 503
        probe = await SessionProbe.connect(http, f"ws://127.0.0.1:{server.port}/v1/session")
        assert (await probe.hello(credential=token))["error"]["code"] == "UNAUTHENTICATED"
        assert (await probe.closed())[0] == 4401
        rpc = await RpcProbe.open(http, f"ws://127.0.0.1:{server.port}/v1/rpc", token=token)
        assert rpc.connected["error"]["code"] == "unauthenticated"
        await rpc.ws.close()
        async with http.get(f"{server.http_url}/healthz") as health:
            assert health.status == 200  # the process goes on
        assert "JWKS fetch failed: ClientResponseError" in server.log_path.read_text()
    finally:
        server.stop()
        issuer.stop()
