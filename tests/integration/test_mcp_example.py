"""examples/mcp_model end to end: `portico serve` with the example's config, the fake
OpenAI server in place of the model. The model asks for the example MCP server's tool,
Portico runs it in the server process it started, the result reaches the model, and
the client on `/ws` sees the model's answer and nothing of the tool call.

The config is the example's own file; only what points at OpenAI (the endpoint, the
model, the key's variable) and the Python that runs the MCP server are replaced.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from support.fake_openai import ENV, FAST, KEY_ENV, FakeOpenAI, text, tool_calls
from support.omnia import OmniaClient
from support.server import ServerProcess

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "mcp_model" / "portico.yaml"


def example_config(fake: FakeOpenAI) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    agent = config["agents"]["default"]
    agent.update(base_url=fake.base_url, model="fake-model", api_key_env=KEY_ENV, **FAST)
    inventory = agent["mcp_servers"]["inventory"]
    # The example runs from the repository root with the `python` that has `mcp`.
    inventory["command"] = sys.executable
    inventory["args"] = [str(REPO / arg) for arg in inventory["args"]]
    return config


@pytest.fixture
def fake(fake_model: FakeOpenAI) -> FakeOpenAI:
    fake_model.reset()
    return fake_model


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, fake_model: FakeOpenAI
) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("portico-mcp-example")
    config = data_dir / "portico.yaml"
    config.write_text(yaml.safe_dump(example_config(fake_model)))
    process = ServerProcess(data_dir, args=("--config", str(config)), env=ENV).start()
    yield process
    process.stop()


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[OmniaClient]:
    async with aiohttp.ClientSession() as http:
        omnia = OmniaClient(await http.ws_connect(server.ws_url))
        await omnia.connected()
        yield omnia


def tool_answers(body: dict[str, Any]) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "tool"]


async def test_the_models_mcp_tool_call_runs_and_the_client_sees_the_answer(
    client: OmniaClient, fake: FakeOpenAI
) -> None:
    fake.push(
        tool_calls(("inventory__stock_level", {"sku": "A-100"})),
        text("There are 12 ", "in stock."),
    )
    frames = await client.ask("How many A-100 are in stock?")
    assert [f["type"] for f in frames] == ["chunk", "chunk", "done"]  # no tool_call frame
    assert "".join(f["content"] for f in frames if f["type"] == "chunk") == "There are 12 in stock."
    first, second = await fake.wait_for(2)
    offered = {tool["function"]["name"] for tool in first.body["tools"]}
    assert offered == {"inventory__stock_level", "inventory__reserve"}
    # The result reached the model, from a server started with the example's env.
    assert tool_answers(second.body) == ["12 units of A-100 in stock (north warehouse)"]


async def test_a_tool_error_from_the_mcp_server_reaches_the_model_and_the_turn_ends(
    client: OmniaClient, fake: FakeOpenAI
) -> None:
    fake.push(tool_calls(("inventory__stock_level", {"sku": "Z-999"})), text("No such product."))
    frames = await client.ask("And Z-999?")
    assert frames[-1]["type"] == "done"
    _, second = await fake.wait_for(2)
    assert tool_answers(second.body) == [
        '{"error": "Error executing tool stock_level: no product with SKU Z-999"}'
    ]


def mcp_children(pid: int) -> list[int]:
    """The processes `pid` started that run the example's MCP server."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"inventory_server.py" in cmdline:
                found.append(int(child))
    return found


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
async def test_the_mcp_server_starts_with_the_first_turn_not_with_portico(
    tmp_path: Path, fake: FakeOpenAI
) -> None:
    config = tmp_path / "portico.yaml"
    config.write_text(yaml.safe_dump(example_config(fake)))
    server = ServerProcess(tmp_path, args=("--config", str(config)), env=ENV).start()
    try:
        assert server.process is not None
        pid = server.process.pid
        assert mcp_children(pid) == []  # not at start-up: at the first turn that needs it
        fake.push(text("hello"))
        async with aiohttp.ClientSession() as http:
            omnia = OmniaClient(await http.ws_connect(server.ws_url))
            await omnia.connected()
            await omnia.ask("hi")
        assert len(mcp_children(pid)) == 1
    finally:
        assert server.stop() == 0
