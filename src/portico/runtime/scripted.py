"""The `scripted` runtime: a deterministic agent driven by a JSON or YAML file.

Format (see README, "Scripted agent"): ``scenarios`` maps a name to a list of
steps, each a one-key mapping. The reserved metadata key ``mock_scenario``
picks the scenario; otherwise ``default``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import uuid
from pathlib import Path
from typing import Annotated, Any

import msgspec

from portico.config_errors import read_yaml
from portico.domain.model import ContentPart, message_text, new_id
from portico.errors import ScriptError
from portico.runtime.base import (
    Chunk,
    Done,
    Failure,
    MediaChunk,
    RuntimeEvent,
    ToolCall,
    ToolOutcome,
    TurnInput,
    TurnStream,
)

DEFAULT_SCENARIO = "default"
SCENARIO_KEY = "mock_scenario"
_PLACEHOLDER = re.compile(r"\{tool\.(status|result|error)\}")


class DoneStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    content: str | None = None
    parts: tuple[ContentPart, ...] | None = None


class ToolCallStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    consent_message: str | None = None
    categories: tuple[str, ...] = ()


class ErrorStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    code: str
    message: str = ""


class MediaChunkStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    mime_type: str
    bytes: Annotated[int, msgspec.Meta(ge=0)]
    chunk_bytes: Annotated[int, msgspec.Meta(ge=1)] = 65536


class EchoStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class MediaInfoStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Describe the user's media parts, read through the media port (Portico extension)."""


class ContextStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One chunk: the turn's application context as compact JSON (Portico extension)."""


class ChunkStep(msgspec.Struct, frozen=True):
    text: str


class SleepStep(msgspec.Struct, frozen=True):
    ms: int


Step = (
    DoneStep
    | ToolCallStep
    | ErrorStep
    | MediaChunkStep
    | EchoStep
    | MediaInfoStep
    | ContextStep
    | ChunkStep
    | SleepStep
)

# The step key in the file, and the type of its value.
STEP_KINDS: dict[str, Any] = {
    "chunk": str,
    "done": DoneStep,
    "tool_call": ToolCallStep,
    "sleep_ms": Annotated[int, msgspec.Meta(ge=0)],
    "error": ErrorStep,
    "media_chunk": MediaChunkStep,
    "echo": EchoStep,
    "media_info": MediaInfoStep,
    "context": ContextStep,
}


def _parse_step(raw: Any, where: str) -> Step:
    if not isinstance(raw, dict) or len(raw) != 1:
        raise ScriptError(f"{where}: a step is a mapping with exactly one key")
    ((kind, value),) = raw.items()
    if kind not in STEP_KINDS:
        raise ScriptError(f"{where}: unknown step {kind!r}; expected one of {sorted(STEP_KINDS)}")
    try:
        parsed = msgspec.convert({} if value is None else value, STEP_KINDS[kind])
    except msgspec.ValidationError as exc:
        raise ScriptError(f"{where}.{kind}: {exc}") from exc
    if kind == "chunk":
        return ChunkStep(text=parsed)
    if kind == "sleep_ms":
        return SleepStep(ms=parsed)
    step: Step = parsed
    return step


def parse_script(data: Any) -> dict[str, tuple[Step, ...]]:
    """Validate a loaded script document; errors name the scenario and step."""
    if not isinstance(data, dict) or not isinstance(data.get("scenarios"), dict):
        raise ScriptError("a script is a mapping with a `scenarios` mapping")
    scenarios: dict[str, tuple[Step, ...]] = {}
    for name, steps in data["scenarios"].items():
        if not isinstance(steps, list):
            raise ScriptError(f"scenarios.{name}: expected a list of steps")
        scenarios[str(name)] = tuple(
            _parse_step(step, f"scenarios.{name}[{index}]") for index, step in enumerate(steps)
        )
    return scenarios


def load_script(path: str | Path) -> dict[str, tuple[Step, ...]]:
    # YAML is a superset of JSON, so one loader reads both formats.
    return parse_script(read_yaml(path, "script", ScriptError))


def render_placeholders(text: str, outcome: ToolOutcome | None) -> str:
    """Fill `{tool.status}`, `{tool.result}`, `{tool.error}` from the latest tool call."""
    if "{tool." not in text:
        return text  # the common case, per chunk: skip the regex and the JSON
    if outcome is None:
        values = {"status": "", "result": "", "error": ""}
    else:
        result = "" if outcome.result is None else json.dumps(outcome.result, separators=(",", ":"))
        values = {"status": outcome.status, "result": result, "error": outcome.error or ""}
    # One pass: a tool's result or error may itself contain placeholder text.
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], text)


def media_chunks(step: MediaChunkStep) -> list[MediaChunk]:
    """`bytes` bytes of the pattern i % 256, in chunks of exactly `chunk_bytes` but the last."""
    # The pattern i % 256, built by repetition: a per-byte generator costs seconds per 10 MB.
    payload = (bytes(range(256)) * (step.bytes // 256 + 1))[: step.bytes]
    media_id = uuid.uuid4().hex[:12]
    starts = range(0, max(len(payload), 1), step.chunk_bytes)
    return [
        MediaChunk(
            media_id=media_id,
            mime_type=step.mime_type,
            data=payload[start : start + step.chunk_bytes],
            sequence=index,
            is_last=index == len(starts) - 1,
        )
        for index, start in enumerate(starts)
    ]


async def describe_media(turn: TurnInput) -> list[str]:
    """One line per media part: `<type> <mime> <n> bytes sha256:<first 16 hex>`."""
    lines = []
    for part in turn.message.parts:
        if part.media is None:
            continue
        data = await turn.read_media(part.media)
        digest = hashlib.sha256(data).hexdigest()[:16]
        lines.append(f"{part.type} {part.media.mime_type} {len(data)} bytes sha256:{digest}\n")
    return lines


class ScriptedRuntime:
    def __init__(self, scenarios: dict[str, tuple[Step, ...]]) -> None:
        self._scenarios = scenarios
        # A chunk without placeholders is the same event every time: built once, so a
        # long scripted stream costs little more than yielding (the benchmark's model).
        self._static_chunks = {
            id(step): Chunk(step.text)
            for steps in scenarios.values()
            for step in steps
            if isinstance(step, ChunkStep) and "{tool." not in step.text
        }

    @classmethod
    def from_file(cls, path: str | Path) -> ScriptedRuntime:
        return cls(load_script(path))

    def _scenario(self, turn: TurnInput) -> tuple[Step, ...] | None:
        return self._scenarios.get(turn.directives.get(SCENARIO_KEY, DEFAULT_SCENARIO))

    async def run(self, turn: TurnInput) -> TurnStream:
        steps = self._scenario(turn)
        if steps is None:
            name = turn.directives.get(SCENARIO_KEY, DEFAULT_SCENARIO)
            # The name is the client's own (a reserved key, bounded only by the frame):
            # echoed shortened, never a payload sent back whole.
            shown = name if len(name) <= 64 else name[:64] + "…"
            yield Failure(code="SCENARIO_NOT_FOUND", message=f"no scenario named {shown!r}")
            return
        outcome: ToolOutcome | None = None
        static_chunks = self._static_chunks
        for step in steps:
            chunk = static_chunks.get(id(step))
            if chunk is not None:
                yield chunk
                continue
            for event in self._events_of(step, turn, outcome):
                reply = yield event
                if isinstance(event, ToolCall):
                    outcome = reply
                if isinstance(event, Done | Failure):
                    return
            if isinstance(step, SleepStep):
                await asyncio.sleep(step.ms / 1000)
            elif isinstance(step, MediaInfoStep):
                for line in await describe_media(turn):
                    yield Chunk(line)
        yield Done()

    @staticmethod
    def _events_of(step: Step, turn: TurnInput, outcome: ToolOutcome | None) -> list[RuntimeEvent]:
        match step:
            case ChunkStep(text=text):
                return [Chunk(render_placeholders(text, outcome))]
            case DoneStep(content=content, parts=parts):
                rendered = None if content is None else render_placeholders(content, outcome)
                return [Done(content=rendered, parts=parts)]
            case ToolCallStep():
                return [
                    ToolCall(
                        id=new_id("call"),
                        name=step.name,
                        arguments=step.arguments,
                        consent_message=step.consent_message,
                        categories=step.categories,
                    )
                ]
            case ErrorStep(code=code, message=message):
                return [Failure(code=code, message=message)]
            case MediaChunkStep():
                return list(media_chunks(step))
            case EchoStep():
                words = message_text(turn.message).split()
                last = len(words) - 1
                return [Chunk(word if i == last else word + " ") for i, word in enumerate(words)]
            case ContextStep():
                # What server code and tools see; a model never does (TurnInput.context).
                return [Chunk(json.dumps(turn.context, separators=(",", ":"), sort_keys=True))]
        return []
