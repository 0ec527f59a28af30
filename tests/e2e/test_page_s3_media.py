"""The chat page's upload and media display with `media: s3`: the page PUTs the file to
a presigned bucket URL, confirms it with `POST /media/confirm-upload/{id}`, and shows
media through the download route's `307` to the bucket (docs/storage.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from e2e.harness import USERS, WORD_DELAY, require_tools
from e2e.test_chat_page import ask, drop_file, png
from support.seaweed import ACCESS_KEY, SECRET_KEY, Seaweed
from support.server import ServerProcess

try:
    from playwright.sync_api import Page, expect
except ImportError:  # reported by the fixtures: skipped locally, a failure in CI
    from typing import Any

    Page = Any  # type: ignore[misc,assignment]

pytest.importorskip("aiobotocore")
BUCKET = "portico-page"


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    require_tools()
    store = Seaweed(Path(tmp_path_factory.mktemp("seaweed")))
    store.start()
    yield store
    store.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, seaweed: Seaweed) -> Iterator[ServerProcess]:
    """The demo agent with API keys, its media in a SeaweedFS bucket."""
    data_dir = tmp_path_factory.mktemp("portico-e2e-s3")
    config = data_dir / "portico.yaml"
    keys = {f"key-{n}": f"user-{n}" for n in range(USERS)}
    config.write_text(yaml.safe_dump({"auth": "apikey", "api_keys": keys, "runtime": "demo"}))
    process = ServerProcess(
        data_dir,
        args=("--config", str(config)),
        env={
            "PORTICO_DEMO_WORD_DELAY": str(WORD_DELAY),
            "PORTICO_MEDIA": "s3",
            "PORTICO_S3_ENDPOINT_URL": seaweed.endpoint_url,
            "PORTICO_S3_BUCKET": BUCKET,
            "PORTICO_S3_ACCESS_KEY_ID": ACCESS_KEY,
            "PORTICO_S3_SECRET_ACCESS_KEY": SECRET_KEY,
        },
    ).start()
    yield process
    process.stop()


def test_an_upload_goes_to_the_bucket_and_is_shown(page: Page) -> None:
    confirms: list[str] = []
    page.on(
        "request",
        lambda request: (
            confirms.append(request.url) if "/media/confirm-upload/" in request.url else None
        ),
    )
    image = png(40, 30)
    drop_file(page, "pixel.png", "image/png", image)
    attachment = page.locator(".attachment")
    expect(attachment).to_have_attribute("data-status", "ready")
    reply = ask(page, "what is in this picture?")
    expect(reply).to_contain_text(
        f"I received pixel.png (image/png, {len(image)} bytes, 40×30 pixels)"
    )
    assert len(confirms) == 1, confirms
    # The sent message shows the uploaded image.
    sent = page.locator(".msg.user").last
    picture = sent.locator("img.media")
    expect(picture).to_be_visible()
    assert picture.evaluate("(img) => img.decode().then(() => img.naturalWidth)") == 40
