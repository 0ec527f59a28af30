"""What every protocol checks in a user message: metadata, parts, declarations.

The rules are the Omnia `message` rules (spec: Message metadata); `/v1/session`
and `/v1/rpc` apply the same ones, so they live here, once.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from portico.domain.model import ContentPart
from portico.errors import InvalidMessage

RESERVED_METADATA_KEYS = frozenset({"mock_scenario", "content_type"})
RESERVED_METADATA_PREFIX = "omnia."
METADATA_MAX_KEYS = 32
METADATA_KEY_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
METADATA_MAX_VALUE_BYTES = 8 * 1024
METADATA_MAX_TOTAL_BYTES = 32 * 1024
DECLARE_MAX_BYTES = 16 * 1024
CLIENT_ID_MAX_LENGTH = 128  # a message's idempotency key, as RPC ids

_encode = msgspec.json.Encoder().encode


def split_metadata(metadata: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split into (forwarded, directives) and enforce the spec's limits on the former.

    Reserved keys are the runtime's own and the spec exempts them from every limit;
    the frame that carried them is already bounded by `max_payload_size`.
    """
    forwarded: dict[str, str] = {}
    directives: dict[str, str] = {}
    for key, value in metadata.items():
        if key in RESERVED_METADATA_KEYS or key.startswith(RESERVED_METADATA_PREFIX):
            directives[key] = value
        else:
            forwarded[key] = value
    _check_forwarded(forwarded)
    return forwarded, directives


def _check_forwarded(metadata: dict[str, str]) -> None:
    """The limits on forwarded keys and values, all in UTF-8 bytes."""
    if len(metadata) > METADATA_MAX_KEYS:
        raise InvalidMessage("metadata has more than 32 keys")
    for key, value in metadata.items():
        if not METADATA_KEY_PATTERN.fullmatch(key):
            raise InvalidMessage(
                "metadata key must be 1 to 64 characters of letters, digits, '_', '.' or '-'"
            )
        if len(value.encode()) > METADATA_MAX_VALUE_BYTES:
            raise InvalidMessage(f"metadata value of {key!r} exceeds 8 KiB")
    total = sum(len(key.encode()) + len(value.encode()) for key, value in metadata.items())
    if total > METADATA_MAX_TOTAL_BYTES:
        raise InvalidMessage("metadata exceeds 32 KiB in total")


def check_parts(parts: tuple[ContentPart, ...]) -> None:
    for index, part in enumerate(parts):
        if part.type == "text":
            if part.text is None:
                raise InvalidMessage(f"parts[{index}]: a text part needs `text`")
            continue
        if part.media is None:
            raise InvalidMessage(f"parts[{index}]: a {part.type} part needs `media`")
        media = part.media
        sources = [s for s in (media.data, media.url, media.storage_ref) if s is not None]
        if len(sources) != 1:
            raise InvalidMessage(
                f"parts[{index}].media: exactly one of data, url, storage_ref is required"
            )


def declare_fits(declare: dict[str, Any]) -> bool:
    """Whether a declaration is within the spec's 16 KiB, as encoded JSON."""
    return len(_encode(declare)) <= DECLARE_MAX_BYTES


def base64_decoded_size(data: str) -> int:
    """The bytes a base64 text decodes to (well-formed or not: a budget, not a check)."""
    return len(data) * 3 // 4 - data[-2:].count("=")


def check_client_id(client_id: str) -> None:
    """An idempotency key is bounded like every id a client chooses."""
    if len(client_id) > CLIENT_ID_MAX_LENGTH:
        raise InvalidMessage(f"client_id is longer than {CLIENT_ID_MAX_LENGTH} characters")
