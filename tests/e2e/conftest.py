"""Fixtures for the browser tests: a demo server, a TCP proxy in front of it, headless Chromium.

The page is loaded through the proxy, so the page's HTTP requests and both of its
WebSockets (`/v1/rpc`, `/v1/session`) cross it: `proxy.cut_all()` drops every connection
the way a network failure does, `proxy.freeze_all()` leaves them half-open (nothing gets
through, nobody is told). Chromium is Debian's (`apt-get install chromium`), driven by
Playwright's Python package (`pip install -e '.[e2e]'`); without them the tests are
skipped locally and fail in CI.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e.harness import (
    CHROMIUM,
    HEARTBEAT,
    USERS,
    WORD_DELAY,
    TcpProxy,
    require_tools,
    watch,
)
from support.server import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The demo agent with API keys, so that each test is a user with its own sidebar."""
    require_tools()
    data_dir = tmp_path_factory.mktemp("portico-e2e")
    config = data_dir / "portico.yaml"
    keys = {f"key-{n}": f"user-{n}" for n in range(USERS)}
    config.write_text(yaml.safe_dump({"auth": "apikey", "api_keys": keys, "runtime": "demo"}))
    process = ServerProcess(
        data_dir,
        args=("--config", str(config)),
        env={
            "PORTICO_DEMO_WORD_DELAY": str(WORD_DELAY),
            "PORTICO_HEARTBEAT_INTERVAL": str(HEARTBEAT),
        },
    ).start()
    yield process
    process.stop()


_users = itertools.count()


@pytest.fixture
def token() -> str:
    """A user of this test's own (the page stores its token in local storage)."""
    number = next(_users)
    assert number < USERS, "raise USERS"
    return f"key-{number}"


@pytest.fixture(scope="module")
def proxy(server: ServerProcess) -> Iterator[TcpProxy]:
    relay = TcpProxy(server.port).start()
    yield relay
    relay.stop()


@pytest.fixture(scope="module")
def browser(server: ServerProcess) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=["--autoplay-policy=no-user-gesture-required"],
        )
        yield chromium
        chromium.close()


@pytest.fixture
def context(browser: Any, token: str) -> Iterator[Any]:
    """A fresh browser profile in a known time zone, signed in as this test's user."""
    context = browser.new_context(
        viewport={"width": 1280, "height": 860}, timezone_id="Europe/Paris", locale="en-GB"
    )
    # What the settings form stores; set before any page script runs.
    store = f"localStorage.setItem('portico.token', {json.dumps(token)})"
    unset = "location.protocol === 'http:' && !localStorage.getItem('portico.token')"
    context.add_init_script(f"if ({unset}) {store}")
    yield context
    context.close()


@pytest.fixture
def errors() -> list[str]:
    return []


@pytest.fixture
def page(context: Any, proxy: TcpProxy, errors: list[str]) -> Iterator[Any]:
    """The chat page, loaded through the proxy; uncaught page errors fail the test."""
    from playwright.sync_api import expect

    expect.set_options(timeout=10_000)
    tab = context.new_page()
    watch(tab, errors)
    tab.goto(proxy.url)
    expect(tab.locator("#connection")).to_have_attribute("data-state", "open")
    yield tab
    assert not errors, errors
