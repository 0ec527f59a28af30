"""The page as a new user meets it (issue 12): a server restart, the sidebar, a phone.

Chromium through the proxy, as in test_chat_page.py: each test is a user of its own.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from typing import Any

from e2e.harness import ARTIFACTS, TcpProxy, watch
from e2e.test_chat_page import COMPLETED, REPLIES, ask, rpc, send, session_id
from support.server import ServerProcess

try:
    from playwright.sync_api import Page, expect
except ImportError:  # reported by the fixtures: skipped locally, a failure in CI
    Page = Any  # type: ignore[misc,assignment]

CONTINUED = "The server restarted: this conversation goes on."
PHONE = {"width": 390, "height": 844}


def user_texts(server: ServerProcess, token: str, sid: str) -> list[str]:
    page = rpc(server, token, "v1.message.list", session_id=sid, limit=50)
    return [m["content_data"] for m in page["items"] if m["role"] == "user"]


def test_a_line_typed_while_the_server_is_down_is_answered_in_the_same_conversation(
    page: Page, server: ServerProcess, token: str
) -> None:
    expect(ask(page, "echo before")).to_have_text("before")
    sid = session_id(page)
    server.stop()  # the page's resume will fail: the new process never heard of it
    expect(page.locator("#connection")).not_to_have_attribute("data-state", "open")
    send(page, "echo typed while down")
    server.start()
    expect(page.locator(COMPLETED)).to_have_count(2, timeout=30_000)
    expect(page.locator(COMPLETED).last).to_have_text("typed while down")
    expect(page.locator("#notice")).to_have_text(CONTINUED)
    expect(page.locator("#mode")).to_have_attribute("data-mode", "live")
    assert session_id(page) == sid  # one conversation, not a second one
    expect(ask(page, "echo after")).to_have_text("after")
    assert user_texts(server, token, sid) == ["echo before", "echo typed while down", "echo after"]
    expect(page.locator(REPLIES)).to_have_count(3)


def test_a_reload_after_the_restart_continues_the_conversation(
    page: Page, server: ServerProcess, token: str
) -> None:
    expect(ask(page, "echo one")).to_have_text("one")
    sid = session_id(page)
    server.restart()
    page.reload()  # the tab's saved session cannot be resumed: it is continued
    expect(page.locator(COMPLETED)).to_have_count(1)  # the history is shown
    expect(page.locator("#connection")).to_have_attribute("data-state", "open", timeout=30_000)
    expect(page.locator("#mode")).to_have_attribute("data-mode", "live")
    expect(ask(page, "echo two")).to_have_text("two")
    assert session_id(page) == sid
    assert user_texts(server, token, sid) == ["echo one", "echo two"]


def answers_the_second_line(message: str | bytes) -> bool:
    """The first connection's ack of the page's second message, and its turn's frames
    (the first turn was seq 1-2 both ways). Judged by content, not by time: Playwright
    runs route callbacks only while the test calls into it, so they may run late."""
    frame = json.loads(message) if isinstance(message, str) else {}
    kind, seq = frame.get("type"), frame.get("seq", 0)
    return (kind == "ack" and seq >= 2) or (kind in ("chunk", "done") and seq >= 3)


Drop = Callable[[str | bytes], bool]


def faulty_tab(
    context: Any,
    proxy: TcpProxy,
    errors: list[str],
    *,
    to_page: Drop = lambda _: False,
    to_server: Drop = lambda _: False,
) -> Page:
    """A tab whose first `/v1/session` connection drops the frames the predicates pick
    (later ones, after a restart or a reload, pass everything); one exchange done."""
    connections: list[Any] = []

    def relay(ws: Any) -> None:
        upstream = ws.connect_to_server()
        first = not connections
        connections.append(ws)

        def forward(send: Callable[[str | bytes], None], drop: Drop) -> Callable[..., None]:
            return lambda message: None if first and drop(message) else send(message)

        upstream.on_message(forward(ws.send, to_page))
        ws.on_message(forward(upstream.send, to_server))

    tab = context.new_page()
    watch(tab, errors)
    tab.route_web_socket("**/v1/session", relay)
    tab.goto(proxy.url)
    expect(tab.locator("#connection")).to_have_attribute("data-state", "open")
    expect(ask(tab, "echo before")).to_have_text("before")
    return tab


def settled(server: ServerProcess, token: str, sid: str, count: int) -> None:
    """Wait until the archive holds `count` messages, none still being written."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        items = rpc(server, token, "v1.message.list", session_id=sid, limit=50)["items"]
        if len(items) >= count and all(m["status"] == "completed" for m in items):
            return
        time.sleep(0.05)
    raise AssertionError(f"the archive of {sid} did not reach {count} settled messages")


def test_a_line_the_server_archived_before_dying_is_sent_again_without_a_duplicate(
    context: Any, proxy: TcpProxy, server: ServerProcess, token: str, errors: list[str]
) -> None:
    """The server archives and answers a line, but the page sees neither its ack nor its
    reply (the page's `/v1/session` frames are held back), and the server is killed:
    after the restart the page sends the line again with its key, and the archive
    still holds it once, answered once."""
    tab = faulty_tab(context, proxy, errors, to_page=answers_the_second_line)
    sid = session_id(tab)
    send(tab, "echo only once")
    settled(server, token, sid, 4)
    server.stop(signal.SIGKILL)
    server.start()
    expect(tab.locator("#notice")).to_have_text(CONTINUED, timeout=30_000)
    expect(tab.locator(COMPLETED)).to_have_count(2)
    expect(tab.locator(COMPLETED).last).to_have_text("only once")
    expect(ask(tab, "echo after")).to_have_text("after")
    assert user_texts(server, token, sid) == ["echo before", "echo only once", "echo after"]
    expect(tab.locator(".msg.user")).to_have_count(3)
    assert not errors, errors


def test_a_line_the_server_never_saw_is_sent_after_a_reload_and_a_restart(
    context: Any, proxy: TcpProxy, server: ServerProcess, token: str, errors: list[str]
) -> None:
    """The line goes out but never reaches the server, which is killed; the tab is
    reloaded: its snapshot still holds the line with its key, and the continued
    session sends it, so it is answered, once."""
    tab = faulty_tab(context, proxy, errors, to_server=lambda m: "echo never seen" in str(m))
    sid = session_id(tab)
    send(tab, "echo never seen")
    expect(tab.locator(".msg.user")).to_have_count(2)  # sent: the snapshot says so
    server.stop(signal.SIGKILL)
    server.start()
    tab.reload()
    expect(tab.locator(COMPLETED)).to_have_count(2, timeout=30_000)
    expect(tab.locator(COMPLETED).last).to_have_text("never seen")
    assert session_id(tab) == sid
    assert user_texts(server, token, sid) == ["echo before", "echo never seen"]
    assert not errors, errors


def test_the_sidebar_titles_a_conversation_from_its_first_message_and_shows_its_activity(
    context: Any, proxy: TcpProxy, server: ServerProcess, token: str, errors: list[str]
) -> None:
    """A conversation another client opened (over RPC here; `portico chat` alike) has no
    title of its own."""
    sent = rpc(
        server, token, "v1.message.send", content_data="plan the   offsite\nin May", client_id="t1"
    )
    page = context.new_page()
    watch(page, errors)
    page.goto(proxy.url)
    item = page.locator(f'#sessions li[data-session-id="{sent["session_id"]}"]')
    expect(item.locator(".session-title")).to_have_text("plan the offsite in May")
    expect(item.locator(".session-active")).to_have_text("just now")
    assert item.locator(".session-active").get_attribute("datetime")
    stored = rpc(server, token, "v1.session.get", session_id=sent["session_id"])
    assert stored["title"] == "plan the offsite in May"  # saved for every client
    assert not errors, errors


def test_a_new_image_reply_is_scrolled_fully_into_view(page: Page) -> None:
    page.set_viewport_size(PHONE)
    for n in range(4):  # enough to scroll
        ask(page, f"echo line {n} " + "words " * 30)
    reply = ask(page, "draw")
    image = reply.locator("img.media")
    expect(image).to_be_visible()
    page.wait_for_function(
        "img => img.complete && img.naturalHeight > 0", arg=image.element_handle()
    )
    box = image.bounding_box()
    area = page.locator("#messages").bounding_box()
    assert box is not None
    assert area is not None
    assert area["y"] <= box["y"]
    assert box["y"] + box["height"] <= area["y"] + area["height"] + 1


def test_the_composer_fits_a_390_px_screen_while_a_reply_runs(page: Page) -> None:
    page.set_viewport_size(PHONE)
    send(page, "slow")
    expect(page.locator("#stop")).to_be_visible()
    page.fill("#input", "a long message typed while the reply streams in")
    sizes = page.evaluate(
        """() => ({
            page: document.documentElement.scrollWidth,
            input: document.getElementById("input").getBoundingClientRect().width,
            lines: Math.round(document.getElementById("input").scrollHeight /
                              parseFloat(getComputedStyle(document.getElementById("input")).lineHeight)),
            right: Math.max(...[...document.querySelectorAll("#composer button, #composer .attach")]
                .filter((el) => el.offsetParent !== null)
                .map((el) => el.getBoundingClientRect().right)),
        })"""
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "composer-390.png"))
    assert sizes["page"] <= PHONE["width"], sizes  # nothing scrolls sideways
    assert sizes["right"] <= PHONE["width"], sizes  # every control on screen
    # The message box keeps most of the row (Stop stands in for the disabled Send).
    assert sizes["input"] >= 0.6 * PHONE["width"], sizes
    page.locator("#stop").click()


def test_with_authentication_on_the_page_says_where_to_enter_the_key(
    browser: Any, proxy: TcpProxy, token: str, errors: list[str]
) -> None:
    fresh = browser.new_context(viewport=PHONE)  # no token stored
    try:
        page = fresh.new_page()
        watch(page, errors)
        page.goto(proxy.url)
        notice = page.locator("#notice")
        expect(notice).to_contain_text("needs an API key")
        expect(notice).to_contain_text("Settings → API token")
        expect(page.locator(".settings")).to_have_attribute("open", "")
        expect(page.locator("#token")).to_be_focused()
        page.locator("#token").fill(token)
        page.locator("#token-form button").click()
        expect(page.locator("#connection")).to_have_attribute("data-state", "open")
        assert (
            json.loads(page.evaluate("() => JSON.stringify(localStorage.getItem('portico.token'))"))
            == token
        )
    finally:
        fresh.close()
    assert not errors, errors
