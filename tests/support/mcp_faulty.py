"""A small stdio MCP server (the `mcp` SDK's MCPServer) whose tools misbehave on request:
`ok` answers, `hang` never does, `crash` exits the process mid-call, `fail` reports a
tool error. Run as a script: `python mcp_faulty.py`."""

from __future__ import annotations

import asyncio
import os

from mcp.server import MCPServer
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


if __name__ == "__main__":
    app.run()
