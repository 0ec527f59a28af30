"""AsyncAPI documents generated from the typed frames, so the docs cannot drift.

`python -m portico.protocols.asyncapi` rewrites docs/asyncapi/; a test fails
when the committed files differ from what the types generate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from portico.protocols.omnia import frames as omnia

REF_TEMPLATE = "#/components/schemas/{name}"


def omnia_document() -> dict[str, Any]:
    (client, server), components = msgspec.json.schema_components(
        [omnia.ClientFrame, omnia.ServerFrame], ref_template=REF_TEMPLATE
    )
    schemas = {"ClientFrame": client, "ServerFrame": server, **components}
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Portico: Omnia agent facade",
            "version": "1",
            "description": "JSON text frames on GET /ws, wire-compatible with the Omnia "
            "agent-facade protocol. Generated from src/portico/protocols/omnia/frames.py.",
        },
        "channels": {
            "ws": {
                "address": "/ws",
                "messages": {
                    "clientFrame": {"payload": {"$ref": REF_TEMPLATE.format(name="ClientFrame")}},
                    "serverFrame": {"payload": {"$ref": REF_TEMPLATE.format(name="ServerFrame")}},
                },
            }
        },
        "operations": {
            "receiveClientFrame": {
                "action": "receive",
                "channel": {"$ref": "#/channels/ws"},
                "messages": [{"$ref": "#/channels/ws/messages/clientFrame"}],
            },
            "sendServerFrame": {
                "action": "send",
                "channel": {"$ref": "#/channels/ws"},
                "messages": [{"$ref": "#/channels/ws/messages/serverFrame"}],
            },
        },
        "components": {"schemas": schemas},
    }


DOCUMENTS = {"omnia.json": omnia_document}


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def write_all(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, build in DOCUMENTS.items():
        (directory / name).write_text(render(build()), encoding="utf-8")


if __name__ == "__main__":
    write_all(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/asyncapi"))
