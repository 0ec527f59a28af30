"""The committed AsyncAPI documents are exactly what the typed frames generate."""

from __future__ import annotations

from pathlib import Path

import pytest

from portico.protocols.asyncapi import DOCUMENTS, render

DOCS = Path(__file__).resolve().parents[2] / "docs" / "asyncapi"


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_committed_document_matches_the_types(name: str) -> None:
    committed = (DOCS / name).read_text(encoding="utf-8")
    assert committed == render(DOCUMENTS[name]()), (
        f"docs/asyncapi/{name} is stale: run `python -m portico.protocols.asyncapi`"
    )


def test_every_server_frame_type_is_in_the_omnia_document() -> None:
    schemas = DOCUMENTS["omnia.json"]()["components"]["schemas"]
    tags = {
        schemas[ref["$ref"].rsplit("/", 1)[1]]["properties"]["type"]["enum"][0]
        for ref in schemas["ServerFrame"]["anyOf"]
    }
    assert tags == {
        "connected",
        "chunk",
        "done",
        "tool_call",
        "tool_result",
        "upload_ready",
        "media_chunk",
        "interrupt",
        "session_config",
        "error",
    }
