"""The page's microphone (docs/web.md, "Voice"): a spoken conversation with the embedded
voice agent, end to end, in Chromium.

Chromium's fake capture device plays a WAV file made here with espeak-ng: "hello", then
silence, looped by Chromium. The page captures it (getUserMedia, the AudioWorklet
resampling to the call's format), sends it as binary OMNI frames on its own `/ws`
connection (authenticated: the server runs with API keys), and the demo agent's embedded
runtime recognises "hello" and answers with its greeting, spoken (about 20 s of speech).
The file's next "hello" comes while the agent still speaks: barge-in. So one call shows
the caller's transcript, the reply's audio played through Web Audio, and an `interrupt`
stopping the playback that was queued.

A scripted duplex agent (docs/voice.md) that counter-offers 24 kHz checks the format
negotiation: the page's first frame proposes 16 kHz, the worklet resamples to 24 kHz once
`session_config` says so.
"""

from __future__ import annotations

import json
import re
import struct
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness import ARTIFACTS, CHROMIUM, USERS, TcpProxy, require_tools, watch
from support.duplex_runtimes_embedded import spoken
from support.server import FIXTURES, SCRIPT, ServerProcess

SAMPLE_RATE = 16_000  # what `spoken` makes
LOOP_SILENCE_MS = 3_500  # after "hello": the agent has started its reply when the loop repeats
CALL_TIMEOUT = 60_000  # ms: the embedded agent's decoder setup and recognition, on a busy machine


def caller_wav(path: Path) -> Path:
    """ "hello" by the test caller's voice, with silence after it: one loop of the mic."""
    pytest.importorskip("pocketsphinx")
    pcm = spoken("hello", pad_ms=300) + bytes(2 * SAMPLE_RATE * LOOP_SILENCE_MS // 1000)
    with wave.open(str(path), "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(SAMPLE_RATE)
        writer.writeframes(pcm)
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Chromium whose microphone is the WAV file (and asks nobody for permission)."""
    require_tools()
    from playwright.sync_api import sync_playwright

    wav = caller_wav(tmp_path_factory.mktemp("voice") / "hello.wav")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=[
                "--autoplay-policy=no-user-gesture-required",
                "--use-fake-device-for-media-stream",
                "--use-fake-ui-for-media-stream",
                f"--use-file-for-fake-audio-capture={wav}",
            ],
        )
        yield chromium
        chromium.close()


def number(page: Any, attribute: str) -> int:
    return int(page.locator("#voice").get_attribute(f"data-{attribute}") or 0)


def wait_for(page: Any, attribute: str, minimum: int) -> None:
    page.wait_for_function(
        "([name, minimum]) => Number(document.getElementById('voice').dataset[name]) >= minimum",
        arg=[attribute, minimum],
        timeout=CALL_TIMEOUT,
    )


def wait_for_heard(page: Any, minimum: int) -> None:
    """At least `minimum` of the caller's voice lines read "hello" (the file loops: more
    keep coming, so an exact count would race)."""
    page.wait_for_function(
        """(minimum) => [...document.querySelectorAll(
             '.msg[data-source="voice"][data-role="user"] .text')]
           .filter((line) => line.textContent === "hello").length >= minimum""",
        arg=minimum,
        timeout=CALL_TIMEOUT,
    )


def test_the_page_speaks_with_the_embedded_agent(page: Any) -> None:
    from playwright.sync_api import expect

    page.context.grant_permissions(["microphone"])
    page.locator("#mic").click()
    expect(page.locator("#mic")).to_have_attribute("aria-pressed", "true")
    voice = page.locator("#voice")
    expect(voice).to_have_attribute("data-state", "listening", timeout=CALL_TIMEOUT)

    users = page.locator('.msg[data-source="voice"][data-role="user"]')
    heard = users.filter(has=page.locator(".text", has_text=re.compile("^hello$")))
    expect(heard.first).to_be_visible(timeout=CALL_TIMEOUT)
    replies = page.locator('.msg[data-source="voice"][data-role="assistant"]')
    greeting = replies.filter(has_text="Portico demo agent")
    expect(greeting.first).to_be_visible(timeout=CALL_TIMEOUT)
    wait_for(page, "playedSamples", 1)  # reply audio went through Web Audio
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "voice-page.png"))

    # The looped "hello" talks over the greeting: the server's interrupt stops the audio
    # that was queued at once (cut samples) and the cut reply says so.
    wait_for(page, "interrupts", 1)
    assert number(page, "cut-samples") > 0
    cut = page.locator('.msg[data-source="voice"][data-status="cancelled"]')
    expect(cut.first.locator(".meta")).to_have_text("stopped")
    wait_for_heard(page, 2)  # the words that barged in were heard too
    page.screenshot(path=str(ARTIFACTS / "voice-page-barge-in.png"))

    page.locator("#voice-stop").click()
    expect(voice).to_have_attribute("data-state", "ended")
    expect(page.locator("#mic")).to_have_attribute("aria-pressed", "false")
    # The call was archived turn by turn: the page now shows that conversation.
    session = voice.get_attribute("data-session")
    assert session
    page.wait_for_function("(id) => location.hash === `#s=${id}`", arg=session)
    archived = page.locator('.msg[data-role="user"][data-source="voice"] .text').first
    expect(archived).to_have_text("hello")


def test_a_dropped_call_is_resumed(page: Any, proxy: TcpProxy) -> None:
    """A network drop mid-call: the page reconnects with `?resume=` within the grace
    window, the server hands the parked call over, and the conversation goes on."""
    from playwright.sync_api import expect

    page.context.grant_permissions(["microphone"])
    page.locator("#mic").click()
    voice = page.locator("#voice")
    users = page.locator('.msg[data-source="voice"][data-role="user"]')
    expect(users.first).to_be_visible(timeout=CALL_TIMEOUT)
    session = voice.get_attribute("data-session")

    assert proxy.cut_all() > 0
    wait_for(page, "resumes", 1)
    assert voice.get_attribute("data-session") == session
    before = users.count()
    page.wait_for_function(  # heard after the resume: the call went on
        """(before) => document.querySelectorAll(
             '.msg[data-source="voice"][data-role="user"]').length > before""",
        arg=before,
        timeout=CALL_TIMEOUT,
    )
    page.locator("#mic").click()  # the same button ends the call
    expect(voice).to_have_attribute("data-state", "ended")


# Speaks 8 s of tone once an utterance ends (200 ms of silence after speech): the next
# loop's "hello" talks over it.
STORY = {
    "format": {"codec": "pcm16", "sample_rate": 24000, "channels": 1},
    "turns": [
        {"after_silence_frames": 10, "transcript": "tell me a story"}
        | {"reply": "Once upon a time", "tone_ms": 8000}
    ],
}


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("voice-scripted")
    story = data_dir / "story.yaml"
    story.write_text(yaml.safe_dump(STORY))
    config = data_dir / "portico.yaml"
    agent = {"runtime": "scripted", "script": str(SCRIPT)}
    voice_agent = agent | {"duplex_runtime": "scripted", "duplex_script": str(story)}
    settings = {
        "auth": "apikey",
        "api_keys": {f"key-{n}": f"user-{n}" for n in range(USERS)},
        **agent,
        "agents": {
            "story": voice_agent,
            "failing": voice_agent | {"duplex_script": str(FIXTURES / "voice_fail.yaml")},
        },
    }
    config.write_text(yaml.safe_dump(settings))
    process = ServerProcess(data_dir, args=("--config", str(config))).start()
    yield process
    process.stop()


def omni_frame(payload: bytes) -> tuple[dict[str, Any], int]:
    """An OMNI frame's metadata and payload length."""
    metadata_length, payload_length = struct.unpack(">II", payload[8:16])
    metadata = json.loads(payload[32 : 32 + metadata_length])
    return metadata, payload_length


def test_the_page_captures_at_the_format_the_agent_negotiates(
    context: Any, scripted_server: ServerProcess, errors: list[str]
) -> None:
    from playwright.sync_api import expect

    tab = context.new_page()
    watch(tab, errors)
    sent: list[bytes] = []
    tab.on(
        "websocket",
        lambda ws: ws.on(
            "framesent", lambda frame: sent.append(frame) if isinstance(frame, bytes) else None
        ),
    )
    tab.goto(scripted_server.http_url + "/?agent=story")
    context.grant_permissions(["microphone"])
    tab.locator("#mic").click()
    story = tab.locator('.msg[data-source="voice"][data-role="user"] .text').first
    expect(story).to_have_text("tell me a story", timeout=CALL_TIMEOUT)
    expect(tab.locator('.msg[data-source="voice"][data-role="assistant"]').first).to_contain_text(
        "Once upon a time"
    )
    wait_for(tab, "playedSamples", 1)
    wait_for(tab, "interrupts", 1)  # the next "hello" talks over the tone
    assert number(tab, "cut-samples") > 0

    first, first_length = omni_frame(sent[0])
    assert (first["codec"], first["sample_rate"], first["channels"]) == ("pcm16", 16000, 1)
    assert first_length == 640  # 20 ms at 16 kHz, pcm16 mono
    lengths = {omni_frame(frame)[1] for frame in sent[1:]}
    assert 960 in lengths  # 20 ms at 24 kHz: resampled to what session_config said
    assert all("sample_rate" not in omni_frame(frame)[0] for frame in sent[1:])
    tab.locator("#voice-stop").click()
    expect(tab.locator("#voice")).to_have_attribute("data-state", "ended")
    assert not errors, errors


def test_a_failed_call_says_why_and_frees_the_page(
    context: Any, scripted_server: ServerProcess, errors: list[str]
) -> None:
    """The runtime fails on the first utterance: one DUPLEX_ERROR, shown in the bar; the
    page hangs up, and the message box works again."""
    from playwright.sync_api import expect

    tab = context.new_page()
    watch(tab, errors)
    tab.goto(scripted_server.http_url + "/?agent=failing")
    context.grant_permissions(["microphone"])
    tab.locator("#mic").click()
    voice = tab.locator("#voice")
    expect(voice).to_have_attribute("data-state", "failed", timeout=CALL_TIMEOUT)
    expect(tab.locator("#voice-status")).to_have_text("Call failed: the voice model is unavailable")
    expect(tab.locator("#voice-stop")).to_be_hidden()
    expect(tab.locator("#mic")).to_have_attribute("aria-pressed", "false")
    expect(tab.locator("#input")).to_be_enabled()
    assert not errors, errors
