"""The `openai` runtime: an OpenAI-compatible `/chat/completions` endpoint behind an agent.

One turn is a loop of streamed model requests. Text streams to the client as it
arrives; when the model asks for tools, server-side tools run here and
client-side tools go out as `ToolCall`s (the engine sends the outcome back), the
results are appended as tool messages and the model is asked again, until it
answers without tool calls or `max_rounds` rounds of tool calls have run.
Decisions (history mapping, errors, timeouts) are in docs/openai.md.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import aiohttp

from portico.config import AgentSettings
from portico.domain.model import Message
from portico.runtime.base import (
    AGENT_PROMPT,
    Chunk,
    Done,
    Failure,
    ToolOutcome,
    TurnInput,
    TurnStream,
    Usage,
)
from portico.runtime.chat_messages import ChatMapper, ChatMessage, tool_content, transcript
from portico.runtime.memory_tools import memory_tools
from portico.runtime.provider import Provider, ProviderError
from portico.runtime.server_tools import (
    Tool,
    Toolbox,
    ToolError,
    ToolSource,
    client_tools,
    server_tools,
)

log = logging.getLogger("portico.runtime")

MAX_ROUNDS_EXCEEDED = "MAX_ROUNDS_EXCEEDED"
ROUND_BREAK = "\n\n"  # between the text of two model requests of one turn
SUMMARY_PROMPT = (
    "Summarise the conversation transcript the user sends so that the summary can replace "
    "it as the context for continuing the conversation. Keep facts, names, numbers, "
    "decisions, tool results that still matter, open questions and what the user asked "
    "for; leave out pleasantries. Answer with the summary only."
)


class ModelCall:
    """One tool call of a model response, assembled from its streamed deltas."""

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self._arguments: list[str] = []

    @property
    def arguments(self) -> str:
        return "".join(self._arguments)

    def add(self, delta: dict[str, Any]) -> None:
        self.id = self.id or str(delta.get("id") or "")
        function = delta.get("function") or {}
        # Servers that repeat the name in every delta must not get it doubled.
        self.name = self.name or str(function.get("name") or "")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            self._arguments.append(arguments)
        elif isinstance(arguments, dict):  # a few servers send an object, not JSON text
            self._arguments.append(json.dumps(arguments))

    def as_request(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


class ModelReply:
    """What one streamed response said: its text, its tool calls, its usage."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, ModelCall] = {}
        self.usage: Usage | None = None

    def add(self, chunk: dict[str, Any]) -> str:
        """Take one chunk; the text it adds."""
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = Usage(
                input_tokens=int(usage.get("prompt_tokens") or 0),
                output_tokens=int(usage.get("completion_tokens") or 0),
            )
        text = ""
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                text += delta["content"]
            for call in delta.get("tool_calls") or ():
                self._call_at(call).add(call)
        if text:
            self.text.append(text)
        return text

    def _call_at(self, delta: dict[str, Any]) -> ModelCall:
        index = delta.get("index")
        if not isinstance(index, int):
            # Without an index, a delta with an id starts a call; others continue the last.
            starts = bool(delta.get("id")) or not self.calls
            index = len(self.calls) if starts else max(self.calls)
        return self.calls.setdefault(index, ModelCall())

    def tool_calls(self) -> list[ModelCall]:
        calls = [self.calls[index] for index in sorted(self.calls)]
        for number, call in enumerate(calls):
            call.id = call.id or f"call_{number}"  # some local servers send none
        return calls

    def assistant_message(self) -> ChatMessage:
        message: ChatMessage = {"role": "assistant", "content": "".join(self.text) or None}
        if self.calls:
            message["tool_calls"] = [call.as_request() for call in self.tool_calls()]
        return message


class OpenAIRuntime:
    def __init__(self, settings: AgentSettings, *, env: Mapping[str, str]) -> None:
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None
        api_key = env.get(settings.api_key_env) if settings.api_key_env else None
        self._provider = Provider(settings, api_key=api_key, http=self._http)
        self._toolbox = Toolbox(
            server_tools(settings, env=env, http=self._http),
            client_tools(settings),
            _mcp_sources(settings, env),
        )

    def _http(self) -> aiohttp.ClientSession:
        # Created in the running loop, at first use; shared by the turns so that
        # connections to the provider are kept alive and reused.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None),  # every wait has its own deadline
                trust_env=True,  # HTTPS_PROXY and NO_PROXY apply
            )
        return self._session

    async def close(self) -> None:
        await self._toolbox.close()
        if self._session is not None:
            await self._session.close()

    async def run(self, turn: TurnInput) -> TurnStream:
        memory = memory_tools(turn.memory) if self._settings.memory_tools else []
        tools = await self._toolbox.for_turn(turn.client_tools, memory)
        messages = await self._opening(turn)
        last = ""  # the latest chunk's text: the next request's text must not run into it
        for round_number in itertools.count():
            reply = ModelReply()
            try:
                async with aclosing(self._stream(messages, tools, reply, last)) as events:
                    async for event in events:
                        if isinstance(event, Chunk):
                            last = event.text
                        yield event
            except ProviderError as error:
                yield self._failure(turn, error.code, error.message, error.log_fields())
                return
            calls = reply.tool_calls()
            if not calls:
                yield Done()
                return
            if round_number == self._settings.max_rounds:
                # The text so far has streamed; the engine keeps it with the failure.
                limit = f"the turn stopped at its limit of {round_number} rounds of tool calls"
                yield self._failure(turn, MAX_ROUNDS_EXCEEDED, limit)
                return
            messages.append(reply.assistant_message())
            for call in calls:
                try:
                    tool, arguments = _checked(tools, call)
                except ToolError as exc:
                    content = tool_content("error", None, str(exc))  # nothing runs
                else:
                    if tool.server is not None:
                        status, content = await _run_server_tool(tool, arguments)
                        if turn.tool_outcome is not None:
                            turn.tool_outcome(tool.name, status)
                    else:
                        outcome = yield tool.client_call(arguments)
                        content = _outcome_content(outcome)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content})

    async def _opening(self, turn: TurnInput) -> list[ChatMessage]:
        """The system prompt, the session's history, the user's message."""
        mapper = ChatMapper(
            metadata_template=self._settings.message_metadata_template,
            read_media=turn.read_media,
        )
        system = self._settings.system_prompt
        opening: list[ChatMessage] = [{"role": "system", "content": system}] if system else []
        opening.extend(await mapper.history(await turn.history()))
        # RPC `message.send`'s `agent_prompt`: an instruction for this message only,
        # so it is not in the archive's history and later turns do not see it.
        if prompt := turn.directives.get(AGENT_PROMPT):
            opening.append({"role": "system", "content": prompt})
        opening.append(await mapper.user(turn.message))
        return opening

    async def _stream(
        self, messages: list[ChatMessage], tools: dict[str, Tool], reply: ModelReply, after: str
    ) -> AsyncGenerator[Chunk | Usage, None]:
        """One model request: its text as chunks, then its usage. `after` is the text
        streamed just before (by an earlier request of the turn), which this must not
        run into."""
        async with self._provider.stream(self._body(messages, tools)) as events:
            async for chunk in events:
                text = reply.add(chunk)
                if not text:
                    continue
                first = len(reply.text) == 1
                if first and after and not after[-1].isspace() and not text[0].isspace():
                    text = ROUND_BREAK + text
                yield Chunk(text)
        if reply.usage is not None:
            yield reply.usage

    def _body(self, messages: list[ChatMessage], tools: dict[str, Tool]) -> dict[str, Any]:
        settings = self._settings
        body: dict[str, Any] = {
            "model": settings.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if tools:
            body["tools"] = [tool.definition() for tool in tools.values()]
        sampling = {"temperature": settings.temperature, "top_p": settings.top_p}
        sampling["max_tokens"] = settings.max_tokens
        body.update({key: value for key, value in sampling.items() if value is not None})
        return body

    def _failure(
        self, turn: TurnInput, code: str, message: str, fields: str | None = None
    ) -> Failure:
        """The turn's failure; the log line has the provider's endpoint and the cause
        (`fields`), which the client's message leaves out."""
        log.warning(
            "model turn failed session=%s turn=%s %s: %s",
            turn.session_id,
            turn.turn_id,
            fields or f"code={code}",
            message,
        )
        return Failure(code=code, message=message)

    async def summarize(self, history: Sequence[Message], instruction: str) -> str:
        """Compaction: the model's summary of the history (raises `ProviderError`)."""
        prompt = SUMMARY_PROMPT + (f"\n\nAlso: {instruction}" if instruction else "")
        messages: list[ChatMessage] = [
            {"role": "system", "content": prompt},
            {"role": "user", "content": transcript(history, self._settings.summary_input_chars)},
        ]
        reply = ModelReply()
        try:
            async with self._provider.stream(self._body(messages, {})) as events:
                async for chunk in events:
                    reply.add(chunk)
        except ProviderError as error:
            log.warning("model summary failed %s: %s", error.log_fields(), error.message)
            raise
        return "".join(reply.text)


def _mcp_sources(settings: AgentSettings, env: Mapping[str, str]) -> list[ToolSource]:
    if not settings.mcp_servers:
        return []
    # Imported only here: the `mcp` package is an optional extra.
    from portico.runtime.mcp import McpServer

    return [McpServer(name, server, env=env) for name, server in settings.mcp_servers.items()]


def _checked(tools: dict[str, Tool], call: ModelCall) -> tuple[Tool, dict[str, Any]]:
    tool = tools.get(call.name)
    if tool is None:
        raise ToolError(f"unknown tool {call.name!r}")
    return tool, tool.check(call.arguments)


async def _run_server_tool(tool: Tool, arguments: dict[str, Any]) -> tuple[str, str]:
    """The call's status and what the model is told."""
    assert tool.server is not None
    try:
        result = await tool.server.run(arguments)
    except ToolError as exc:
        return "error", tool_content("error", None, str(exc))
    return "completed", tool_content("completed", result, None)


def _outcome_content(outcome: ToolOutcome | None) -> str:
    if outcome is None:
        return tool_content("denied", None, None)
    return tool_content(outcome.status, outcome.result, outcome.error)
