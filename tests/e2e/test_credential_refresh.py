"""web/portico.js in Chromium keeps a short-lived JWT fresh through the app's callback.

A `portico serve --auth jwt` whose margin is shortened (`PORTICO_CREDENTIAL_EXPIRY_MARGIN`)
and tokens minted by the test that live a few seconds: without a refresh each
connection would be closed `4401` "credential expired" before its token's `exp`. The
page's callback is a Python function exposed to it (`mintToken`), as an app's would ask
its identity provider. Every wait is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.harness import require_tools
from support.jwks import AUDIENCE, Issuer, served_issuer
from support.server import ServerProcess

LIFE = 6  # seconds each minted token lives; the server would close at about 4


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    yield from served_issuer()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, issuer: Issuer) -> Iterator[ServerProcess]:
    """Overrides the package's API-key server: `browser` starts after this one."""
    require_tools()
    process = ServerProcess(
        tmp_path_factory.mktemp("portico-e2e-jwt"),
        args=("--auth", "jwt", "--runtime", "echo"),
        env={
            "PORTICO_JWT_ISSUER": issuer.url,
            "PORTICO_JWT_AUDIENCE": AUDIENCE,
            "PORTICO_CREDENTIAL_EXPIRY_MARGIN": "2",
        },
    ).start()
    yield process
    process.stop()


@pytest.fixture
def jwt_page(browser: Any, server: ServerProcess, issuer: Issuer) -> Iterator[tuple[Any, str]]:
    """A page of the server's origin with `window.mintToken()`; the user it mints for."""
    user = f"browser-{time.monotonic_ns()}"
    context = browser.new_context()
    tab = context.new_page()
    tab.expose_function("mintToken", lambda: issuer.token(sub=user, exp=int(time.time()) + LIFE))
    tab.goto(f"{server.http_url}/web/portico.js")
    yield tab, user
    context.close()


def refreshed(server: ServerProcess, protocol: str, user: str) -> list[str]:
    """The server's INFO lines of accepted refreshes; no token (base64url JSON) is logged."""
    assert "eyJ" not in server.log_path.read_text()
    return [
        line
        for line in server.log_path.read_text().splitlines()
        if "credential refreshed" in line and f"protocol={protocol}" in line and user in line
    ]


# Waits until a first token's `exp` has passed (bounded by the test's own timeout).
PAST_EXP = """(token) => {
  const [, payload] = token.split(".");
  const exp = JSON.parse(atob(payload.replace(/-/g, "+").replace(/_/g, "/"))).exp;
  return new Promise((resolve) => setTimeout(resolve, (exp + 0.5) * 1000 - Date.now()));
}"""

SESSION = """async () => {
  const { SessionClient } = await import("/web/portico.js");
  const issued = [];
  const credentialProvider = async () => {
    issued.push(await window.mintToken());
    return issued[issued.length - 1];
  };
  const client = new SessionClient("/v1/session", { credentialProvider });
  const states = [];
  client.addEventListener("status", (e) => states.push(e.detail.state));
  await client.connect();
  const one = (await client.ask("one")).text;
  await (PAST_EXP)(issued[0]);
  const two = (await client.ask("two")).text;
  const connections = client.connections;
  await client.close();
  return { one, two, connections, states, issued: issued.length };
}""".replace("PAST_EXP", PAST_EXP)

OMNIA = """async () => {
  const { openOmniaSocket } = await import("/web/portico.js");
  const first = await window.mintToken();
  let calls = 0;
  const credentialProvider = async () => { calls += 1; return await window.mintToken(); };
  const ws = openOmniaSocket("/ws?agent=default", { token: first, credentialProvider });
  const frames = [];
  let closed = null;
  ws.onclose = (event) => { closed = event.code; };
  await new Promise((resolve) => {
    ws.onmessage = (e) => { frames.push(JSON.parse(e.data)); resolve(); };
  });
  ws.onmessage = (e) => frames.push(JSON.parse(e.data));
  await (PAST_EXP)(first);
  const closedBeforeExp = closed;
  ws.send(JSON.stringify({ type: "message", content: "after" }));
  await new Promise((resolve) => {
    const over = () => frames.some((f) => f.type === "done") || closed !== null;
    const check = () => (over() ? resolve() : setTimeout(check, 20));
    check();
  });
  ws.close();
  return { closedBeforeExp, types: frames.map((f) => f.type), calls };
}""".replace("PAST_EXP", PAST_EXP)

RPC = """async () => {
  const { RpcClient } = await import("/web/portico.js");
  const issued = [];
  const tokenProvider = async () => {
    issued.push(await window.mintToken());
    return issued[issued.length - 1];
  };
  const client = new RpcClient("/v1/rpc", { tokenProvider });
  await client.connect();
  await (PAST_EXP)(issued[0]);
  await client.sessionList({ limit: 5 });
  const connections = client.connections;
  await client.close();
  return { connections, issued: issued.length };
}""".replace("PAST_EXP", PAST_EXP)


def test_session_client_refreshes_through_its_callback(
    jwt_page: tuple[Any, str], server: ServerProcess
) -> None:
    tab, user = jwt_page
    result = tab.evaluate(SESSION)
    assert result["one"] == "Echo: one"
    assert result["two"] == "Echo: two"
    assert result["connections"] == 1, result
    assert "dropped" not in result["states"], result
    assert result["issued"] >= 2
    assert refreshed(server, "session", user)


def test_omnia_socket_refreshes_through_its_callback(
    jwt_page: tuple[Any, str], server: ServerProcess
) -> None:
    tab, user = jwt_page
    result = tab.evaluate(OMNIA)
    assert result["closedBeforeExp"] is None, result
    assert result["types"] == ["connected", "done"], result
    assert result["calls"] >= 1
    assert refreshed(server, "omnia", user)


def test_rpc_client_refreshes_through_its_callback(
    jwt_page: tuple[Any, str], server: ServerProcess
) -> None:
    tab, user = jwt_page
    result = tab.evaluate(RPC)
    assert result["connections"] == 1, result
    assert result["issued"] >= 2
    assert refreshed(server, "rpc", user)


# The app's callback has nothing newer the first time it is asked again (it hands back
# the first token): the client sends no refresh, so the server closes 4401 "credential
# expired"; the reconnect asks again, gets a fresh token and resumes the same session. A
# message sent while disconnected is answered there.
SESSION_AFTER_4401 = """async () => {
  const { SessionClient, ReconnectPolicy } = await import("/web/portico.js");
  const within = (promise, what) => Promise.race([
    promise,
    new Promise((_, reject) => setTimeout(() => reject(new Error(what)), 30000)),
  ]);
  const issued = [];
  const credentialProvider = async () => {
    issued.push(issued.length === 1 ? issued[0] : await window.mintToken());
    return issued[issued.length - 1];
  };
  const reconnect = new ReconnectPolicy({ initial: 1, jitter: 0 });
  const client = new SessionClient("/v1/session", { credentialProvider, reconnect });
  const statuses = [];
  let dropped = null;
  const droppedOnce = new Promise((resolve) => { dropped = resolve; });
  client.addEventListener("status", (e) => {
    statuses.push({ state: e.detail.state, closeCode: e.detail.closeCode ?? null });
    if (e.detail.state === "dropped") dropped();
  });
  await client.connect();
  const sessionId = client.sessionId;
  await within(droppedOnce, "no 4401 within 30 s");
  // Sent while disconnected: it waits for the resumed connection.
  const kept = (await within(client.ask("kept"), "no reply within 30 s")).text;
  const result = {
    kept,
    statuses,
    connections: client.connections,
    sameSession: client.sessionId === sessionId,
    issued: issued.length,
  };
  await client.close();
  return result;
}"""


def test_session_client_resumes_after_a_4401_with_nothing_lost(
    jwt_page: tuple[Any, str], server: ServerProcess
) -> None:
    tab, _ = jwt_page
    result = tab.evaluate(SESSION_AFTER_4401)
    assert result["kept"] == "Echo: kept", result
    drops = [s for s in result["statuses"] if s["state"] == "dropped"]
    assert [s["closeCode"] for s in drops] == [4401], result
    assert result["sameSession"], result
    assert result["connections"] == 2, result
    assert result["issued"] >= 3, result


RPC_AFTER_4401 = """async () => {
  const { RpcClient, ReconnectPolicy } = await import("/web/portico.js");
  const within = (promise, what) => Promise.race([
    promise,
    new Promise((_, reject) => setTimeout(() => reject(new Error(what)), 30000)),
  ]);
  const issued = [];
  const tokenProvider = async () => {
    issued.push(issued.length === 1 ? issued[0] : await window.mintToken());
    return issued[issued.length - 1];
  };
  const reconnect = new ReconnectPolicy({ initial: 1, jitter: 0 });
  const client = new RpcClient("/v1/rpc", { tokenProvider, reconnect });
  const codes = [];
  let dropped = null;
  const droppedOnce = new Promise((resolve) => { dropped = resolve; });
  client.addEventListener("status", (e) => {
    if (e.detail.state !== "dropped") return;
    codes.push(e.detail.closeCode ?? null);
    dropped();
  });
  await client.connect();
  const sent = await client.messageSend("before", { clientId: "before" });
  const sessionId = sent.result.session_id;
  await within(droppedOnce, "no 4401 within 30 s");
  // Sent while disconnected: it goes out on the reconnected connection.
  const again = await within(
    client.messageSend("after", { clientId: "after", serverSessionId: sessionId }),
    "no answer within 30 s",
  );
  const page = await client.messageList(sessionId);
  const result = {
    codes,
    connections: client.connections,
    sameSession: again.result.session_id === sessionId,
    contents: (page.result ?? page).items.map((m) => m.content_data),
  };
  await client.close();
  return result;
}"""


def test_rpc_client_reconnects_after_a_4401_with_nothing_lost(
    jwt_page: tuple[Any, str], server: ServerProcess
) -> None:
    tab, _ = jwt_page
    result = tab.evaluate(RPC_AFTER_4401)
    assert result["codes"] == [4401], result
    assert result["connections"] == 2, result
    assert result["sameSession"], result
    assert "before" in result["contents"], result
    assert "after" in result["contents"], result
