"""The chat page's conversation details: the session's trace (`v1.session.trace`),
in headless Chromium, for a conversation another client had on `/ws`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from typing import Any

import aiohttp

from e2e.harness import TcpProxy
from support.server import ServerProcess

try:
    from playwright.sync_api import Page, expect
except ImportError:  # reported by the fixtures: skipped locally, a failure in CI
    Page = Any  # type: ignore[misc,assignment]

WITHIN = 10.0


async def _ws_conversation(port: int, token: str) -> str:
    """A /ws conversation whose client acknowledged the disclosure and sent metadata."""
    url = f"ws://127.0.0.1:{port}/ws"
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http, http.ws_connect(url, headers=headers) as ws:
        connected = await ws.receive_json(timeout=WITHIN)
        await ws.send_json({"type": "disclosure_ack"})
        await ws.send_json({"type": "message", "content": "hello", "metadata": {"ticket": "T-9"}})
        while (await ws.receive_json(timeout=WITHIN))["type"] not in ("done", "error"):
            pass
        session_id: str = connected["session_id"]
        return session_id


def ws_conversation(server: ServerProcess, token: str) -> str:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _ws_conversation(server.port, token)).result()


def test_details_show_the_conversations_trace(
    page: Page, server: ServerProcess, proxy: TcpProxy, token: str
) -> None:
    session_id = ws_conversation(server, token)
    page.goto(f"{proxy.url}#s={session_id}")
    expect(page.locator(".msg.user .text")).to_have_text(["hello"])
    toggle = page.locator("#details-toggle")
    expect(toggle).to_be_visible()
    expect(page.locator("#details")).to_be_hidden()

    toggle.click()
    expect(page.locator("#trace")).to_have_attribute("data-state", "loaded")
    expect(page.locator("#details-session")).to_have_text(session_id)
    disclosure = page.locator('#trace li[data-type="ai.disclosure.displayed"]')
    expect(disclosure).to_have_count(1)
    assert json.loads(disclosure.locator(".trace-data").inner_text()) == {"assertedBy": "client"}
    metadata = page.locator('#trace li[data-type="message.metadata"] .trace-data')
    assert json.loads(metadata.inner_text())["metadata"] == {"ticket": "T-9"}
    assert toggle.get_attribute("aria-expanded") == "true"

    # A new conversation has no details to show; closing empties the list.
    page.locator("#details-close").click()
    expect(page.locator("#details")).to_be_hidden()
    expect(page.locator("#trace li")).to_have_count(0)
    page.locator("#new-chat").click()
    expect(toggle).to_be_hidden()
