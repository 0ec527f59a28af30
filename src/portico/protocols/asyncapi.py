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
from portico.protocols.session import frames as session

REF_TEMPLATE = "#/components/schemas/{name}"


def _document(
    *, title: str, address: str, description: str, client: Any, server: Any
) -> dict[str, Any]:
    (client_schema, server_schema), components = msgspec.json.schema_components(
        [client, server], ref_template=REF_TEMPLATE
    )
    schemas = {"ClientFrame": client_schema, "ServerFrame": server_schema, **components}
    channel = address.strip("/").replace("/", "_")
    return {
        "asyncapi": "3.0.0",
        "info": {"title": title, "version": "1", "description": description},
        "channels": {
            channel: {
                "address": address,
                "messages": {
                    "clientFrame": {"payload": {"$ref": REF_TEMPLATE.format(name="ClientFrame")}},
                    "serverFrame": {"payload": {"$ref": REF_TEMPLATE.format(name="ServerFrame")}},
                },
            }
        },
        "operations": {
            "receiveClientFrame": {
                "action": "receive",
                "channel": {"$ref": f"#/channels/{channel}"},
                "messages": [{"$ref": f"#/channels/{channel}/messages/clientFrame"}],
            },
            "sendServerFrame": {
                "action": "send",
                "channel": {"$ref": f"#/channels/{channel}"},
                "messages": [{"$ref": f"#/channels/{channel}/messages/serverFrame"}],
            },
        },
        "components": {"schemas": schemas},
    }


def omnia_document() -> dict[str, Any]:
    return _document(
        title="Portico: Omnia agent facade",
        address="/ws",
        description="JSON text frames on GET /ws, wire-compatible with the Omnia "
        "agent-facade protocol. Generated from src/portico/protocols/omnia/frames.py.",
        client=omnia.ClientFrame,
        server=omnia.ServerFrame,
    )


def session_document() -> dict[str, Any]:
    return _document(
        title="Portico: resumable sessions",
        address="/v1/session",
        description="JSON text frames on GET /v1/session (spec/sessions-protocol.md): "
        "numbered messages with seq/ack and exactly-once resume. Generated from "
        "src/portico/protocols/session/frames.py.",
        client=session.ClientFrame,
        server=session.ServerFrame,
    )


DOCUMENTS = {"omnia.json": omnia_document, "session.json": session_document}


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def write_all(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, build in DOCUMENTS.items():
        (directory / name).write_text(render(build()), encoding="utf-8")


if __name__ == "__main__":
    write_all(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/asyncapi"))
