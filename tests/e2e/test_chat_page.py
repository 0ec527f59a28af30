"""The demo chat page at `/`, end to end in headless Chromium, against the demo agent.

One server, one proxy and one browser per module; each test gets a fresh browser
profile. Waits are on elements and attributes, never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import re
import struct
import urllib.request
import zlib
from typing import Any

import aiohttp
import pytest

from e2e.harness import ARTIFACTS, TcpProxy, require_tools, watch
from portico.runtime.demo import GREETING, SLOW_TEXT
from support.server import ServerProcess

try:
    from playwright.sync_api import Page, expect
except ImportError:  # reported by the fixtures: skipped locally, a failure in CI
    Page = Any  # type: ignore[misc,assignment]

# Shown replies: the empty message a tool call the agent made first ended is hidden.
REPLIES = ".msg.reply:not([hidden])"
COMPLETED = ".msg.reply[data-status=completed]:not([hidden])"


# -- helpers ------------------------------------------------------------------------------


def send(page: Page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def ask(page: Page, text: str) -> Any:
    """Send `text` and wait for one more completed reply; return that reply."""
    done = page.locator(COMPLETED).count()
    send(page, text)
    expect(page.locator(COMPLETED)).to_have_count(done + 1)
    return page.locator(COMPLETED).nth(done)


def session_id(page: Page) -> str:
    match = re.fullmatch(r"#s=(.+)", page.evaluate("() => location.hash"))
    assert match, "the page names its conversation in the URL"
    return match.group(1)


def texts(page: Page) -> list[str]:
    """The conversation as shown: user texts and replies, in page order."""
    shown = page.locator(".msg.user .text, .msg.reply .markdown")
    return [text.strip() for text in shown.all_inner_texts()]


def png(width: int, height: int) -> bytes:
    rows = b"".join(b"\x00" + bytes((200, 80, 40)) * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def drop_file(page: Page, name: str, mime_type: str, data: bytes) -> None:
    """Drag a file onto the page the way a user does: dragenter, dragover, drop."""
    page.evaluate(
        """([name, type, b64]) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], name, { type }));
            const target = document.querySelector("#messages");
            for (const kind of ["dragenter", "dragover", "drop"]) {
                const init = { bubbles: true, cancelable: true, dataTransfer: transfer };
                target.dispatchEvent(new DragEvent(kind, init));
            }
        }""",
        [name, mime_type, base64.b64encode(data).decode()],
    )


def record_reply_lengths(page: Page) -> None:
    """Note the length of the newest reply's text at every DOM change (streaming proof)."""
    page.evaluate(
        """() => {
            window.lengths = [];
            new MutationObserver(() => {
                const replies = document.querySelectorAll(".msg.reply");
                const last = replies[replies.length - 1];
                const text = last?.querySelector(".markdown")?.textContent;
                if (text != null) window.lengths.push(text.length);
            }).observe(document.querySelector("#messages"), { childList: true, subtree: true });
        }"""
    )


async def _rpc(port: int, token: str, method: str, params: dict[str, Any]) -> Any:
    url = f"ws://127.0.0.1:{port}/v1/rpc"
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        await ws.send_json({"type": "connect", "token": token})
        assert (await ws.receive_json())["type"] == "connected"
        await ws.send_json({"id": "1", "method": method, "params": params})
        while True:
            frame = await ws.receive_json()
            if frame.get("id") == "1":
                assert "result" in frame, frame
                return frame["result"]


async def _seed(port: int, token: str, sessions: int, exchanges: int) -> None:
    """`sessions` conversations; the first holds `exchanges` echo turns, one after another."""
    url = f"ws://127.0.0.1:{port}/v1/rpc"
    replies: dict[str, Any] = {}
    answered: set[str] = set()
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        await ws.send_json({"type": "connect", "token": token})
        assert (await ws.receive_json())["type"] == "connected"

        async def pump() -> None:
            frame = await ws.receive_json()
            if "id" in frame:
                replies[frame["id"]] = frame
            for entity in frame.get("update", {}).get("data_list", []):
                if entity.get("role") == "assistant" and entity["status"] == "completed":
                    answered.add(entity["id"])

        async def send(n: int, content: str, session: str = "") -> str:
            call_id = f"seed-{n}"
            params = {"content_data": content, "client_id": call_id, "server_session_id": session}
            await ws.send_json({"id": call_id, "method": "v1.message.send", "params": params})
            while call_id not in replies:
                await pump()
            return str(replies[call_id]["result"]["session_id"])

        session = ""
        for n in range(exchanges):
            session = await send(n, f"echo {n}", session)
            while len(answered) <= n:  # one turn after the other: none is merged
                await pump()
        for n in range(sessions - 1):
            await send(exchanges + n, "hi")


def rpc(server: ServerProcess, token: str, method: str, **params: Any) -> Any:
    """One RPC call from another client of the same user (in a thread: Playwright's sync
    API runs an event loop of its own in this one)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _rpc(server.port, token, method, params)).result()


# -- the page itself ------------------------------------------------------------------------


def test_page_and_assets_are_served_with_a_strict_policy(server: ServerProcess) -> None:
    require_tools()
    base = server.http_url
    with urllib.request.urlopen(base + "/") as response:
        html = response.read().decode()
        csp = response.headers["Content-Security-Policy"]
        assert response.headers["Content-Type"] == "text/html; charset=utf-8"
    assert "script-src 'self';" in csp
    assert "unsafe-inline" not in csp
    assert "unsafe-eval" not in csp
    assert "default-src 'none'" in csp
    # No inline script or style, no inline event handler: everything comes from /web/.
    assert not re.search(r"<script(?![^>]*\bsrc=)", html)
    assert not re.search(r"<style|\son[a-z]+=", html)
    types = {
        "app.js": "text/javascript; charset=utf-8",
        "portico.js": "text/javascript; charset=utf-8",
        "markdown.js": "text/javascript; charset=utf-8",
        "voice-worklet.js": "text/javascript; charset=utf-8",
        "style.css": "text/css; charset=utf-8",
        "favicon.svg": "image/svg+xml",
    }
    for name, content_type in types.items():
        with urllib.request.urlopen(f"{base}/web/{name}") as response:
            assert response.headers["Content-Type"] == content_type
            assert response.headers["X-Content-Type-Options"] == "nosniff"
    for missing in ("/web/nope.js", "/web/..%2Fapp.py", "/web/%2e%2e%2fconfig.py"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + missing)
        assert refused.value.code == 404


def test_main_flow_streams_tools_media_and_uploads(page: Page) -> None:
    record_reply_lengths(page)
    reply = ask(page, "hello")
    assert reply.locator(".markdown").inner_text() == GREETING
    lengths = page.evaluate("() => window.lengths")
    partial = {n for n in lengths if 0 < n < len(GREETING)}
    assert len(partial) >= 3, f"the reply arrived in one piece, not streamed: {lengths}"
    expect(page.locator("#mode")).to_have_attribute("data-mode", "live")
    expect(page.locator("#sessions li")).to_have_count(1)
    expect(page.locator("#sessions li .session-title")).to_have_text("hello")

    # A client tool: the card shows the agent's consent message and categories.
    send(page, "what time is it")
    card = page.locator(".msg.tool[data-name=get_time]")
    expect(card.locator(".consent")).to_have_text(
        "The demo agent wants to read your device's clock and time zone."
    )
    expect(card.locator(".category")).to_have_text(["time"])
    expect(card.locator(".tool-status")).to_have_text("Waiting for you")
    card.locator(".allow").click()
    expect(card).to_have_attribute("data-status", "completed")
    expect(page.locator(COMPLETED).last).to_contain_text("in the Europe/Paris time zone")

    # Media the agent sends: an image and a sound.
    picture = ask(page, "draw").locator("img.media")
    expect(picture).to_be_visible()
    assert picture.evaluate("(img) => img.decode().then(() => img.naturalWidth)") == 96
    # The sound is streamed: audio_start, binary OMNI frames, audio_end, played from a Blob.
    sound = ask(page, "beep").locator("audio.media")
    expect(sound).to_have_attribute("src", re.compile(r"^blob:"))
    duration = sound.evaluate(
        """(audio) => new Promise((resolve, reject) => {
            const ready = () => audio.play().then(() => resolve(audio.duration), reject);
            audio.readyState >= 1 ? ready() : audio.addEventListener("loadedmetadata", ready);
            audio.addEventListener("error", () => reject(new Error("audio failed to load")));
        })"""
    )
    assert duration == pytest.approx(0.5, abs=0.05)

    # An upload: dropped, previewed, attached to the next message, read by the agent.
    image = png(40, 30)
    drop_file(page, "pixel.png", "image/png", image)
    attachment = page.locator(".attachment")
    expect(attachment).to_have_attribute("data-status", "ready")
    expect(attachment.locator("img")).to_be_visible()
    reply = ask(page, "what is in this picture?")
    expect(reply).to_contain_text(
        f"I received pixel.png (image/png, {len(image)} bytes, 40×30 pixels)"
    )
    sent = page.locator(".msg.user").last
    expect(sent.locator("img.media")).to_be_visible()
    expect(sent.locator("figcaption")).to_have_text("pixel.png")
    expect(page.locator("#attachments > *")).to_have_count(0)

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": 1280, "height": 1500})  # the whole conversation
    page.screenshot(path=str(ARTIFACTS / "chat-page.png"))


def test_sidebar_and_history_are_read_in_pages(
    context: Any, proxy: TcpProxy, server: ServerProcess, token: str, errors: list[str]
) -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, _seed(server.port, token, sessions=23, exchanges=30)).result()
    page = context.new_page()
    watch(page, errors)
    page.goto(proxy.url)
    expect(page.locator("#sessions li")).to_have_count(20)
    page.locator("#more-sessions").click()
    expect(page.locator("#sessions li")).to_have_count(23)
    expect(page.locator("#more-sessions")).to_be_hidden()
    # The oldest conversation is last: 60 messages, more than one page of history.
    page.locator("#sessions li .session-title").last.click()
    expect(page.locator(COMPLETED)).to_have_count(30)
    assert texts(page)[:2] == ["echo 0", "0"]
    assert texts(page)[-2:] == ["echo 29", "29"]


def test_tool_calls_declined_and_answered(page: Page) -> None:
    send(page, "where am I")
    card = page.locator(".msg.tool[data-name=get_timezone]")
    expect(card.locator(".category")).to_have_text(["location"])
    card.locator(".decline").click()
    expect(card).to_have_attribute("data-status", "rejected")
    expect(card.locator(".tool-status")).to_have_text("Declined")
    expect(page.locator(COMPLETED).last).to_contain_text(
        "I won't look, then: get_timezone was not allowed (declined by the user)."
    )

    send(page, "ask me")
    card = page.locator(".msg.tool[data-name=ask_user]")
    card.locator("input.answer").fill("Ada")
    card.locator(".allow").click()
    expect(page.locator(COMPLETED)).to_have_count(2)
    expect(page.locator(COMPLETED).last).to_have_text("Nice to meet you, Ada!")


def test_rename_and_delete_from_the_sidebar(page: Page, server: ServerProcess, token: str) -> None:
    ask(page, "hello")
    item = page.locator("#sessions li")
    expect(item.locator(".session-title")).to_have_text("hello")
    item.locator(".rename").click()
    page.locator(".rename-input").fill("Renamed chat")
    page.locator(".rename-input").press("Enter")
    expect(item.locator(".session-title")).to_have_text("Renamed chat")
    expect(page.locator("#title")).to_have_text("Renamed chat")
    rpc_title = rpc(server, token, "v1.session.get", session_id=session_id(page))["title"]
    assert rpc_title == "Renamed chat"

    page.reload()
    expect(page.locator("#sessions li .session-title")).to_have_text("Renamed chat")

    page.locator("#sessions li .delete").click()
    page.locator("#sessions li .delete.confirm").click()
    expect(page.locator("#sessions li")).to_have_count(0)
    expect(page.locator("#title")).to_have_text("New conversation")
    page.reload()
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    expect(page.locator("#sessions li")).to_have_count(0)


def test_fork_from_a_message_then_continue_over_rpc(page: Page) -> None:
    ask(page, "echo first")
    ask(page, "echo second")
    original = session_id(page)
    page.locator(".msg.user").nth(1).locator(".fork").click()
    page.locator(".fork-input").fill("echo forked")
    page.locator(".fork-submit").click()
    expect(page).not_to_have_url(re.compile(re.escape(original)))
    expect(page.locator(COMPLETED)).to_have_count(2)
    assert texts(page) == ["echo first", "first", "echo forked", "forked"]
    expect(page.locator("#mode")).to_have_attribute("data-mode", "archive")
    expect(page.locator("#sessions li")).to_have_count(2)
    expect(page.locator("#sessions li.current .session-title")).to_have_text("echo first (fork)")

    # The fork is continued over RPC: message.send, live chunks, and an Rtc for the tool.
    ask(page, "echo more")
    expect(page.locator(COMPLETED).last).to_have_text("more")
    send(page, "what time is it")
    card = page.locator(".msg.tool[data-name=get_time]")
    card.locator(".allow").click()
    expect(card).to_have_attribute("data-status", "completed")
    expect(page.locator(COMPLETED).last).to_contain_text("Europe/Paris")

    page.locator(f"#sessions li[data-session-id={original}] .session-title").click()
    expect(page.locator(COMPLETED)).to_have_count(2)
    expect(page.locator(COMPLETED).last).to_have_text("second")


def test_reload_keeps_the_conversation_and_recovers_missed_updates(
    page: Page, server: ServerProcess, token: str
) -> None:
    ask(page, "hello")
    ask(page, "echo still here")
    before = texts(page)
    conversation = session_id(page)
    page.reload()
    expect(page.locator(COMPLETED)).to_have_count(2)
    assert texts(page) == before
    assert session_id(page) == conversation
    expect(page.locator("body")).to_have_attribute("data-recovered", "true")
    # The live session resumed: the conversation goes on over /v1/session.
    expect(page.locator("#mode")).to_have_attribute("data-mode", "live")
    expect(ask(page, "history")).to_have_text(
        "This session's archive holds 4 earlier messages before this one."
    )

    # Changed by another client while the page is away: replayed from the stored offset.
    url = page.url
    page.goto("about:blank")
    rpc(server, token, "v1.session.update", session_id=conversation, title="Renamed elsewhere")
    page.goto(url)
    expect(page.locator("body")).to_have_attribute("data-recovered", "true")
    expect(page.locator("#sessions li .session-title")).to_have_text("Renamed elsewhere")
    expect(page.locator(COMPLETED)).to_have_count(3)


def test_a_tool_call_waiting_for_the_user_survives_a_reload(page: Page) -> None:
    send(page, "what time is it")
    expect(page.locator(".msg.tool .allow")).to_be_visible()
    page.reload()
    # Rebuilt from the archive (the frame was handled before the reload); answered over
    # the resumed session.
    card = page.locator(".msg.tool[data-name=get_time]")
    expect(card.locator(".tool-status")).to_have_text("Waiting for you")
    expect(page.locator("#mode")).to_have_attribute("data-mode", "live")
    card.locator(".allow").click()
    expect(card).to_have_attribute("data-status", "completed")
    expect(page.locator(COMPLETED).last).to_contain_text("Europe/Paris")


def slow_reply_survives(page: Page, proxy: TcpProxy, fault: str) -> None:
    send(page, "slow")
    reply = page.locator(REPLIES).last
    expect(reply).to_contain_text("step 3 of 40")
    assert (proxy.cut_all() if fault == "cut" else proxy.freeze_all()) >= 2
    expect(page.locator("#connection")).not_to_have_attribute("data-reconnects", "0")
    expect(reply).to_have_attribute("data-status", "completed", timeout=20_000)
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    # Completed once: nothing lost, nothing doubled, one message, one reply.
    assert reply.locator(".markdown").inner_text() == SLOW_TEXT
    expect(page.locator(REPLIES)).to_have_count(1)
    expect(page.locator(".msg.user")).to_have_count(1)


def test_a_cut_connection_mid_reply_is_invisible(page: Page, proxy: TcpProxy) -> None:
    slow_reply_survives(page, proxy, "cut")
    page.reload()  # and the archive agrees
    expect(page.locator(COMPLETED)).to_have_count(1)
    assert page.locator(COMPLETED).inner_text() == SLOW_TEXT


def test_a_half_open_connection_is_found_by_heartbeats(page: Page, proxy: TcpProxy) -> None:
    slow_reply_survives(page, proxy, "freeze")


def test_a_server_restart_mid_reply_loses_nothing(page: Page, server: ServerProcess) -> None:
    send(page, "slow")
    reply = page.locator(REPLIES).last
    expect(reply).to_contain_text("step 3 of 40")
    server.restart()  # SIGTERM: the turn finishes and is archived while the server drains
    expect(reply).to_have_attribute("data-status", "completed", timeout=30_000)
    assert reply.locator(".markdown").inner_text() == SLOW_TEXT
    expect(page.locator(REPLIES)).to_have_count(1)
    # The new process cannot resume the session: the page continues the conversation.
    expect(page.locator("#notice")).to_have_text(
        "The server restarted: this conversation goes on.", timeout=30_000
    )
    expect(page.locator("#mode")).to_have_attribute("data-mode", "live")
    expect(ask(page, "echo after the restart")).to_have_text("after the restart")


def test_stop_button_interrupts_the_reply(page: Page) -> None:
    send(page, "slow")
    reply = page.locator(REPLIES).last
    expect(reply).to_contain_text("step 2 of 40")
    page.locator("#stop").click()
    expect(reply).to_have_attribute("data-status", "cancelled")
    expect(reply.locator(".meta")).to_have_text("stopped")
    expect(page.locator("#stop")).to_be_hidden()
    assert len(reply.locator(".markdown").inner_text()) < len(SLOW_TEXT)


def test_markdown_from_the_model_cannot_inject_html(page: Page, errors: list[str]) -> None:
    hostile = (
        "echo <img src=x onerror=alert(1)> **bold** [click](javascript:alert(1)) "
        "[site](https://example.org) `<b>code</b>`"
    )
    reply = ask(page, hostile)
    assert reply.locator("img").count() == 0
    assert reply.locator("b").count() == 0
    expect(reply.locator("strong")).to_have_text("bold")
    expect(reply.locator("code")).to_have_text("<b>code</b>")
    links = reply.locator("a")
    expect(links).to_have_count(1)
    expect(links).to_have_attribute("href", "https://example.org/")
    expect(reply).to_contain_text("<img src=x onerror=alert(1)>")


def test_second_tab_sees_the_conversation_through_updates(
    page: Page, context: Any, errors: list[str]
) -> None:
    other = context.new_page()
    watch(other, errors)
    other.goto(page.url)
    expect(other.locator("#connection")).to_have_attribute("data-state", "open")
    ask(page, "echo from the first tab")
    expect(other.locator("#sessions li")).to_have_count(1)
    other.locator("#sessions li .session-title").click()
    expect(other.locator(COMPLETED)).to_have_text(["from the first tab"])
    expect(other.locator("#mode")).to_have_attribute("data-mode", "archive")


def test_a_wrong_token_is_reported_and_can_be_replaced(page: Page, token: str) -> None:
    page.locator(".settings summary").click()
    page.locator("#token").fill("not-a-key")
    page.locator("#token-form button").click()
    expect(page.locator("#connection")).to_have_attribute("data-state", "offline")
    expect(page.locator("#notice")).to_contain_text("refused this API key")
    expect(page.locator(".settings")).to_have_attribute("open", "")  # where the key goes
    page.locator("#token").fill(token)
    page.locator("#token-form button").click()
    expect(page.locator("#connection")).to_have_attribute("data-state", "open")
    expect(ask(page, "echo signed in")).to_have_text("signed in")


# -- the archive tells the conversation as it happened ----------------------------------------


def shown_in_order(page: Page) -> list[str]:
    """The visible messages in page order: `kind: text` (a tool card: its name)."""
    return list(
        page.evaluate(
            """() => [...document.querySelectorAll("#messages > .msg")]
                .filter((el) => !el.hidden)
                .map((el) => {
                    if (el.classList.contains("tool")) return `tool: ${el.dataset.name}`;
                    const text = el.querySelector(".text, .markdown")?.textContent.trim();
                    return `${el.dataset.role}: ${text}`;
                })"""
        )
    )


def test_a_reloaded_tool_turn_reads_as_it_happened(page: Page) -> None:
    send(page, "what time is it")
    card = page.locator(".msg.tool[data-name=get_time]")
    card.locator(".allow").click()
    expect(page.locator(COMPLETED).last).to_contain_text("Europe/Paris")
    live = shown_in_order(page)
    assert live[1:3] == ["assistant: Let me ask your device for the time.", "tool: get_time"]
    assert live[3].startswith("assistant: Your device says it is")
    page.reload()
    expect(page.locator(COMPLETED).last).to_contain_text("Europe/Paris")
    # From the archive: the text before the call, the card, the text after, in that order,
    # and the card asks with the agent's own words (not the tool's description).
    assert shown_in_order(page) == live
    expect(card.locator(".consent")).to_have_text(
        "The demo agent wants to read your device's clock and time zone."
    )
    expect(card).to_have_attribute("data-status", "completed")


def play(audio: Any) -> float:
    """Play the element; its duration in seconds once it could."""
    return float(
        audio.evaluate(
            """(audio) => new Promise((resolve, reject) => {
                const ready = () => audio.play().then(() => resolve(audio.duration), reject);
                audio.readyState >= 1 ? ready() : audio.addEventListener("loadedmetadata", ready);
                audio.addEventListener("error", () => reject(new Error("audio failed to load")));
            })"""
        )
    )


def test_streamed_media_plays_after_a_reload_where_the_agent_made_it(page: Page) -> None:
    ask(page, "hello")
    ask(page, "beep")
    expect(page.locator(f"{COMPLETED} audio.media")).to_have_count(1)
    page.reload()
    expect(page.locator(COMPLETED)).to_have_count(2)
    # Archived through the media port with the reply it came with: the second one.
    expect(page.locator(COMPLETED).first.locator("audio.media")).to_have_count(0)
    sound = page.locator(COMPLETED).nth(1).locator("audio.media")
    expect(sound).to_have_attribute("src", re.compile(r"^blob:"))
    assert play(sound) == pytest.approx(0.5, abs=0.05)


def test_a_reload_mid_reply_shows_the_reply_so_far_then_continues(page: Page) -> None:
    send(page, "slow")
    reply = page.locator(REPLIES).last
    expect(reply).to_contain_text("step 3 of 40")
    # Every text the reply shows while it streams, from the reloaded page's first render.
    page.add_init_script(
        """window.addEventListener("DOMContentLoaded", () => {
            window.streamedTexts = [];
            new MutationObserver(() => {
                for (const el of document.querySelectorAll(".msg.reply[data-status=streaming]"))
                    window.streamedTexts.push(el.querySelector(".markdown")?.textContent ?? "");
            }).observe(document.querySelector("#messages"), {
                childList: true, subtree: true, attributes: true, characterData: true,
            });
        })"""
    )
    page.reload()
    expect(reply).to_have_attribute("data-status", "completed", timeout=20_000)
    assert reply.locator(".markdown").inner_text() == SLOW_TEXT
    expect(page.locator(REPLIES)).to_have_count(1)
    streamed = [text for text in page.evaluate("() => window.streamedTexts") if text]
    assert streamed, "the reloaded page never showed the reply streaming"
    # From its first words on, while it still streamed: the first steps were not missing.
    assert streamed[0].startswith("step 1 of 40, step 2 of 40, step 3 of 40,"), streamed[0]
    assert all(SLOW_TEXT.startswith(text) for text in streamed)
