"""The `demo` runtime: a friendly built-in agent that needs no model.

It streams its replies word by word so a newcomer sees streaming at once, and
answers a few keywords that show what Portico does (listed in the README):
client-side tool calls with a consent prompt, image and audio replies, and
attachments read back through the media port.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import re
import struct
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from portico.domain.model import ContentPart, MediaContent, message_text, new_id
from portico.errors import PorticoError
from portico.runtime.base import (
    Chunk,
    Done,
    MediaChunk,
    ToolCall,
    ToolOutcome,
    TurnInput,
    TurnStream,
)

GREETING = (
    "Hello! I'm the Portico demo agent. I run inside the server, so you can try "
    "Portico without a model. Every reply streams to you word by word, and every "
    "conversation is archived: reconnect with the same session_id and I remember "
    "what you said. Try: help, what time is it, draw, beep, echo <text>, history, or slow."
)
HELP = (
    "Things to try: `what time is it` and `where am I` ask your client for its clock "
    "or time zone (a client-side tool call that you allow or decline); `ask me` has "
    "your client prompt you for an answer; `draw` replies with a picture and `beep` "
    "with a sound; attach a file and I describe what reached me; `echo <text>` repeats "
    "your text; `history` counts this session's messages from the archive; `slow` "
    "streams a long answer slowly (good for testing disconnects: the reply is archived "
    "even if you leave); anything else gets a short reply."
)
SLOW_TEXT = " ".join(f"step {n} of 40," for n in range(1, 41)) + " done."
PICTURE_TEXT = "Here is a picture I drew for you, sent as an image part of my reply."
SOUND_TEXT = "Here is a short sound, streamed to you as audio: press play."
SOUND_CHUNK_BYTES = 2048  # the chime streams in several chunks, as a voice agent's audio would


class DemoTool:
    """A client-side tool the demo agent asks for, and how it words the answer."""

    def __init__(
        self,
        name: str,
        *,
        consent_message: str,
        categories: tuple[str, ...],
        arguments: dict[str, Any] | None = None,
        describe: Callable[[Any], str],
        preamble: str = "",
    ) -> None:
        self.name = name
        self.consent_message = consent_message
        self.categories = categories
        self.arguments = dict(arguments or {})
        self.describe = describe
        self.preamble = preamble  # said before the call: the archive keeps it before the card


def _field(result: Any, *keys: str) -> str | None:
    if isinstance(result, dict):
        for key in keys:
            value = result.get(key)
            if isinstance(value, str) and value:
                return value
    return None


def _describe_time(result: Any) -> str:
    if isinstance(result, str):
        return f"Your device says it is {result}."
    time, zone = _field(result, "time", "iso"), _field(result, "time_zone", "timezone", "name")
    if time is None:
        return f"Your device answered {_compact(result)}."
    return f"Your device says it is {time}" + (f" in the {zone} time zone." if zone else ".")


def _describe_zone(result: Any) -> str:
    zone = result if isinstance(result, str) else _field(result, "time_zone", "timezone", "name")
    if zone is None:
        return f"Your device answered {_compact(result)}."
    place = zone.rsplit("/", 1)[-1].replace("_", " ")
    if "/" not in zone or place == zone:
        return f"Your time zone is {zone}; that's all I know about where you are."
    return f"Your time zone is {zone}, so my guess is that you are somewhere near {place}."


def _describe_answer(result: Any) -> str:
    answer = result if isinstance(result, str) else _field(result, "answer", "text")
    if not answer:
        return "You left the answer empty. That's fine too."
    return f"Nice to meet you, {answer}!"


TOOLS = {
    "time": DemoTool(
        "get_time",
        consent_message="The demo agent wants to read your device's clock and time zone.",
        categories=("time",),
        describe=_describe_time,
        preamble="Let me ask your device for the time.",
    ),
    "zone": DemoTool(
        "get_timezone",
        consent_message="The demo agent wants your time zone, which tells roughly where you are.",
        categories=("location",),
        describe=_describe_zone,
    ),
    "ask": DemoTool(
        "ask_user",
        consent_message="The demo agent wants to ask you a question.",
        categories=("prompt",),
        arguments={"question": "What should I call you?"},
        describe=_describe_answer,
    ),
}
_TIME = re.compile(r"\b(what time|time is it|the time|clock)\b")
_ZONE = re.compile(r"\b(where am i|time ?zone)\b")
_ASK = re.compile(r"\bask me\b")
_DRAW = re.compile(r"\b(draw|picture|paint)\b")
_SOUND = re.compile(r"\b(beep|sound|audio)\b")


def _compact(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)[:200]
    except (TypeError, ValueError):
        return repr(value)[:200]


def _tool_for(lowered: str) -> DemoTool | None:
    if _TIME.search(lowered):
        return TOOLS["time"]
    if _ZONE.search(lowered):
        return TOOLS["zone"]
    if _ASK.search(lowered):
        return TOOLS["ask"]
    return None


def tool_answer(tool: DemoTool, outcome: ToolOutcome | None) -> str:
    """The reply once the client answered (or did not answer) the tool call."""
    if outcome is None:
        return f"I asked for `{tool.name}` but got no answer."
    if outcome.status == "completed":
        return tool.describe(outcome.result)
    reason = outcome.error or "no reason given"
    if outcome.status == "error":
        return f"Your client tried `{tool.name}` but it failed: {reason}."
    return f"I won't look, then: `{tool.name}` was not allowed ({reason})."


# -- generated media ------------------------------------------------------------------------


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)


def picture_png(size: int = 96) -> bytes:
    """A small generated PNG: an arch (Portico's) in front of a sunset gradient."""
    rows = []
    centre, outer, inner = (size - 1) / 2, size * 0.36, size * 0.22
    for y in range(size):
        row = bytearray(b"\x00")  # filter type 0 (None) for every scanline
        for x in range(size):
            t = y / (size - 1)
            r, g, b = int(250 - 120 * t), int(170 - 110 * t), int(90 + 120 * t)
            dx, dy = x - centre, y - size * 0.62
            distance = math.hypot(dx, dy)
            in_arch = (dy < 0 and inner <= distance <= outer) or (
                dy >= 0 and inner <= abs(dx) <= outer and y < size * 0.9
            )
            if in_arch:
                r, g, b = 38, 52, 82
            if y >= size * 0.9:
                r, g, b = 60, 70, 60
            row += bytes((r, g, b))
        rows.append(bytes(row))
    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(b"".join(rows), 9))
        + _png_chunk(b"IEND", b"")
    )


SAMPLE_RATE = 8000


def chime_wav(duration: float = 0.5) -> bytes:
    """A short generated two-note chime: 16-bit mono PCM in a WAV container."""
    frames = int(SAMPLE_RATE * duration)
    half = frames // 2
    samples = bytearray()
    for n in range(frames):
        frequency = 660.0 if n < half else 880.0
        local = n % half
        envelope = min(1.0, local / 80) * (1.0 - local / half)  # quick attack, linear fade
        value = int(12000 * envelope * math.sin(2 * math.pi * frequency * n / SAMPLE_RATE))
        samples += struct.pack("<h", value)
    data = bytes(samples)
    header = b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE"
    fmt = b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, SAMPLE_RATE, SAMPLE_RATE * 2, 2, 16)
    return header + fmt + b"data" + struct.pack("<I", len(data)) + data


def sound_chunks() -> list[MediaChunk]:
    """The chime as streamed media: one item (one media id), several chunks."""
    data = chime_wav()
    media_id = new_id("snd")[-12:]  # an OMNI MediaID is at most 12 bytes
    starts = range(0, len(data), SOUND_CHUNK_BYTES)
    return [
        MediaChunk(
            media_id=media_id,
            mime_type="audio/wav",
            data=data[start : start + SOUND_CHUNK_BYTES],
            sequence=index,
            is_last=index == len(starts) - 1,
        )
        for index, start in enumerate(starts)
    ]


def picture_part() -> ContentPart:
    data = picture_png()
    media = MediaContent(
        mime_type="image/png",
        data=base64.b64encode(data).decode(),
        filename="portico-demo.png",
        size_bytes=len(data),
        width=96,
        height=96,
    )
    return ContentPart(type="image", media=media)


def sound_part() -> ContentPart:
    data = chime_wav()
    media = MediaContent(
        mime_type="audio/wav",
        data=base64.b64encode(data).decode(),
        filename="portico-chime.wav",
        size_bytes=len(data),
        duration_ms=500,
        sample_rate=SAMPLE_RATE,
        channels=1,
    )
    return ContentPart(type="audio", media=media)


# -- attachments ------------------------------------------------------------------------------


def image_size(data: bytes) -> tuple[int, int] | None:
    """Width and height of a PNG or GIF, read from its header; None for anything else."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return int(width), int(height)
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        width, height = struct.unpack("<HH", data[6:10])
        return int(width), int(height)
    return None


async def describe_attachments(turn: TurnInput) -> str | None:
    """One sentence per media part of the user's message, as the agent read it."""
    parts = [part for part in turn.message.parts if part.media is not None]
    if not parts:
        return None
    lines = []
    for part in parts:
        media = part.media
        assert media is not None
        article = "an" if part.type[0] in "aeiou" else "a"
        name = f"`{media.filename}`" if media.filename else f"{article} {part.type}"
        try:
            data = await turn.read_media(media)
        except PorticoError as exc:
            lines.append(f"I could not read {name}: {exc.message}.")
            continue
        size = image_size(data)
        shape = f", {size[0]}×{size[1]} pixels" if size else ""
        lines.append(f"I received {name} ({media.mime_type}, {len(data)} bytes{shape}).")
    return " ".join(lines) + " Attachments reach me through Portico's media store."


# -- replies ----------------------------------------------------------------------------------


async def _reply_for(text: str, turn: TurnInput) -> tuple[str, float]:
    """The reply and the delay factor for one user message."""
    lowered = text.strip().lower()
    if lowered in {"", "hi", "hello", "hey"} or re.fullmatch(r"(hi|hello|hey)\W*", lowered):
        return GREETING, 1.0
    if lowered == "help":
        return HELP, 1.0
    if lowered.startswith("echo "):
        return text.strip()[5:], 1.0
    if lowered == "history":
        earlier = len(await turn.history())
        return f"This session's archive holds {earlier} earlier messages before this one.", 1.0
    if lowered == "slow":
        return SLOW_TEXT, 5.0
    words = len(text.split())
    return (
        f"You said {words} word{'s' if words != 1 else ''}. I'm a demo agent without a "
        "model, so I can't really answer, but Portico is streaming this reply to you "
        "token by token. Type `help` to see what I can show you.",
        1.0,
    )


def _offered(turn: TurnInput, name: str) -> bool:
    """A client that declared tools gets calls only for those; one that could not declare
    any (`/ws`, `/v1/rpc`) gets the call and may answer it."""
    return not turn.client_tools or any(tool.name == name for tool in turn.client_tools)


class DemoRuntime:
    def __init__(self, *, word_delay: float = 0.03) -> None:
        self._word_delay = word_delay

    async def _stream(self, text: str, slowness: float = 1.0) -> AsyncIterator[Chunk]:
        words = text.split(" ")
        for index, word in enumerate(words):
            yield Chunk(word if index == len(words) - 1 else word + " ")
            if self._word_delay:
                await asyncio.sleep(self._word_delay * slowness)

    async def run(self, turn: TurnInput) -> TurnStream:
        text = message_text(turn.message)
        lowered = text.strip().lower()
        attachments = await describe_attachments(turn)
        tool = None if attachments else _tool_for(lowered)
        parts: tuple[ContentPart, ...] | None = None
        media: list[MediaChunk] = []
        if attachments is not None:
            reply, slowness = attachments, 1.0
        elif tool is not None:
            if not _offered(turn, tool.name):
                offered = ", ".join(t.name for t in turn.client_tools)
                reply = f"I'd ask your client for `{tool.name}`, but it only offers: {offered}."
            else:
                if tool.preamble:
                    async for chunk in self._stream(tool.preamble):
                        yield chunk
                    yield Chunk(" ")  # the answer after the call is a sentence of its own
                outcome = yield ToolCall(
                    id=new_id("call"),
                    name=tool.name,
                    arguments=tool.arguments,
                    consent_message=tool.consent_message,
                    categories=tool.categories,
                )
                reply = tool_answer(tool, outcome)
            slowness = 1.0
        elif _DRAW.search(lowered):
            reply, slowness, parts = PICTURE_TEXT, 1.0, (picture_part(),)
        elif _SOUND.search(lowered):
            # Streamed, not a `done` part: a client with the `audio` capability of
            # /v1/session plays it; other protocols get it as their media chunks.
            reply, slowness, media = SOUND_TEXT, 1.0, sound_chunks()
        else:
            reply, slowness = await _reply_for(text, turn)
        async for chunk in self._stream(reply, slowness):
            yield chunk
        for piece in media:
            yield piece
        yield Done(parts=parts)
