"""A small MCP tool server for the example: a warehouse's stock levels, over stdio.

Portico starts it (see portico.yaml) and offers its tools to the model as
`inventory__stock_level` and `inventory__reserve`. Any MCP server works the same way:
this one is written with the official `mcp` SDK so that the example needs nothing
but Python.
"""

from __future__ import annotations

import os

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("inventory")

STOCK = {"A-100": 12, "B-200": 0, "C-300": 7}


@app.tool()
def stock_level(sku: str) -> str:
    """How many units of a product (by its SKU, e.g. A-100) are in stock."""
    if sku not in STOCK:
        raise ToolError(f"no product with SKU {sku}")
    return f"{STOCK[sku]} units of {sku} in stock ({os.environ.get('WAREHOUSE', 'main')} warehouse)"


@app.tool()
def reserve(sku: str, units: int) -> str:
    """Reserve units of a product for the customer."""
    if STOCK.get(sku, 0) < units:
        raise ToolError(f"only {STOCK.get(sku, 0)} units of {sku} in stock")
    STOCK[sku] -= units
    return f"reserved {units} units of {sku}; {STOCK[sku]} left"


if __name__ == "__main__":
    app.run()
