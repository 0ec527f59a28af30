"""Fixtures shared by the integration tests that need the fake model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import support.fuzzing  # noqa: F401  (Hypothesis settings, see the module)
from support.fake_openai import FakeOpenAI


@pytest.fixture(scope="module")
def fake_model() -> Iterator[FakeOpenAI]:
    """One fake OpenAI-compatible server (real HTTP and SSE) per test module."""
    fake = FakeOpenAI().start()
    yield fake
    fake.stop()
