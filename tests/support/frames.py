"""Client frames compared as Portico's protocols mean them: chunk boundaries carry no
meaning (text ready together may cross a hop as one chunk, docs/runtime-grpc.md), so a
reply is its concatenated text and the kinds of its frames, a run of chunks as one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def streamed_text(frames: list[Mapping[str, Any]]) -> str:
    return "".join(str(frame["content"]) for frame in frames if frame["type"] == "chunk")


def frame_kinds(frames: list[Mapping[str, Any]]) -> list[str]:
    """The frames' types in order, consecutive `chunk`s as one."""
    kinds: list[str] = []
    for frame in frames:
        if not (frame["type"] == "chunk" and kinds[-1:] == ["chunk"]):
            kinds.append(frame["type"])
    return kinds
