"""Hypothesis settings for every suite that fuzzes (imported by their conftest.py).

The fuzzers look for crashes and broken rules, not for speed: Hypothesis's per-example
deadline (200 ms) only measures how busy this shared 2-core machine is (a fuzz test
failed once at 486 ms for one example under load). Timing belongs in bench/."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("portico", deadline=None)
settings.load_profile("portico")
