"""The openai runtime's tools: what the model is offered, argument checks, server-side tools.

Server-side tools (HTTP tools from the config, built-ins) run inside Portico and
never reach a client. Client-side tools (declared in the agent's config or by the
client in `/v1/session` `hello.tools`) go out through the engine's tool-call
broker. Either way the model's arguments are checked against the tool's JSON
Schema first; a failed check goes back to the model as a tool error and runs
nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol
from urllib.parse import quote
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import aiohttp
import jsonschema
import jsonschema.exceptions
import msgspec

from portico.config import (
    AgentSettings,
    BuiltinToolSettings,
    ClientToolSettings,
    HttpToolSettings,
)
from portico.domain.model import new_id
from portico.runtime.base import ClientTool, ToolCall

log = logging.getLogger("portico.tools")

_URL_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_ERROR_BODY_CHARS = 500  # of an HTTP tool's error response, shown to the model
_READ_BYTES = 65536


class ToolError(Exception):
    """A tool could not run or failed; the message goes back to the model."""


class ServerTool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]

    async def run(self, arguments: dict[str, Any]) -> Any:
        """The result (JSON-able); raises `ToolError`."""


class ToolSource(Protocol):
    """Server-side tools found at run time (an MCP server's), not written in the config."""

    async def tools(self) -> Sequence[Tool]:
        """The tools on offer now (checked, see `offer`); empty when the source is down."""

    async def close(self) -> None: ...


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """A tool the model may call in this turn, with its schema's validator."""

    name: str
    description: str
    parameters: dict[str, Any]
    validator: Any  # a jsonschema validator of `parameters`
    server: ServerTool | None = None  # None: the client runs it
    consent_message: str | None = None
    categories: tuple[str, ...] = ()

    def definition(self) -> dict[str, Any]:
        """The tool as a chat-completions request lists it."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}

    def check(self, arguments: str) -> dict[str, Any]:
        """The model's arguments, parsed and valid against the schema; else `ToolError`."""
        try:
            # Some models send an empty string for a call without arguments.
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise ToolError("invalid arguments: not valid JSON") from exc
        if not isinstance(parsed, dict):
            raise ToolError("invalid arguments: expected a JSON object")
        error = jsonschema.exceptions.best_match(self.validator.iter_errors(parsed))
        if error is not None:
            where = "/".join(str(step) for step in error.absolute_path)
            raise ToolError(f"invalid arguments{f' at {where}' if where else ''}: {error.message}")
        return parsed

    def client_call(self, arguments: dict[str, Any]) -> ToolCall:
        # A fresh id: the model's ids are not unique across sessions, the archive's are.
        return ToolCall(
            id=new_id("call"),
            name=self.name,
            arguments=arguments,
            consent_message=self.consent_message,
            categories=self.categories,
        )


def _validator(schema: dict[str, Any]) -> Any:
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def offer(source: ServerTool) -> Tool:
    """A server-side tool as the model is offered it; `jsonschema.SchemaError` when its
    parameters are not a JSON Schema."""
    return _tool(source)


def _tool(source: ServerTool | ClientToolSettings | ClientTool) -> Tool:
    if isinstance(source, ClientToolSettings):
        extra: dict[str, Any] = {
            "consent_message": source.consent_message,
            "categories": source.categories,
        }
    elif isinstance(source, ClientTool):
        extra = {}
    else:
        extra = {"server": source}
    return Tool(
        name=source.name,
        description=source.description,
        parameters=source.parameters,
        validator=_validator(source.parameters),
        **extra,
    )


class Toolbox:
    """The agent's tools, checked once; `for_turn` adds the sources' and the client's own."""

    def __init__(
        self,
        server: Sequence[ServerTool],
        client: Sequence[ClientToolSettings],
        sources: Sequence[ToolSource] = (),
    ) -> None:
        configured: list[ServerTool | ClientToolSettings] = [*server, *client]
        self._configured = {tool.name: _tool(tool) for tool in configured}
        self._sources = sources
        self._refused: set[str] = set()  # names already logged as taken

    async def for_turn(
        self, offered: Sequence[ClientTool], turn_tools: Sequence[ServerTool] = ()
    ) -> dict[str, Tool]:
        """The configured tools, the turn's own server tools (agent memory), then the
        sources' in order, then the client's: a name already taken is never replaced."""
        tools = dict(self._configured)
        for own in turn_tools:
            tools.setdefault(own.name, _tool(own))
        listings = await asyncio.gather(*(source.tools() for source in self._sources))
        for tool in itertools.chain.from_iterable(listings):
            if tool.name not in tools:
                tools[tool.name] = tool
            elif tool.name not in self._refused:
                self._refused.add(tool.name)
                log.warning("server tool %s left out: another tool has its name", tool.name)
        for declared in offered:
            if declared.name in tools:
                continue
            try:
                tools[declared.name] = _tool(declared)
            except jsonschema.SchemaError:
                log.warning("client tool left out: its parameters are not a JSON Schema")
        return tools

    async def close(self) -> None:
        await asyncio.gather(*(source.close() for source in self._sources))


# -- server-side tools ----------------------------------------------------------------------


class HttpTool:
    """Calls an HTTP endpoint the config names; the model never sees the URL or headers."""

    def __init__(
        self,
        settings: HttpToolSettings,
        *,
        env: Mapping[str, str],
        http: Callable[[], aiohttp.ClientSession],
    ) -> None:
        self.name = settings.name
        self.description = settings.description
        self.parameters = settings.parameters
        self._settings = settings
        self._http = http
        secrets = {header: env.get(name, "") for header, name in settings.headers_env.items()}
        self._headers = {**settings.headers, **secrets}

    async def run(self, arguments: dict[str, Any]) -> Any:
        url, rest = fill_url(self._settings.url, arguments)
        method = self._settings.method
        in_query = method in ("GET", "DELETE")
        try:
            async with asyncio.timeout(self._settings.timeout):
                async with self._http().request(
                    method,
                    url,
                    headers=self._headers,
                    params={key: _text(value) for key, value in rest.items()} if in_query else None,
                    json=None if in_query else rest,
                ) as response:
                    body = await _read_capped(response, self._settings.max_response_bytes)
                    return _result(response, body)
        except TimeoutError as exc:
            raise ToolError(f"no answer within {self._settings.timeout:g} s") from exc
        except aiohttp.ClientError as exc:
            raise ToolError("the tool's server could not be reached") from exc


def fill_url(template: str, arguments: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The URL with its `{name}` placeholders filled (URL-encoded, so an argument cannot
    change the host or the path), and the arguments no placeholder took."""
    used = set(_URL_PLACEHOLDER.findall(template))
    url = _URL_PLACEHOLDER.sub(
        lambda match: quote(_text(arguments.get(match.group(1), "")), safe=""), template
    )
    rest = {key: value for key, value in arguments.items() if key not in used and value is not None}
    return url, rest


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


async def _read_capped(response: aiohttp.ClientResponse, cap: int) -> bytes:
    body = bytearray()
    async for block in response.content.iter_chunked(_READ_BYTES):
        body += block
        if len(body) > cap:
            raise ToolError(f"the response is larger than {cap} bytes")
    return bytes(body)


def _result(response: aiohttp.ClientResponse, body: bytes) -> Any:
    try:
        text = body.decode(response.charset or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        text = body.decode("utf-8", errors="replace")
    if response.status >= 400:
        raise ToolError(f"HTTP {response.status}: {text[:_ERROR_BODY_CHARS]}")
    if "json" in response.content_type:
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


class CurrentTime:
    """Built-in: the current date and time, in a time zone the model may name."""

    name = "current_time"

    def __init__(self, description: str | None = None) -> None:
        self.description = description or "The current date and time (ISO 8601)."
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": {
                "timezone": {
                    "type": "string",
                    "description": "An IANA time zone such as Europe/Paris; UTC when absent",
                }
            },
            "additionalProperties": False,
        }

    async def run(self, arguments: dict[str, Any]) -> Any:
        zone_name = arguments.get("timezone") or "UTC"
        try:
            zone = ZoneInfo(zone_name)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ToolError(f"unknown time zone {zone_name!r}") from exc
        now = datetime.now(zone)
        return {
            "time": now.isoformat(timespec="seconds"),
            "timezone": zone_name,
            "weekday": now.strftime("%A"),
        }


BUILTINS: dict[str, Callable[[str | None], ServerTool]] = {"current_time": CurrentTime}


def server_tools(
    settings: AgentSettings,
    *,
    env: Mapping[str, str],
    http: Callable[[], aiohttp.ClientSession],
) -> list[ServerTool]:
    tools: list[ServerTool] = []
    for tool in settings.tools:
        if isinstance(tool, HttpToolSettings):
            tools.append(HttpTool(tool, env=env, http=http))
        elif isinstance(tool, BuiltinToolSettings):
            tools.append(BUILTINS[tool.name](tool.description))
    return tools


def client_tools(settings: AgentSettings) -> list[ClientToolSettings]:
    return [tool for tool in settings.tools if isinstance(tool, ClientToolSettings)]
