"""MCP tools for the openai runtime: one agent's MCP server, as a source of server-side tools.

Each configured server gets one connection per Portico process, opened by the
first turn that needs it (within `start_timeout`: start or connect, handshake,
tool listing) and kept for later turns. A connection that breaks (the server
exited, its HTTP session ended) is dropped, and the next turn opens a new one.
Any failure of the server (it does not start, it hangs, it exits mid-call, it
answers with an error) becomes a tool error the model reads, never the turn's
failure. Decisions (names, results, timeouts) are in docs/mcp.md.

The SDK's connection (anyio task groups inside) must be entered and left by the
same task, so each connection has an owner task that holds it open until it is
dropped; turns call tools through it from their own tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx2
import jsonschema
import mcp_types
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from portico.config import McpServerSettings
from portico.runtime.server_tools import Tool, ToolError, offer

log = logging.getLogger("portico.mcp")

_LISTING_PAGES = 100  # a server whose tool listing never ends cannot hang a start
_ERROR_CHARS = 500  # of an error message from the server, shown to the model
_CLOSE_TIMEOUT = 10.0  # for an owner task to leave its connection (the SDK bounds its own steps)


class McpTool:
    """One tool of an MCP server, under the name the model is offered."""

    def __init__(self, server: McpServer, listed: mcp_types.Tool, name: str) -> None:
        self.name = name
        self.description = listed.description or listed.title or ""
        self.parameters: dict[str, Any] = dict(listed.input_schema)
        self.server_name = listed.name  # what the server calls it
        self._server = server

    async def run(self, arguments: dict[str, Any]) -> Any:
        return await self._server.call(self.server_name, arguments)


class _Connection:
    """One open connection: its client, its tools, and the owner task holding it."""

    def __init__(self) -> None:
        self.opened: asyncio.Future[tuple[Client, list[Tool]]] = (
            asyncio.get_running_loop().create_future()
        )
        self.dropped = asyncio.Event()
        self.owner: asyncio.Task[None] | None = None


class McpServer:
    """A `ToolSource`: the tools of one MCP server, and the calls to them."""

    def __init__(self, name: str, settings: McpServerSettings, *, env: Mapping[str, str]) -> None:
        self.name = name
        self._settings = settings
        self._prefix = f"{name}__" if settings.tool_prefix is None else settings.tool_prefix
        # Secrets are read once, here; they are never logged.
        secrets = {key: env.get(variable, "") for key, variable in settings.env_from.items()}
        self._env = {**settings.env, **secrets}
        self._headers = {
            **settings.headers,
            **{header: env.get(var, "") for header, var in settings.headers_env.items()},
        }
        self._connection: _Connection | None = None
        self._closing: set[asyncio.Task[None]] = set()

    # -- the ToolSource port ---------------------------------------------------------------

    async def tools(self) -> Sequence[Tool]:
        try:
            _, _, tools = await self._open()
        except ToolError:
            return []  # logged by `_open`; the turn goes on without these tools
        return tools

    async def close(self) -> None:
        if self._connection is not None:
            self._drop(self._connection)
        if self._closing:
            await asyncio.wait(self._closing, timeout=_CLOSE_TIMEOUT)

    # -- calls -------------------------------------------------------------------------------

    async def call(self, tool: str, arguments: dict[str, Any]) -> Any:
        """The tool's result for the model; `ToolError` for every way the call can fail."""
        connection, client, _ = await self._open()
        timeout = self._settings.call_timeout
        try:
            async with asyncio.timeout(timeout):
                result = await client.call_tool(tool, arguments)
        except TimeoutError as exc:
            # The connection stays: a slow tool is not a dead server, other calls may work.
            late = f"did not answer within {timeout:g} s"
            log.warning("MCP server %s: tool %s %s", self.name, tool, late)
            raise ToolError(f"MCP server {self.name!r} {late}") from exc
        except MCPError as exc:
            if exc.code != mcp_types.CONNECTION_CLOSED:
                raise ToolError(_cut(exc.message, _ERROR_CHARS)) from exc
            self._lost(connection, "closed the connection during a call")
            raise ToolError(f"MCP server {self.name!r} closed the connection") from exc
        except Exception as exc:  # the transport's own failures (pipes, HTTP)
            self._lost(connection, f"failed during a call ({type(exc).__name__})")
            raise ToolError(f"MCP server {self.name!r} could not be reached") from exc
        return result_for_model(result, self._settings.max_result_chars)

    # -- the connection ----------------------------------------------------------------------

    async def _open(self) -> tuple[_Connection, Client, list[Tool]]:
        """The open connection, opening one first when there is none (turns that arrive
        while it opens wait for the same one), with its client and tools."""
        connection = self._connection
        if connection is None:
            connection = self._connection = _Connection()
            owner = asyncio.create_task(self._own(connection), name=f"mcp-{self.name}")
            connection.owner = owner
            self._closing.add(owner)
            owner.add_done_callback(self._closing.discard)
        try:
            async with asyncio.timeout(self._settings.start_timeout):
                client, tools = await asyncio.shield(connection.opened)
        except TimeoutError as exc:
            self._lost(connection, f"did not start within {self._settings.start_timeout:g} s")
            raise ToolError(f"MCP server {self.name!r} did not start in time") from exc
        return connection, client, tools

    async def _own(self, connection: _Connection) -> None:
        """Open the connection, list its tools, hold it until it is dropped."""
        try:
            async with self._client() as client:
                tools = self._offered(await _list_tools(client))
                log.info("MCP server %s connected, %d tools", self.name, len(tools))
                connection.opened.set_result((client, tools))
                await connection.dropped.wait()
        except Exception as exc:
            if connection.opened.done():
                log.warning("MCP server %s: the connection failed: %s", self.name, _describe(exc))
            else:
                log.warning("MCP server %s could not be started: %s", self.name, _describe(exc))
        finally:
            if not connection.opened.done():  # failed or cancelled while starting
                error = ToolError(f"MCP server {self.name!r} is unavailable")
                connection.opened.set_exception(error)
                # Marked retrieved: its waiters may all have given up at their deadline
                # (`_open`), and asyncio would log a nobody-awaited failure as a traceback.
                # A later waiter still gets it raised.
                connection.opened.exception()
            if self._connection is connection:
                self._connection = None

    @contextlib.asynccontextmanager
    async def _client(self) -> AsyncIterator[Client]:
        settings = self._settings
        if settings.command is not None:
            params = StdioServerParameters(
                command=settings.command, args=list(settings.args), env=self._env, cwd=settings.cwd
            )
            async with Client(params) as client:
                yield client
            return
        assert settings.url is not None, "check_openai_agent() requires command or url"
        # No read timeout: the server may hold its event stream open; calls have deadlines.
        timeout = httpx2.Timeout(settings.start_timeout, read=None)
        async with (
            httpx2.AsyncClient(headers=self._headers, timeout=timeout) as http,
            Client(streamable_http_client(settings.url, http_client=http)) as client,
        ):
            yield client

    def _offered(self, listed: Sequence[mcp_types.Tool]) -> list[Tool]:
        """The listed tools the allow-list lets through, under their offered names."""
        allowed = self._settings.tools
        if allowed is not None:
            missing = set(allowed) - {tool.name for tool in listed}
            if missing:
                log.warning("MCP server %s lists no tool %s", self.name, ", ".join(sorted(missing)))
        tools: list[Tool] = []
        for entry in listed:
            if allowed is not None and entry.name not in allowed:
                continue
            name = self._prefix + entry.name
            if not _is_function_name(name):
                log.warning("MCP server %s: tool %r left out: not a valid name", self.name, name)
                continue
            try:
                tools.append(offer(McpTool(self, entry, name)))
            except jsonschema.SchemaError:
                log.warning("MCP server %s: tool %s left out: bad input schema", self.name, name)
        return tools

    def _lost(self, connection: _Connection, why: str) -> None:
        if not connection.dropped.is_set():
            log.warning("MCP server %s %s; the next turn reconnects", self.name, why)
            self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        if self._connection is connection:
            self._connection = None
        connection.dropped.set()
        if not connection.opened.done() and connection.owner is not None:
            connection.owner.cancel()  # still starting: stop waiting for it


async def _list_tools(client: Client) -> list[mcp_types.Tool]:
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    for _ in range(_LISTING_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return tools


def result_for_model(result: mcp_types.CallToolResult, max_chars: int) -> Any:
    """A tool's result as the model reads it: its content blocks as text (media as a note,
    which a tool message cannot carry), else its structured content; `ToolError` when
    the server said the tool failed."""
    text = "\n".join(_block_text(block) for block in result.content)
    if result.is_error:
        raise ToolError(_cut(text, _ERROR_CHARS) or "the tool failed")
    if not result.content and result.structured_content is not None:
        return result.structured_content
    return _cut(text, max_chars)


def _block_text(block: mcp_types.ContentBlock) -> str:
    if isinstance(block, mcp_types.TextContent):
        return block.text
    if isinstance(block, mcp_types.ImageContent | mcp_types.AudioContent):
        return f"[{block.type} {block.mime_type}, not shown]"
    if isinstance(block, mcp_types.EmbeddedResource):
        resource = block.resource
        if isinstance(resource, mcp_types.TextResourceContents):
            return resource.text
        return f"[resource {resource.uri} ({resource.mime_type or 'binary'}), not shown]"
    if isinstance(block, mcp_types.ResourceLink):
        return f"[resource link {block.uri}: {block.name}]"
    return f"[{block.type} content, not shown]"


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[cut: the result had {len(text)} characters]"


def _is_function_name(name: str) -> bool:
    return 1 <= len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "_-") for c in name)


def _describe(exc: BaseException) -> str:
    """An exception for the log: its type, and an OS error's reason; never its whole text,
    which can quote a URL or a command line with a secret in it."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    if isinstance(exc, MCPError):
        return f"MCP error {exc.code}"
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _describe(exc.exceptions[0])
    return type(exc).__name__
