"""The binary frame codec: round trips, fuzzing, one test per decode defect, chunking."""

from __future__ import annotations

import contextlib
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portico.errors import BinaryFrameError, InvalidMessage
from portico.protocols.omnia.binary import (
    HEADER_SIZE,
    BinaryFrame,
    BinaryMetadata,
    MessageType,
    decode_frame,
    encode_frame,
    media_frames,
)

KIB = 1024
MIB = 1024 * KIB

# Written out here rather than imported, so a change to the module's layout
# cannot silently change what the tests expect.
HEADER_FORMAT = ">4sBBHIII12s"


def raw_frame(
    *,
    magic: bytes = b"OMNI",
    version: int = 1,
    flags: int = 0,
    message_type: int = 1,
    metadata: bytes = b"{}",
    payload: bytes = b"",
    sequence: int = 0,
    media_id: bytes = b"",
    metadata_len: int | None = None,
    payload_len: int | None = None,
    trailer: bytes = b"",
) -> bytes:
    """A frame built by hand, with any field or length free to be wrong."""
    header = struct.pack(
        HEADER_FORMAT,
        magic,
        version,
        flags,
        message_type,
        len(metadata) if metadata_len is None else metadata_len,
        len(payload) if payload_len is None else payload_len,
        sequence,
        media_id,
    )
    return header + metadata + payload + trailer


def decode_error(data: bytes) -> BinaryFrameError:
    with pytest.raises(BinaryFrameError) as info:
        decode_frame(data)
    return info.value


# -- strategies -------------------------------------------------------------------

optional_ints = st.none() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
optional_texts = st.none() | st.text(max_size=40)
metadata_values = st.builds(
    BinaryMetadata,
    session_id=optional_texts,
    mime_type=optional_texts,
    total_chunks=optional_ints,
    sample_rate=optional_ints,
    channels=optional_ints,
    codec=optional_texts,
)
# NUL is left out: an id ending in NUL is refused on encode (tested below).
media_ids = st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=127), max_size=12)
frames = st.builds(
    BinaryFrame,
    chunked=st.booleans(),
    is_last=st.booleans(),
    sequence=st.integers(min_value=0, max_value=2**32 - 1),
    media_id=media_ids,
    metadata=metadata_values,
    payload=st.binary(max_size=512),
)


# -- round trip and fuzzing ---------------------------------------------------------


@given(frames)
def test_encode_then_decode_is_identity(frame: BinaryFrame) -> None:
    assert decode_frame(encode_frame(frame)) == frame


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_decode_or_raise_binary_frame_error(data: bytes) -> None:
    # Any other exception escapes the suppress and fails the test.
    with contextlib.suppress(BinaryFrameError):
        decode_frame(data)


@settings(max_examples=300)
@given(
    magic=st.sampled_from([b"OMNI", b"OMNJ"]),
    version=st.sampled_from([1, 1, 0, 2]),
    flags=st.integers(0, 255),
    message_type=st.sampled_from([1, 1, 0, 2, 0xFFFF]),
    metadata=st.binary(max_size=60)
    | st.sampled_from([b"{}", b'{"sample_rate": 8000}', b'{"codec": 1}', b"[]", b""]),
    payload=st.binary(max_size=60),
    media_id=st.binary(max_size=12),
    length_skew=st.sampled_from([0, 0, 0, -1, 1, 2**31]),
    trailer=st.binary(max_size=3),
)
def test_near_valid_frames_decode_or_raise_binary_frame_error(
    magic: bytes,
    version: int,
    flags: int,
    message_type: int,
    metadata: bytes,
    payload: bytes,
    media_id: bytes,
    length_skew: int,
    trailer: bytes,
) -> None:
    # Mostly-valid headers reach the checks that plain random bytes never get past.
    data = raw_frame(
        magic=magic,
        version=version,
        flags=flags,
        message_type=message_type,
        metadata=metadata,
        payload=payload,
        media_id=media_id,
        payload_len=max(0, len(payload) + length_skew) % 2**32,
        trailer=trailer,
    )
    # Any other exception escapes the suppress and fails the test.
    with contextlib.suppress(BinaryFrameError):
        decode_frame(data)


# -- one hand-made defect per reason ---------------------------------------------------


def test_error_is_an_invalid_message() -> None:
    assert issubclass(BinaryFrameError, InvalidMessage)
    assert BinaryFrameError.code == "INVALID_MESSAGE"


@pytest.mark.parametrize("size", [0, 1, HEADER_SIZE - 1])
def test_short_frame_is_invalid_header_size(size: int) -> None:
    error = decode_error(raw_frame()[:size])
    assert error.message == "invalid header size"
    assert error.code == "INVALID_MESSAGE"


def test_wrong_magic_is_invalid_magic_bytes() -> None:
    error = decode_error(raw_frame(magic=b"OMNX"))
    assert error.message == "invalid magic bytes"
    assert error.code == "INVALID_MESSAGE"


@pytest.mark.parametrize("version", [0, 2, 255])
def test_other_version_is_unsupported(version: int) -> None:
    error = decode_error(raw_frame(version=version))
    assert error.message == "unsupported binary protocol version"
    assert error.code == "INVALID_MESSAGE"


def test_metadata_past_the_end_is_metadata_length_exceeds() -> None:
    error = decode_error(raw_frame(metadata=b"{}", metadata_len=3))
    assert error.message == "metadata length exceeds frame size"
    assert error.code == "INVALID_MESSAGE"


def test_payload_past_the_end_is_payload_length_exceeds() -> None:
    error = decode_error(raw_frame(payload=b"abc", payload_len=4))
    assert error.message == "payload length exceeds frame size"
    assert error.code == "INVALID_MESSAGE"


def test_huge_lengths_do_not_overflow_into_acceptance() -> None:
    error = decode_error(raw_frame(payload=b"abc", payload_len=2**32 - 1))
    assert error.message == "payload length exceeds frame size"
    error = decode_error(raw_frame(metadata_len=2**32 - 1))
    assert error.message == "metadata length exceeds frame size"


def test_trailing_bytes_are_frame_length_mismatch() -> None:
    error = decode_error(raw_frame(payload=b"abc", trailer=b"\0"))
    assert error.message == "frame length does not match header"
    assert error.code == "INVALID_MESSAGE"


@pytest.mark.parametrize("message_type", [0, 2, 0xFFFF])
def test_other_message_type_is_unknown(message_type: int) -> None:
    error = decode_error(raw_frame(message_type=message_type))
    assert error.message == "unknown binary message type"
    assert error.code == "INVALID_MESSAGE"


def test_non_utf8_media_id_is_invalid_media_id() -> None:
    error = decode_error(raw_frame(media_id=b"\xff\xfe"))
    assert error.message == "invalid media id"
    assert error.code == "INVALID_MESSAGE"


@pytest.mark.parametrize(
    "metadata",
    [
        b"",  # no JSON at all: the spec says the metadata is an object
        b"{",
        b"[]",
        b'"session"',
        b"null",
        b'{"session_id": 1}',
        b'{"mime_type": ["audio/pcm"]}',
        b'{"total_chunks": "3"}',
        b'{"sample_rate": 16000.0}',
        b'{"channels": true}',
        b'{"codec": {}}',
        b'{"codec": "\xff"}',  # not UTF-8
        b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # deep nesting in an ignored key
    ],
    ids=lambda metadata: metadata[:24].decode(errors="replace"),
)
def test_bad_metadata_is_invalid_metadata(metadata: bytes) -> None:
    error = decode_error(raw_frame(metadata=metadata))
    assert error.message == "invalid metadata"
    assert error.code == "INVALID_MESSAGE"


@pytest.mark.parametrize(
    ("defects", "message"),
    [
        ({"magic": b"XXXX", "version": 9}, "invalid magic bytes"),
        ({"version": 9, "metadata_len": 99}, "unsupported binary protocol version"),
        ({"metadata_len": 99, "payload_len": 99}, "metadata length exceeds frame size"),
        ({"payload_len": 99, "message_type": 7}, "payload length exceeds frame size"),
        ({"trailer": b"x", "message_type": 7}, "frame length does not match header"),
        ({"message_type": 7, "metadata": b"[]"}, "unknown binary message type"),
        ({"media_id": b"\xff", "metadata": b"[]"}, "invalid media id"),
    ],
)
def test_first_defect_in_spec_order_is_reported(defects: dict[str, object], message: str) -> None:
    assert decode_error(raw_frame(**defects)).message == message  # type: ignore[arg-type]


# -- header layout, flags, media id -------------------------------------------------


def test_header_bytes_are_big_endian_at_the_spec_offsets() -> None:
    frame = BinaryFrame(
        chunked=True,
        is_last=True,
        sequence=0x01020304,
        media_id="aud-1",
        metadata=BinaryMetadata(mime_type="a/b"),
        payload=b"\x00\x01\x02",
    )
    data = encode_frame(frame)
    metadata = b'{"mime_type":"a/b"}'  # 19 bytes, omitting absent fields
    expected_header = (
        b"OMNI"  # 0: magic
        + b"\x01"  # 4: version
        + b"\x06"  # 5: flags, Chunked 0x02 | IsLast 0x04
        + b"\x00\x01"  # 6: message type 1, big-endian uint16
        + b"\x00\x00\x00\x13"  # 8: metadata length 19
        + b"\x00\x00\x00\x03"  # 12: payload length 3
        + b"\x01\x02\x03\x04"  # 16: sequence
        + b"aud-1\x00\x00\x00\x00\x00\x00\x00"  # 20: media id, NUL-padded to 12
    )
    assert len(expected_header) == HEADER_SIZE == 32
    assert data == expected_header + metadata + b"\x00\x01\x02"


def test_reserved_and_unknown_flag_bits_are_ignored_on_read() -> None:
    frame = decode_frame(raw_frame(flags=0x01 | 0x08 | 0x80))
    assert (frame.chunked, frame.is_last) == (False, False)
    frame = decode_frame(raw_frame(flags=0xFF))
    assert (frame.chunked, frame.is_last) == (True, True)


def test_encode_never_sets_compressed() -> None:
    data = encode_frame(BinaryFrame(chunked=True, is_last=True))
    assert data[5] & 0x01 == 0


def test_media_id_trailing_nuls_are_stripped_interior_kept() -> None:
    assert decode_frame(raw_frame(media_id=b"a\0b")).media_id == "a\0b"
    assert decode_frame(raw_frame(media_id=b"\0" * 12)).media_id == ""


def test_media_id_of_twelve_utf8_bytes_round_trips() -> None:
    frame = BinaryFrame(media_id="é" * 6)  # 2 bytes each
    assert decode_frame(encode_frame(frame)).media_id == "é" * 6


@pytest.mark.parametrize(
    "frame",
    [
        BinaryFrame(media_id="a" * 13),
        BinaryFrame(media_id="é" * 7),  # 7 characters, 14 bytes
        BinaryFrame(media_id="a\0"),  # would decode as "a"
        BinaryFrame(sequence=-1),
        BinaryFrame(sequence=2**32),
    ],
)
def test_encode_refuses_what_the_header_cannot_carry(frame: BinaryFrame) -> None:
    with pytest.raises(ValueError, match=r"media id|sequence"):
        encode_frame(frame)


def test_unknown_metadata_keys_are_ignored() -> None:
    frame = decode_frame(raw_frame(metadata=b'{"codec": "opus", "future": [1, 2]}'))
    assert frame.metadata == BinaryMetadata(codec="opus")


@pytest.mark.parametrize(
    "metadata", [b"{}", b"{ }", b"{}\n", b"{]", b"[]", b"}{", b'{"":0}'], ids=repr
)
def test_metadata_decodes_alike_with_or_without_the_empty_shortcut(metadata: bytes) -> None:
    # A stream's later frames carry `{}`, decoded without the JSON decoder (per frame of
    # a voice call): only exactly `{}` may take that path.
    try:
        expected: object = msgspec.json.decode(metadata, type=BinaryMetadata)
    except msgspec.DecodeError:
        expected = "invalid metadata"
    try:
        got: object = decode_frame(raw_frame(metadata=metadata, payload=b"pcm")).metadata
    except BinaryFrameError as exc:
        got = exc.message
    assert got == expected


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_any_bytes_like_frame_decodes_to_a_bytes_payload(kind: type) -> None:
    frame = BinaryFrame(sequence=7, media_id="mic", payload=b"\x01\x02" * 320)
    decoded = decode_frame(kind(encode_frame(frame)))
    assert decoded == frame
    assert type(decoded.payload) is bytes


# -- splitting a payload into frames ------------------------------------------------


def split(payload: bytes, **limits: int) -> list[BinaryFrame]:
    encoded = media_frames(
        media_id="m1",
        mime_type="audio/pcm",
        payload=payload,
        session_id="s1",
        sample_rate=16000,
        channels=1,
        codec="pcm_s16le",
        **limits,  # type: ignore[arg-type]
    )
    return [decode_frame(data) for data in encoded]


def test_payload_of_exactly_the_threshold_is_one_frame() -> None:
    payload = bytes(range(256)) * (MIB // 256)
    (frame,) = split(payload)
    assert frame.payload == payload
    assert (frame.chunked, frame.is_last, frame.sequence) == (False, True, 0)
    assert frame.metadata == BinaryMetadata(
        session_id="s1",
        mime_type="audio/pcm",
        sample_rate=16000,
        channels=1,
        codec="pcm_s16le",
    )


def test_one_byte_over_the_threshold_is_seventeen_64_kib_chunks() -> None:
    payload = bytes(range(256)) * (MIB // 256) + b"\x7f"
    chunks = split(payload)
    # 1 MiB is 16 full 64 KiB chunks; the extra byte makes a 17th of 1 byte.
    assert len(chunks) == 17
    assert [len(c.payload) for c in chunks] == [64 * KIB] * 16 + [1]
    assert [c.sequence for c in chunks] == list(range(17))
    assert all(c.chunked and c.media_id == "m1" for c in chunks)
    assert all(c.metadata.total_chunks == 17 for c in chunks)
    assert [c.is_last for c in chunks] == [False] * 16 + [True]
    assert b"".join(c.payload for c in chunks) == payload


def test_audio_format_is_on_the_first_frame_only() -> None:
    first, *rest = split(b"x" * 10, chunk_size=4, split_above=4)
    assert (first.metadata.sample_rate, first.metadata.channels) == (16000, 1)
    assert first.metadata.codec == "pcm_s16le"
    for frame in rest:
        assert frame.metadata == BinaryMetadata(
            session_id="s1", mime_type="audio/pcm", total_chunks=3
        )


def test_empty_payload_is_one_frame() -> None:
    (frame,) = split(b"")
    assert (frame.payload, frame.chunked, frame.is_last) == (b"", False, True)


def test_no_is_last_when_the_stream_goes_on() -> None:
    for size in (3, 10):
        encoded = media_frames(
            media_id="m",
            mime_type="audio/pcm",
            payload=b"x" * size,
            session_id="s",
            chunk_size=4,
            split_above=4,
            is_last_of_stream=False,
        )
        assert not any(decode_frame(data).is_last for data in encoded)


@pytest.mark.parametrize(("chunk_size", "split_above"), [(0, 4), (4, -1)])
def test_nonsense_limits_are_refused(chunk_size: int, split_above: int) -> None:
    with pytest.raises(ValueError, match=r"chunk_size|split_above"):
        split(b"x", chunk_size=chunk_size, split_above=split_above)


@given(
    payload=st.binary(max_size=400),
    chunk_size=st.integers(1, 64),
    split_above=st.integers(0, 128),
    data=st.data(),
)
def test_chunks_reassemble_byte_exact(
    payload: bytes, chunk_size: int, split_above: int, data: st.DataObject
) -> None:
    frames = split(payload, chunk_size=chunk_size, split_above=split_above)
    if len(payload) <= split_above:
        assert len(frames) == 1
        assert not frames[0].chunked
        assert frames[0].metadata.total_chunks is None
    else:
        count = -(-len(payload) // chunk_size)
        assert len(frames) == count
        assert [f.sequence for f in frames] == list(range(count))
        assert all(f.chunked and f.metadata.total_chunks == count for f in frames)
        assert all(len(f.payload) == chunk_size for f in frames[:-1])
        assert 1 <= len(frames[-1].payload) <= chunk_size
    assert [f.is_last for f in frames] == [False] * (len(frames) - 1) + [True]
    assert all(f.message_type is MessageType.MEDIA_CHUNK for f in frames)
    arrived = data.draw(st.permutations(frames))  # a receiver may see them in any order
    in_order = sorted(arrived, key=lambda f: f.sequence)
    assert b"".join(f.payload for f in in_order) == payload
