"""A small bounded benchmark of the embedded voice agent's speech work (one core).

Per demo phrase: recognition latency and real-time factor (CPU seconds per second of
audio), and synthesis time of the reply. The number of concurrent calls one core
carries is estimated from the CPU spent per second of a call's audio.

    .venv/bin/python bench/voice_embedded.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from portico.runtime.duplex.embedded import demo_reply
from portico.voice import SAMPLE_RATE
from portico.voice.phrases import DEMO_PHRASES
from portico.voice.recognizer import PocketSphinxRecognizer
from portico.voice.synthesizer import EspeakSynthesizer
from support.duplex_runtimes_embedded import spoken, start_of

SPOKEN = ("hello", "where am i", "draw a picture", "history", "beep")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    rounds = max(1, min(parser.parse_args().rounds, 20))  # bounded
    started = time.process_time()
    recognizer = PocketSphinxRecognizer(DEMO_PHRASES)
    print(f"decoder setup: {time.process_time() - started:.3f} s CPU")
    synthesizer = EspeakSynthesizer()
    audio_seconds = cpu_seconds = 0.0
    for phrase in SPOKEN:
        pcm = spoken(phrase)
        seconds = len(pcm) / 2 / SAMPLE_RATE
        wall = time.perf_counter()
        cpu = time.process_time()
        for _ in range(rounds):
            heard = recognizer.recognize(pcm)
        cpu_used = (time.process_time() - cpu) / rounds
        latency = (time.perf_counter() - wall) / rounds
        reply = asyncio.run(demo_reply(heard, start_of()))
        wall = time.perf_counter()
        speech = synthesizer.synthesize(reply)
        synth = time.perf_counter() - wall  # mostly the espeak-ng child's CPU
        reply_seconds = len(speech) / 2 / SAMPLE_RATE
        audio_seconds += seconds + reply_seconds
        cpu_seconds += cpu_used + synth
        print(
            f"{phrase!r:18} heard {heard!r:18} audio {seconds:4.2f} s  recognise "
            f"{latency * 1000:6.1f} ms (RTF {cpu_used / seconds:.3f})  synthesise "
            f"{reply_seconds:5.2f} s of speech in {synth * 1000:6.1f} ms"
        )
    print(
        f"CPU per second of call audio: {cpu_seconds / audio_seconds:.3f} s -> about "
        f"{int(audio_seconds / cpu_seconds)} concurrent calls per core (speech work only)"
    )


if __name__ == "__main__":
    main()
