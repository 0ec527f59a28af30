"""A small stdio MCP server (the `mcp` SDK's MCPServer) whose tools misbehave on request:
`ok` answers, `hang` never does, `crash` exits the process mid-call, `fail` reports a
tool error, `whoami` tells the HTTP `Authorization` header it got. Run as a script:
`python mcp_faulty.py` (stdio) or `python mcp_faulty.py http PORT` (streamable HTTP
on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("faulty")


@app.tool()
def ok(word: str) -> str:
    """Answers with the word and this process's id (a restart shows as a new id)."""
    return f"ok {word} pid={os.getpid()}"


@app.tool()
async def hang() -> str:
    """Never answers."""
    await asyncio.sleep(3600)
    return "never"


@app.tool()
def crash() -> str:
    """Exits the server process in the middle of the call."""
    os._exit(3)


@app.tool()
def fail() -> str:
    """Fails the way a tool reports failure: an error result."""
    raise ToolError("the disk is full")


@app.tool()
def whoami(ctx: Context) -> str:
    """The Authorization header of the request (over HTTP)."""
    headers = ctx.headers or {}
    return headers.get("authorization", "no authorization header")


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
