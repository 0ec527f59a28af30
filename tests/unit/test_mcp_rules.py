"""MCP tools without a server: the settings Portico refuses, how a tool result becomes
what the model reads, and how tools found at run time share names with configured ones."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mcp_types
import pytest

from portico.config import Settings, load_settings
from portico.errors import ConfigError
from portico.runtime.mcp import result_for_model
from portico.runtime.server_tools import Tool, Toolbox, ToolError, offer


def agent(**fields: Any) -> Settings:
    base = {"runtime": "openai", "base_url": "https://api.example.com/v1", "model": "m"}
    return load_settings(env={}, flags={"agents": {"bot": {**base, **fields}}})


# -- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("server", "env", "message"),
    [
        ({}, {}, "give exactly one of command"),
        ({"command": "x", "url": "http://127.0.0.1:1/mcp"}, {}, "give exactly one of command"),
        ({"url": "ftp://example.org/mcp"}, {}, "url must start with http:// or https://"),
        (
            {"command": "x", "env_from": {"TOKEN": "MY_TOKEN"}},
            {},
            "names the variable MY_TOKEN, which is not set",
        ),
        (
            {"url": "https://x/mcp", "headers_env": {"Authorization": "A"}},
            {},
            "names the variable A,",
        ),
    ],
)
def test_a_server_that_cannot_run_refuses_to_start(
    server: dict[str, Any], env: dict[str, str], message: str
) -> None:
    settings = agent(mcp_servers={"tools": server})
    with pytest.raises(ConfigError, match=f"MCP server 'tools': {message}"):
        settings.check_startable(env)


def test_a_server_with_its_variables_set_starts() -> None:
    server = {"command": "x", "env_from": {"TOKEN": "MY_TOKEN"}}
    agent(mcp_servers={"tools": server}).check_startable({"MY_TOKEN": "secret"})


@pytest.mark.parametrize(
    "servers",
    [
        {"bad name": {"command": "x"}},
        {"tools": {"command": "x", "api_key": "in the file"}},
        {"tools": {"command": "x", "call_timeout": 0}},
        {"tools": {"command": "x", "max_result_chars": 0}},
    ],
)
def test_invalid_server_fields_are_refused_when_loading(servers: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"mcp_servers"):
        agent(mcp_servers=servers)


# -- results -------------------------------------------------------------------------------------


def result(*content: Any, is_error: bool = False, structured: Any = None) -> Any:
    return mcp_types.CallToolResult(
        content=list(content), is_error=is_error, structured_content=structured
    )


def test_text_blocks_are_joined_and_media_becomes_a_note() -> None:
    blocks = (
        mcp_types.TextContent(text="first"),
        mcp_types.ImageContent(data="aGk=", mime_type="image/png"),
        mcp_types.EmbeddedResource(
            resource=mcp_types.TextResourceContents(uri="file:///a.txt", text="inside")
        ),
        mcp_types.EmbeddedResource(
            resource=mcp_types.BlobResourceContents(uri="file:///b.bin", blob="aGk=")
        ),
        mcp_types.ResourceLink(uri="file:///c.txt", name="c"),
    )
    assert result_for_model(result(*blocks), 1000) == (
        "first\n[image image/png, not shown]\ninside\n"
        "[resource file:///b.bin (binary), not shown]\n[resource link file:///c.txt: c]"
    )


def test_structured_content_alone_is_given_as_json_data() -> None:
    assert result_for_model(result(structured={"celsius": 21}), 1000) == {"celsius": 21}


def test_a_long_result_is_cut_and_the_model_is_told() -> None:
    cut = result_for_model(result(mcp_types.TextContent(text="x" * 50)), 10)
    assert cut == "x" * 10 + "\n[cut: the result had 50 characters]"


def test_an_error_result_is_a_tool_error_with_its_text() -> None:
    with pytest.raises(ToolError, match=r"^quota exceeded$"):
        result_for_model(result(mcp_types.TextContent(text="quota exceeded"), is_error=True), 10)


# -- names ---------------------------------------------------------------------------------------


class Named:
    def __init__(self, name: str, description: str) -> None:
        self.name = name
        self.description = description
        self.parameters: dict[str, Any] = {"type": "object", "properties": {}}

    async def run(self, arguments: dict[str, Any]) -> Any:
        return self.description


class Source:
    def __init__(self, *tools: Named) -> None:
        self._tools = [offer(tool) for tool in tools]

    async def tools(self) -> Sequence[Tool]:
        return self._tools

    async def close(self) -> None:
        pass


async def test_the_first_tool_with_a_name_keeps_it() -> None:
    configured = Named("lookup", "configured")
    first, second = Source(Named("lookup", "one"), Named("a", "one")), Source(Named("a", "two"))
    tools = await Toolbox([configured], [], [first, second]).for_turn(())
    assert {name: tool.description for name, tool in tools.items()} == {
        "lookup": "configured",
        "a": "one",
    }
