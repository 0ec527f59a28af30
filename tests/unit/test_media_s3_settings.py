"""`media: s3` settings: what is refused at start, and what the page's CSP lets through."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from portico.config import Settings
from portico.errors import ConfigError
from portico.server.app import add_page_routes


@pytest.mark.parametrize("name", ["s3_endpoint_url", "s3_public_url"])
def test_object_storage_urls_must_be_http(name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings(media="s3", **{name: "seaweedfs:8333"}).check_startable()
    Settings(media="s3", **{name: "http://seaweedfs:8333"}).check_startable()


@pytest.mark.parametrize(
    ("settings", "origin"),
    [
        ({"s3_endpoint_url": "http://seaweedfs:8333"}, "http://seaweedfs:8333"),
        (
            {"s3_endpoint_url": "http://seaweedfs:8333", "s3_public_url": "https://media.example"},
            "https://media.example",
        ),
        ({}, "https://*.amazonaws.com"),
    ],
)
async def test_the_page_may_reach_the_bucket(settings: dict[str, str], origin: str) -> None:
    """The page PUTs uploads to the bucket and follows downloads there: connect-src."""
    for media, allowed in (("s3", True), ("local", False)):
        app = web.Application()
        add_page_routes(app, Settings(media=media, **settings))  # type: ignore[arg-type]
        async with TestClient(TestServer(app)) as client:
            response = await client.get("/")
            policy = response.headers["Content-Security-Policy"]
        connect = next(part for part in policy.split("; ") if part.startswith("connect-src"))
        assert (origin in connect.split()) is allowed, connect
