"""Fixtures shared by unit tests that need a real HTTP peer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import support.fuzzing  # noqa: F401  (Hypothesis settings, see the module)
from support.fake_openai import FakeOpenAI


@pytest.fixture(scope="module")
def fake_openai_server() -> Iterator[FakeOpenAI]:
    """One fake OpenAI-compatible server (real HTTP and SSE) per test module."""
    fake = FakeOpenAI().start()
    yield fake
    fake.stop()


@pytest.fixture
def fake(fake_openai_server: FakeOpenAI) -> FakeOpenAI:
    """The module's fake server, its script and recorded requests cleared."""
    fake_openai_server.reset()
    return fake_openai_server
