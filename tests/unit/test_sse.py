"""The server-sent events decoder: line endings, events split across reads, bounds."""

from __future__ import annotations

import pytest

from portico.runtime.sse import SseDecoder, SseError


def decode(*chunks: bytes, limit: int = 1 << 20) -> list[str]:
    decoder = SseDecoder(max_event_bytes=limit)
    events = [event for chunk in chunks for event in decoder.feed(chunk)]
    return events + decoder.close()


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending(newline: bytes) -> None:
    stream = newline.join([b"data: one", b"", b"data: two", b"", b""])
    assert decode(stream) == ["one", "two"]


def test_an_event_split_at_every_byte() -> None:
    stream = b'data: {"a": 1}\r\n\r\ndata: [DONE]\r\n\r\n'
    assert decode(*(stream[i : i + 1] for i in range(len(stream)))) == ['{"a": 1}', "[DONE]"]


def test_a_cr_at_the_end_of_a_read_waits_for_a_possible_lf() -> None:
    decoder = SseDecoder(max_event_bytes=100)
    assert decoder.feed(b"data: x\r") == []
    assert decoder.feed(b"\n\r") == []
    assert decoder.feed(b"\n") == ["x"]


def test_data_lines_join_and_other_fields_and_comments_are_ignored() -> None:
    stream = b": ping\nevent: message\nid: 7\nretry: 10\ndata: a\ndata:b\ndata\n\n\n\n"
    assert decode(stream) == ["a\nb\n"]


def test_the_last_event_without_its_blank_line_counts_at_the_end() -> None:
    assert decode(b"data: last") == ["last"]


def test_an_event_over_the_bound_is_refused() -> None:
    decoder = SseDecoder(max_event_bytes=10)
    with pytest.raises(SseError, match="larger than 10 bytes"):
        decoder.feed(b"data: 0123456789ab\n\n")
    with pytest.raises(SseError):
        SseDecoder(max_event_bytes=10).feed(b"data: 01234567890")  # an unfinished line too


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    assert decode(b"data: \xff\n\n") == ["\ufffd"]
