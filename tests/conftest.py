"""Settings for every suite."""

from __future__ import annotations

from hypothesis import settings

# The fuzzers look for crashes and broken rules, not for speed: Hypothesis's per-example
# deadline (200 ms) only measures how busy this shared 2-core machine is (a fuzz test
# failed CI at 486 ms for one example under load). Timing belongs in bench/.
settings.register_profile("portico", deadline=None)
settings.load_profile("portico")
