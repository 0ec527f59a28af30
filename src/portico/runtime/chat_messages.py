"""Archived messages as chat-completions messages, for the openai runtime.

- user messages: their text (text parts, else `content`), the metadata template
  rendered from their metadata and appended (spec: Message metadata; on every
  later turn too, since the metadata stays on its message), image parts as
  `image_url` parts with a data: URL;
- `summary`: a system message with the summary's text;
- `toolcall_input` with its `toolcall_output`: an assistant message with one
  tool call and the tool message answering it (a call without a recorded answer
  gets one saying so: the API refuses a tool call left unanswered); the assistant
  text archived right before the call becomes that message's `content`;
- all in archive order, which is the order things happened: a turn's reply is split
  into messages at its tool calls (docs/storage.md, "A turn's messages");
- assistant and system text as they are; `thinking` is left out.
"""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import msgspec

from portico.domain.model import ContentPart, MediaContent, Message, message_text
from portico.domain.summary import summary_text
from portico.errors import PorticoError

log = logging.getLogger("portico.runtime")

ChatMessage = dict[str, Any]
ReadMedia = Callable[[MediaContent], Awaitable[bytes]]

# `{{key}}`, also Go-template style `{{ .key }}` (Omnia's templates).
_PLACEHOLDER = re.compile(r"\{\{\s*([^{}\s]+)\s*\}\}")
SUMMARY_HEADING = "Summary of the conversation so far:\n"
NO_ANSWER = "the call ended without a recorded answer"
# How the archive's tool-call states reach the model.
_ARCHIVED_STATUS = {"completed": "completed", "failed": "error", "timeout": "denied"}


class _ToolRequest(msgspec.Struct):
    id: str
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)


class _ToolAnswer(msgspec.Struct):
    id: str
    status: str = ""
    result: Any = None
    error: str = ""


def render_metadata(template: str, metadata: Mapping[str, str]) -> str:
    """The template with each `{{key}}` replaced by the metadata's value ("" when absent)."""

    def value(match: re.Match[str]) -> str:
        key = match.group(1)
        return metadata.get(key, metadata.get(key.removeprefix("."), ""))

    return _PLACEHOLDER.sub(value, template)


def tool_content(status: str, result: Any, error: str | None) -> str:
    """A tool's outcome as the content of its tool message."""
    if status == "completed":
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    if status == "denied":
        reason = f": {error}" if error else ""
        return json.dumps({"error": f"the call was declined or timed out{reason}"})
    return json.dumps({"error": error or "the tool failed"})


class ChatMapper:
    """Maps one agent's archived messages; `read_media` reads the turn's session's media."""

    def __init__(self, *, metadata_template: str | None, read_media: ReadMedia | None) -> None:
        self._template = metadata_template
        self._read_media = read_media

    async def history(self, messages: Sequence[Message]) -> list[ChatMessage]:
        answers = _answers(messages)
        chat: list[ChatMessage] = []
        for message in messages:  # archive order is the order it happened
            for mapped in await self._mapped(message, answers):
                _append_merged(chat, mapped)
        return chat

    async def user(self, message: Message) -> ChatMessage:
        text = message_text(message)
        if self._template and message.metadata:
            rendered = render_metadata(self._template, message.metadata)
            text = f"{text}\n\n{rendered}" if text else rendered
        media = [await self._media_part(part) for part in message.parts if part.media is not None]
        if not media:
            return {"role": "user", "content": text}
        text_part = [{"type": "text", "text": text}] if text else []
        return {"role": "user", "content": [*text_part, *media]}

    async def _mapped(self, message: Message, answers: dict[str, _ToolAnswer]) -> list[ChatMessage]:
        kind = message.content_type
        if kind == "summary":
            return [{"role": "system", "content": SUMMARY_HEADING + summary_text(message)}]
        if kind == "toolcall_input":
            return _tool_exchange(message, answers)
        if kind in ("toolcall_output", "thinking") or message.role == "tool":
            return []  # an answer goes with its call; thinking is the model's own
        if message.role == "user":
            return [await self.user(message)]
        text = message_text(message)
        return [{"role": message.role, "content": text}] if text else []

    async def _media_part(self, part: ContentPart) -> dict[str, Any]:
        media = part.media
        assert media is not None
        if part.type != "image":
            return _note(f"[a {part.type} attachment ({media.mime_type}) the model cannot see]")
        if self._read_media is None:
            return _note("[an image the model cannot see]")
        try:
            encoded = await self._base64(media)
        except PorticoError as exc:
            # Expired or unreachable media must not fail the whole conversation.
            log.warning("an image could not be read for the model: %s", exc.code)
            return _note("[an image that could not be read]")
        url = f"data:{media.mime_type};base64,{encoded}"
        image: dict[str, Any] = {"url": url}
        if media.detail:
            image["detail"] = media.detail
        return {"type": "image_url", "image_url": image}

    async def _base64(self, media: MediaContent) -> str:
        """The part's bytes as base64: inline `data` as it came (vetted when the message
        arrived), so an image of a maximal frame is never decoded only to be re-encoded."""
        if media.data is not None:
            return media.data
        assert self._read_media is not None
        return base64.b64encode(await self._read_media(media)).decode()


def _append_merged(chat: list[ChatMessage], mapped: ChatMessage) -> None:
    """Append, folding a tool call into the assistant text right before it: the shape
    the model itself answers with (`content` and `tool_calls` in one message)."""
    previous = chat[-1] if chat else None
    if (
        previous is not None
        and "tool_calls" in mapped
        and previous["role"] == "assistant"
        and isinstance(previous.get("content"), str)
        and "tool_calls" not in previous
    ):
        chat[-1] = {**mapped, "content": previous["content"]}
        return
    chat.append(mapped)


def _note(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _answers(messages: Sequence[Message]) -> dict[str, _ToolAnswer]:
    answers: dict[str, _ToolAnswer] = {}
    for message in messages:
        if message.content_type == "toolcall_output":
            try:
                answer = msgspec.json.decode(message.content, type=_ToolAnswer)
            except msgspec.DecodeError:
                continue
            answers[answer.id] = answer
    return answers


def _tool_exchange(message: Message, answers: dict[str, _ToolAnswer]) -> list[ChatMessage]:
    try:
        request = msgspec.json.decode(message.content, type=_ToolRequest)
    except msgspec.DecodeError:
        return []
    answer = answers.get(request.id)
    if answer is None:
        content = tool_content("error", None, NO_ANSWER)
    else:
        status = _ARCHIVED_STATUS.get(answer.status, "denied")
        content = tool_content(status, answer.result, answer.error)
    call = {
        "id": request.id,
        "type": "function",
        "function": {"name": request.name, "arguments": json.dumps(request.arguments)},
    }
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": request.id, "content": content},
    ]


def transcript(history: Sequence[Message], max_chars: int) -> str:
    """The history as plain text for a summary request; the newest `max_chars` of it."""
    answers = _answers(history)
    lines = [line for message in history if (line := _transcript_line(message, answers))]
    return "\n\n".join(lines)[-max_chars:]


def _transcript_line(message: Message, answers: dict[str, _ToolAnswer]) -> str:
    kind = message.content_type
    if kind == "summary":
        return "Earlier summary: " + summary_text(message)
    if kind == "toolcall_input":
        exchange = _tool_exchange(message, answers)
        if not exchange:
            return ""
        function = exchange[0]["tool_calls"][0]["function"]
        return f"tool call {function['name']}({function['arguments']}): {exchange[1]['content']}"
    if kind in ("toolcall_output", "thinking"):
        return ""
    text = message_text(message)
    images = sum(1 for part in message.parts if part.media is not None)
    attached = f" [{images} attachment(s)]" if images else ""
    return f"{message.role}: {text}{attached}" if text or attached else ""
