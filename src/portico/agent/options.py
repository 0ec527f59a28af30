"""The agent server's limits: `portico agent serve` flags, defaults documented here."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from portico.errors import ConfigError

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class AgentOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_conversations: Positive = 10_000  # conversations whose history is kept (LRU)
    max_history_messages: Positive = 200  # per conversation, the newest kept
    client_tool_timeout: Seconds | None = 300.0  # a tool call's wait; None: no limit
    memory_timeout: Seconds = 10.0  # a `turn.memory` call's wait for the facade's answer
    max_queued_turns: Positive = 8  # turns of one stream waiting behind the running one
    grace: Annotated[float, msgspec.Meta(ge=0)] = 10.0  # seconds turns get on SIGTERM
    max_queued_audio_frames: Positive = 256  # a voice call's caller frames not yet read


def agent_options(values: dict[str, Any]) -> AgentOptions:
    """Validated options; a bad value is a `ConfigError` naming it."""
    try:
        return msgspec.convert(values, AgentOptions)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid agent option: {exc}") from exc
