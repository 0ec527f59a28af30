"""The server→client half of the `audio` capability, sans-I/O.

The agent's media chunks (`MediaChunk`: audio, or images) become *items*: a
numbered `audio_start`, one binary OMNI frame per chunk (MediaID = the item id,
Sequence = the chunk's index in the item, metadata on the first frame only,
IsLast on the last), and a numbered `audio_end`. The control messages are
resent across drops; binary frames are not, so an item never spans two
connections: when the connection changes, every open item ends `lost` and the
agent's next chunk starts a new item with a new id (spec: "Audio in flight
during a drop is lost; the agent's next audio starts a new item").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from portico.protocols.omnia.binary import BinaryFrame, BinaryMetadata, encode_frame
from portico.protocols.omnia.voice import MAX_CHANNELS, MAX_SAMPLE_RATE, MIN_SAMPLE_RATE
from portico.protocols.session import frames as f
from portico.runtime.base import MediaChunk
from portico.runtime.duplex.base import PCM16

# Codecs the server can name as a MIME type. The server does not transcode: it
# sends what the agent emits, so it can offer a format exactly when it can say
# which bytes those are.
CODEC_MIME_TYPES: Final = {
    "pcm16": "audio/pcm",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
}
_MIME_CODECS: Final = {mime: codec for codec, mime in CODEC_MIME_TYPES.items()}


def choose_audio(offer: f.AudioOffer | None, *, hears: bool = False) -> f.AudioChoice | None:
    """`ready.audio`: per direction, the first format the client lists that the server
    can carry, or null when there is none (both null: `ready.audio` is null). Output:
    a codec (or MIME type) the server can name. Input, only when the agent takes calls
    (`hears`): see `choose_input`."""
    if offer is None:
        return None
    output = next(
        (
            fmt
            for fmt in offer.output
            if fmt.codec in CODEC_MIME_TYPES or fmt.mime_type in _MIME_CODECS
        ),
        None,
    )
    heard = choose_input(offer) if hears else None
    if output is None and heard is None:
        return None
    return f.AudioChoice(input=heard, output=output)


def choose_input(offer: f.AudioOffer | None) -> f.AudioFormat | None:
    """`ready.audio.input`: the first format the client lists that the server hears
    (PCM16, the format every duplex runtime hears, at 8-192 kHz, 1-8 channels), with
    its codec, rate and channels spelled out; None when there is none."""
    if offer is None:
        return None
    for fmt in offer.input:
        codec = (fmt.codec or "").lower()
        mime = (fmt.mime_type or "").split(";", 1)[0].strip().lower()
        if codec not in (PCM16, "pcm") and not (not codec and mime == "audio/pcm"):
            continue
        rate, channels = fmt.sample_rate, 1 if fmt.channels is None else fmt.channels
        if rate is None or not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
            continue
        if not 1 <= channels <= MAX_CHANNELS:
            continue
        return f.AudioFormat(codec=PCM16, sample_rate=rate, channels=channels)
    return None


def item_format(mime_type: str) -> f.AudioFormat:
    """What `audio_start.format` says about an item: its MIME type, and the codec
    name when the MIME type is one the registry knows."""
    base = mime_type.split(";", 1)[0].strip().lower()
    return f.AudioFormat(codec=_MIME_CODECS.get(base), mime_type=mime_type)


@dataclass
class _Item:
    item_id: str
    turn_id: str
    mime_type: str
    next_index: int = 0  # the OMNI Sequence of the item's next binary frame
    lost: bool = False


class MediaItems:
    """One session's open media items (server role). Pure: the adapter numbers the
    frames it returns and writes the binary frames it asks for."""

    def __init__(self, session_id: str, *, numbered: int = 0) -> None:
        """`numbered`: how many server messages the session numbered before this copy
        of it (another replica's, or this one's before a takeover). Item ids count on
        from there: each earlier item's `audio_start` took a seq, so no id repeats one
        an earlier copy gave, and audio after a move starts a new item (spec §8)."""
        self._session_id = session_id
        # Item ids are a session-wide counter: short (MediaID is 12 bytes).
        self._count = numbered
        self._open: dict[tuple[str, str], _Item] = {}  # (turn id, runtime media id) -> item

    def start(self, turn_id: str, chunk: MediaChunk) -> tuple[f.AudioStart | None, str]:
        """The item `chunk` belongs to: (its `audio_start` when it is new, its id)."""
        key = (turn_id, chunk.media_id)
        item = self._open.get(key)
        if item is not None:
            return None, item.item_id
        self._count += 1
        item = _Item(item_id=f"m{self._count}", turn_id=turn_id, mime_type=chunk.mime_type)
        self._open[key] = item
        start = f.AudioStart(
            seq=0, turn_id=turn_id, item_id=item.item_id, format=item_format(chunk.mime_type)
        )
        return start, item.item_id

    def frame(self, turn_id: str, chunk: MediaChunk) -> bytes:
        """The binary frame for `chunk` (after `start`)."""
        item = self._open[(turn_id, chunk.media_id)]
        first = item.next_index == 0
        metadata = (
            BinaryMetadata(
                session_id=self._session_id,
                mime_type=item.mime_type,
                codec=_MIME_CODECS.get(item.mime_type),
            )
            if first
            else BinaryMetadata()
        )
        data = encode_frame(
            BinaryFrame(
                chunked=True,
                is_last=chunk.is_last,
                sequence=item.next_index,
                media_id=item.item_id,
                metadata=metadata,
                payload=chunk.data,
            )
        )
        item.next_index += 1
        return data

    def dropped(self, turn_id: str, chunk: MediaChunk) -> None:
        """A binary frame of the item never reached the client (ignored once it ended)."""
        item = self._open.get((turn_id, chunk.media_id))
        if item is not None:
            item.lost = True

    def finish(self, turn_id: str, chunk: MediaChunk) -> f.AudioEnd | None:
        """`audio_end` when `chunk` is the item's last."""
        if not chunk.is_last:
            return None
        item = self._open.pop((turn_id, chunk.media_id))
        return f.AudioEnd(seq=0, turn_id=turn_id, item_id=item.item_id, lost=item.lost)

    def end_all(self, turn_id: str | None = None) -> list[f.AudioEnd]:
        """End open items as lost: every item (the connection changed), or the items of
        `turn_id` (the turn ended before the agent finished them, e.g. cancelled)."""
        ended = [
            key for key, item in self._open.items() if turn_id is None or item.turn_id == turn_id
        ]
        return [
            f.AudioEnd(seq=0, turn_id=item.turn_id, item_id=item.item_id, lost=True)
            for item in (self._open.pop(key) for key in ended)
        ]
