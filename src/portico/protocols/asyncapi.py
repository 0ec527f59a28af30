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
from portico.protocols.rpc import frames as rpc
from portico.protocols.session import frames as session

REF_TEMPLATE = "#/components/schemas/{name}"


def _document(
    *,
    title: str,
    address: str,
    description: str,
    client: Any,
    server: Any,
    extra: tuple[Any, ...] = (),
) -> dict[str, Any]:
    schemas = _schemas(client, server, extra)
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


def _schemas(client: Any, server: Any, extra: tuple[Any, ...]) -> dict[str, Any]:
    """The components; a frame union given as a tuple of types becomes an `anyOf` of
    their schemas (msgspec cannot describe a union of untagged structs itself)."""
    sides = [tuple(side) if isinstance(side, tuple) else (side,) for side in (client, server)]
    types = [t for side in sides for t in side]
    generated, components = msgspec.json.schema_components(
        [*types, *extra], ref_template=REF_TEMPLATE
    )
    schemas: dict[str, Any] = dict(components)
    position = 0
    for name, side in zip(("ClientFrame", "ServerFrame"), sides, strict=True):
        parts = generated[position : position + len(side)]
        position += len(side)
        schemas[name] = parts[0] if len(parts) == 1 else {"anyOf": list(parts)}
    return schemas


def omnia_document() -> dict[str, Any]:
    return _document(
        title="Portico: Omnia agent facade",
        address="/ws",
        description="JSON text frames on GET /ws, wire-compatible with the Omnia "
        "agent-facade protocol. Every server frame carries `timestamp`, when it was "
        "sent (RFC 3339, UTC, to the millisecond), as Omnia's own AsyncAPI document "
        "requires. A voice call travels on the same socket: caller audio in binary "
        "frames with the 32-byte OMNI header, agent audio in binary frames (binary=true) "
        "or `media_chunk`, `?resume=<session id>` re-attaching a parked call "
        "(docs/voice.md). Generated from src/portico/protocols/omnia/frames.py.",
        client=omnia.ClientFrame,
        server=omnia.ServerFrame,
    )


def session_document() -> dict[str, Any]:
    return _document(
        title="Portico: resumable sessions",
        address="/v1/session",
        description="JSON text frames on GET /v1/session (spec/sessions-protocol.md): "
        "numbered messages with seq/ack and exactly-once resume. With the `audio` "
        "capability, media bytes travel in binary frames with the 32-byte OMNI header "
        "between `audio_start` and `audio_end` (docs/session.md). Generated from "
        "src/portico/protocols/session/frames.py.",
        client=session.ClientFrame,
        server=session.ServerFrame,
    )


def rpc_document() -> dict[str, Any]:
    params = tuple(dict.fromkeys(method.params for method in rpc.METHODS.values()))
    document = _document(
        title="Portico: RPC",
        address="/v1/rpc",
        description="JSON text frames on GET /v1/rpc (spec/rpc-protocol.md): `connect`, "
        "requests by id, replies with the updates they produced, and pushed `update`, "
        "`gap` and `live` frames. Generated from src/portico/protocols/rpc/frames.py.",
        client=rpc.DOCUMENTED_CLIENT_FRAMES,
        server=rpc.SERVER_FRAMES,
        extra=params,
    )
    document["x-rpc-methods"] = {
        name: {
            "action": method.action,
            "params": {"$ref": REF_TEMPLATE.format(name=method.params.__name__)},
            **({"maxLimit": method.max_limit} if method.max_limit is not None else {}),
        }
        for name, method in rpc.METHODS.items()
    }
    return document


DOCUMENTS = {
    "omnia.json": omnia_document,
    "session.json": session_document,
    "rpc.json": rpc_document,
}


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def write_all(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, build in DOCUMENTS.items():
        (directory / name).write_text(render(build()), encoding="utf-8")


if __name__ == "__main__":
    write_all(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/asyncapi"))
