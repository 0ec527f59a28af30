"""Omnia binary WebSocket frames, sans-I/O: bytes in, `BinaryFrame` out, and back.

Layout (spec, "Binary WebSocket frames"): a 32-byte big-endian header, then
`MetadataLen` bytes of JSON metadata, then `PayloadLen` bytes of raw payload.

    offset  0  Magic        4 bytes  b"OMNI"
    offset  4  Version      uint8    1
    offset  5  Flags        uint8    0x01 Compressed (reserved), 0x02 Chunked, 0x04 IsLast
    offset  6  MessageType  uint16   1 = MediaChunk, the only type
    offset  8  MetadataLen  uint32
    offset 12  PayloadLen   uint32
    offset 16  Sequence     uint32
    offset 20  MediaID      12 bytes, UTF-8, NUL-padded

Decoding checks run in the order of the spec's table, and the first defect
found is the one reported (as `BinaryFrameError`, wire code INVALID_MESSAGE):

    1. fewer than 32 bytes                    -> `invalid header size`
    2. magic is not b"OMNI"                   -> `invalid magic bytes`
    3. version is not 1                       -> `unsupported binary protocol version`
    4. header + metadata longer than frame    -> `metadata length exceeds frame size`
    5. header + metadata + payload longer     -> `payload length exceeds frame size`
    6. header + metadata + payload shorter    -> `frame length does not match header`
    7. message type is not MediaChunk         -> `unknown binary message type`
    8. MediaID is not UTF-8                   -> `invalid media id`
    9. metadata is not a JSON object of the
       documented field types                 -> `invalid metadata`

Decisions the spec leaves open:

- Trailing bytes (step 6) are refused, not ignored: they mean the sender's
  idea of the layout differs from ours, and dropping them silently would hide
  that. They get their own message because "exceeds" would be false; the check
  sits with the other length checks, before the message type.
- Compressed (0x01) is reserved: never set on encode, ignored on decode, as are
  the undefined bits 0x08-0x80 (forward compatibility, as with unknown JSON
  fields in text frames).
- The metadata must be a JSON object, so an empty metadata section is
  `invalid metadata` rather than `{}`. Unknown keys are ignored; a known key
  with the wrong JSON type (or `1.0` where an integer is due) is refused.
  Value ranges (a positive `total_chunks`, a plausible `sample_rate`) are the
  consumer's to judge; the codec only guarantees the types.
- MediaID: encoding pads with NULs and refuses (ValueError) an id longer than
  12 UTF-8 bytes or ending in NUL, since the latter could not survive the
  round trip; decoding strips trailing NULs and keeps interior ones.
- "1 MB" and "64 KB" in the spec are read as MiB and KiB.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Final

import msgspec

from portico.errors import BinaryFrameError

MAGIC: Final = b"OMNI"
VERSION: Final = 1
FLAG_COMPRESSED: Final = 0x01  # reserved: never set, ignored on read
FLAG_CHUNKED: Final = 0x02
FLAG_IS_LAST: Final = 0x04
MEDIA_ID_SIZE: Final = 12  # bytes, NUL-padded
UINT32_MAX: Final = 2**32 - 1

# Magic, Version, Flags, MessageType, MetadataLen, PayloadLen, Sequence, MediaID;
# ">" is big-endian with no padding, so the offsets are the spec's.
_HEADER: Final = struct.Struct(">4sBBHIII12s")
HEADER_SIZE: Final = _HEADER.size  # 32 bytes

DEFAULT_CHUNK_SIZE: Final = 64 * 1024  # bytes of payload per chunk frame (spec: "64 KB")
DEFAULT_SPLIT_ABOVE: Final = 1024 * 1024  # bytes; a larger payload is chunked (spec: "1 MB")

# The exact `message` of each BinaryFrameError, in checking order.
INVALID_HEADER_SIZE: Final = "invalid header size"
INVALID_MAGIC: Final = "invalid magic bytes"
UNSUPPORTED_VERSION: Final = "unsupported binary protocol version"
METADATA_TOO_LONG: Final = "metadata length exceeds frame size"
PAYLOAD_TOO_LONG: Final = "payload length exceeds frame size"
FRAME_LENGTH_MISMATCH: Final = "frame length does not match header"
UNKNOWN_MESSAGE_TYPE: Final = "unknown binary message type"
INVALID_MEDIA_ID: Final = "invalid media id"
INVALID_METADATA: Final = "invalid metadata"


class MessageType(IntEnum):
    MEDIA_CHUNK = 1


class BinaryMetadata(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The JSON between header and payload; absent fields stay off the wire."""

    session_id: str | None = None
    mime_type: str | None = None
    total_chunks: int | None = None  # chunked transfers only
    sample_rate: int | None = None  # Hz; first frame of a stream only
    channels: int | None = None  # first frame of a stream only
    codec: str | None = None  # first frame of a stream only


class BinaryFrame(msgspec.Struct, frozen=True, kw_only=True):
    message_type: MessageType = MessageType.MEDIA_CHUNK
    chunked: bool = False
    is_last: bool = False
    sequence: int = 0  # uint32; the zero-based chunk index when chunked
    media_id: str = ""  # at most 12 UTF-8 bytes
    metadata: BinaryMetadata = msgspec.field(default_factory=BinaryMetadata)
    payload: bytes = b""


_encode_metadata = msgspec.json.Encoder().encode
_decode_metadata = msgspec.json.Decoder(BinaryMetadata).decode
# Per frame of a voice call (docs/performance.md, "Voice calls"): an enum member looked up
# on its class costs about as much as the header's unpacking (Python 3.11), so it is
# looked up once here; and a stream's frames after its first carry `{}` as metadata,
# which decodes to this one (frozen) instance without a JSON decoder.
_MEDIA_CHUNK: Final = MessageType.MEDIA_CHUNK
_EMPTY_METADATA_JSON: Final = b"{}"
_EMPTY_METADATA: Final = BinaryMetadata()


def encode_frame(frame: BinaryFrame) -> bytes:
    """The wire bytes of `frame`; ValueError if a field does not fit the header."""
    media_id = media_id_bytes(frame.media_id)
    return encode_media(
        encode_metadata(frame.metadata),
        frame.payload,
        sequence=frame.sequence,
        media_id=media_id,
        chunked=frame.chunked,
        is_last=frame.is_last,
    )


def media_id_bytes(media_id: str) -> bytes:
    """A MediaID as the header holds it (before padding); ValueError if it cannot."""
    raw = media_id.encode()
    if len(raw) > MEDIA_ID_SIZE:
        raise ValueError(f"media id exceeds {MEDIA_ID_SIZE} bytes: {media_id!r}")
    if raw.endswith(b"\0"):
        raise ValueError(f"media id must not end in NUL: {media_id!r}")
    return raw


def encode_metadata(metadata: BinaryMetadata) -> bytes:
    return _encode_metadata(metadata)


def encode_media(
    metadata: bytes,
    payload: bytes,
    *,
    sequence: int,
    media_id: bytes,
    chunked: bool = False,
    is_last: bool = False,
) -> bytes:
    """A MediaChunk frame of metadata already encoded (`encode_metadata`) and a MediaID
    already checked (`media_id_bytes`): a stream's frames differ only in Sequence, IsLast
    and payload, so its sender encodes the rest once, not per frame (docs/performance.md,
    "Voice calls"). ValueError if a field does not fit the header."""
    if not 0 <= sequence <= UINT32_MAX:
        raise ValueError(f"sequence outside uint32: {sequence}")
    if len(metadata) > UINT32_MAX or len(payload) > UINT32_MAX:
        raise ValueError("metadata or payload longer than a uint32 length can describe")
    flags = (FLAG_CHUNKED if chunked else 0) | (FLAG_IS_LAST if is_last else 0)
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        flags,
        _MEDIA_CHUNK,
        len(metadata),
        len(payload),
        sequence,
        media_id,  # struct pads "12s" with NULs
    )
    return b"".join((header, metadata, payload))


def decode_frame(data: bytes) -> BinaryFrame:
    """Parse one binary WebSocket message; BinaryFrameError names the first defect."""
    size = len(data)
    if size < HEADER_SIZE:
        raise BinaryFrameError(INVALID_HEADER_SIZE)
    (
        magic,
        version,
        flags,
        message_type,
        metadata_len,
        payload_len,
        sequence,
        raw_media_id,
    ) = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BinaryFrameError(INVALID_MAGIC)
    if version != VERSION:
        raise BinaryFrameError(UNSUPPORTED_VERSION)
    metadata_end = HEADER_SIZE + metadata_len
    if metadata_end > size:
        raise BinaryFrameError(METADATA_TOO_LONG)
    payload_end = metadata_end + payload_len
    if payload_end > size:
        raise BinaryFrameError(PAYLOAD_TOO_LONG)
    if payload_end < size:
        raise BinaryFrameError(FRAME_LENGTH_MISMATCH)
    if message_type != _MEDIA_CHUNK:
        raise BinaryFrameError(UNKNOWN_MESSAGE_TYPE)
    try:
        media_id = raw_media_id.rstrip(b"\0").decode()
    except UnicodeDecodeError as exc:
        raise BinaryFrameError(INVALID_MEDIA_ID) from exc
    if metadata_len == 2 and data[HEADER_SIZE:metadata_end] == _EMPTY_METADATA_JSON:
        metadata = _EMPTY_METADATA
    else:
        try:
            metadata = _decode_metadata(memoryview(data)[HEADER_SIZE:metadata_end])
        # DecodeError covers ValidationError (wrong field types); msgspec raises
        # RecursionError on deep nesting, even inside an ignored unknown key.
        except (msgspec.DecodeError, RecursionError) as exc:
            raise BinaryFrameError(INVALID_METADATA) from exc
    return BinaryFrame(
        message_type=_MEDIA_CHUNK,
        chunked=bool(flags & FLAG_CHUNKED),
        is_last=bool(flags & FLAG_IS_LAST),
        sequence=sequence,
        media_id=media_id,
        metadata=metadata,
        # The rest of the frame (payload_end == size); bytes() copies a bytearray or
        # memoryview, and hands a bytes slice back as it is.
        payload=bytes(data[metadata_end:]),
    )


def media_frames(
    *,
    media_id: str,
    mime_type: str,
    payload: bytes,
    session_id: str,
    chunk_size: int = DEFAULT_CHUNK_SIZE,  # bytes of payload per chunk frame
    split_above: int = DEFAULT_SPLIT_ABOVE,  # bytes; at most this many travel in one frame
    sample_rate: int | None = None,  # Hz
    channels: int | None = None,
    codec: str | None = None,
    is_last_of_stream: bool = True,
) -> list[bytes]:
    """Encode one media payload as the binary frames the spec prescribes.

    A payload of at most `split_above` bytes is one unchunked frame. A larger
    one becomes `chunk_size`-byte frames with Chunked set, Sequence the chunk
    index and `total_chunks` in every chunk's metadata, so a receiver can
    reassemble from any chunk it sees first. IsLast marks the final frame only
    when `is_last_of_stream`: for a client's frames it ends the audio session,
    so a payload in the middle of a stream must not carry it. The audio format
    fields describe the stream and go on its first frame only.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1 byte, got {chunk_size}")
    if split_above < 0:
        raise ValueError(f"split_above must not be negative, got {split_above}")
    first = BinaryMetadata(
        session_id=session_id,
        mime_type=mime_type,
        sample_rate=sample_rate,
        channels=channels,
        codec=codec,
    )
    if len(payload) <= split_above:
        return [
            encode_frame(
                BinaryFrame(
                    is_last=is_last_of_stream,
                    media_id=media_id,
                    metadata=first,
                    payload=payload,
                )
            )
        ]
    total = -(-len(payload) // chunk_size)  # ceiling division
    rest = BinaryMetadata(session_id=session_id, mime_type=mime_type, total_chunks=total)
    first = msgspec.structs.replace(first, total_chunks=total)
    return [
        encode_frame(
            BinaryFrame(
                chunked=True,
                is_last=is_last_of_stream and index == total - 1,
                sequence=index,
                media_id=media_id,
                metadata=first if index == 0 else rest,
                payload=payload[index * chunk_size : (index + 1) * chunk_size],
            )
        )
        for index in range(total)
    ]
