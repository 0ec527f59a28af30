"""An MCP server that never starts (runtime/mcp.py): every waiter gave up at its deadline,
so the failure the owner records when it stops is retrieved by no one. It must not be
reported as "Future exception was never retrieved" (a traceback in a clean CI log)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from portico.config import McpServerSettings
from portico.runtime.mcp import McpServer


async def test_a_server_that_never_starts_leaves_no_unretrieved_failure() -> None:
    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        settings = McpServerSettings(command="sleep", args=("60",), start_timeout=0.2)
        server = McpServer("sleeper", settings, env={})
        assert await server.tools() == []  # the turn goes on without its tools
        await server.close()  # the owner stopped: the `sleep` child is gone
        gc.collect()  # an unretrieved failure is reported when its future is collected
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    assert [context["message"] for context in reported] == []
