"""A browser authenticates `/ws` with `openOmniaSocket` (web/portico.js): the token goes as
a `portico.bearer.<token>` subprotocol entry, never in the URL, and Chromium accepts the
upgrade only because the server selects the real subprotocol it offered next to it."""

from __future__ import annotations

from typing import Any

OPEN = """async ([token, agent]) => {
  const { openOmniaSocket } = await import("/web/portico.js");
  const ws = openOmniaSocket(`/ws?agent=${agent}`, { token });
  return await new Promise((resolve) => {
    ws.onmessage = (event) => {
      resolve({ protocol: ws.protocol, url: ws.url, first: JSON.parse(event.data).type });
      ws.close();
    };
    ws.onerror = () => resolve({ error: true });
  });
}"""


def test_a_browser_opens_ws_with_its_token_as_a_subprotocol(page: Any, token: str) -> None:
    opened = page.evaluate(OPEN, [token, "default"])
    assert opened["first"] == "connected", opened
    assert opened["protocol"] == "omnia"
    assert token not in opened["url"]


def test_a_browser_with_a_wrong_token_is_refused(page: Any) -> None:
    assert page.evaluate(OPEN, ["not-a-key", "default"]) == {"error": True}
