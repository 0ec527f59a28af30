"""What the embedded voice agent can hear: the demo agent's spoken keywords.

A closed list keeps pocketsphinx accurate and fast; words outside it are heard as
the nearest phrase or not at all (docs/voice-embedded.md)."""

from __future__ import annotations

DEMO_PHRASES = (
    "hello",
    "help",
    "what time is it",
    "where am i",
    "ask me",
    "draw a picture",
    "beep",
    "history",
    "slow",
)
