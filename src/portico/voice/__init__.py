"""Offline speech for the embedded voice agent: VAD, recognition, synthesis.

Every piece ships its model inside a package (webrtcvad-wheels, pocketsphinx's
English model, Debian's espeak-ng), so a bare machine can be spoken to. The
libraries are the optional extra `portico[voice]`; this package imports them only
inside the functions that need them."""

from __future__ import annotations

from portico.errors import VoiceUnavailable

SAMPLE_RATE = 16000  # what webrtcvad and pocketsphinx's default model hear
FRAME_MS = 20
FRAME_BYTES = SAMPLE_RATE * FRAME_MS // 1000 * 2  # pcm16 mono

INSTALL_HINT = "the embedded voice agent needs its speech packages: pip install 'portico[voice]'"

__all__ = ["FRAME_BYTES", "FRAME_MS", "INSTALL_HINT", "SAMPLE_RATE", "VoiceUnavailable"]
