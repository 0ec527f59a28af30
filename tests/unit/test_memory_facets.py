"""Memory facets and AI disclosure on the `/ws` core, and agent memory's bounds,
without a socket (spec/identity.md)."""

from __future__ import annotations

import json

import pytest

from portico.domain.memory import AgentMemory, MemoryKey, MemoryLimits, ascii_lower
from portico.errors import FacetRefused, InvalidMessage, MemoryFull
from portico.protocols.omnia.connection import (
    ConnectionLimits,
    DisclosureAcknowledged,
    OmniaConnection,
    memory_facet_of,
)
from portico.store.memory import MemoryStore

LIMITS = ConnectionLimits(max_payload_size=1024, ping_interval=30.0, pong_timeout=60.0)


def connection(**fields: object) -> OmniaConnection:
    return OmniaConnection(
        session_id="sess-1",
        binary=False,
        limits=LIMITS,
        now=0.0,
        wall=1.0,
        **fields,  # type: ignore[arg-type]
    )


def connected(conn: OmniaConnection) -> dict[str, object]:
    frame = json.loads(conn.data_to_send()[0])
    info: dict[str, object] = frame["connected"]
    return info


@pytest.mark.parametrize(
    "values",
    [[""], ["-a"], ["_a"], ["a" * 129], ["a b"], ["é"], ["a;b"], ["a", "a"], ["a", "b"]],
)
def test_malformed_empty_or_repeated_facet_is_invalid(values: list[str]) -> None:
    with pytest.raises(InvalidMessage):
        memory_facet_of(values, None)


@pytest.mark.parametrize("facet", ["a", "7", "Acme.Corp_1:eu/west-2", "z" * 128])
def test_well_formed_facet_is_the_connections(facet: str) -> None:
    assert memory_facet_of([facet], None) == facet


def test_fixed_facet_is_used_when_absent_and_refuses_another() -> None:
    assert memory_facet_of([], "acme") == "acme"
    assert memory_facet_of(["acme"], "acme") == "acme"
    assert memory_facet_of([], None) == ""
    with pytest.raises(FacetRefused) as refused:
        memory_facet_of(["globex"], "acme")
    assert refused.value.http_status == 403
    with pytest.raises(InvalidMessage):  # malformed is 400 before the fixed facet counts
        memory_facet_of([""], "acme")


def test_connected_echoes_the_facet_and_disclosure_only_when_set() -> None:
    assert connected(connection(memory_facet="acme", ai_disclosure=False)) == {
        "capabilities": {"binary_frames": False, "max_payload_size": 1024, "protocol_version": 1},
        "memory_facet": "acme",
        "ai_disclosure": False,
    }
    plain = connected(connection())
    assert "memory_facet" not in plain
    assert "ai_disclosure" not in plain


def test_disclosure_ack_is_an_event_without_a_reply() -> None:
    conn = connection(ai_disclosure=True)
    conn.data_to_send()
    events = conn.receive_text('{"type": "disclosure_ack"}', 1.0)
    assert events == [DisclosureAcknowledged("sess-1")]
    assert conn.data_to_send() == []


# -- agent memory -------------------------------------------------------------------------


def memory(store: MemoryStore, **limits: int) -> AgentMemory:
    key = MemoryKey(principal="alice", agent="default", facet="acme")
    return AgentMemory(store, key, MemoryLimits(**limits), clock=lambda: 5.0)


async def test_memory_refuses_empty_oversized_and_past_the_entry_bound() -> None:
    mine = memory(MemoryStore(), max_entries=2, max_entry_bytes=4)
    with pytest.raises(InvalidMessage):
        await mine.save("  ")
    with pytest.raises(InvalidMessage):
        await mine.save("éé€")  # 7 bytes of UTF-8, 3 characters
    first = await mine.save("abcd")
    assert (first.facet, first.created_at, first.id[:4]) == ("acme", 5.0, "mem-")
    await mine.save("efg")
    with pytest.raises(MemoryFull):
        await mine.save("h")


async def test_memory_search_is_capped_by_the_search_limit() -> None:
    mine = memory(MemoryStore(), search_limit=2)
    for n in range(4):
        await mine.save(f"n{n}")
    assert len(await mine.search()) == 2
    assert len(await mine.search(limit=50)) == 2
    assert len(await mine.search(limit=1)) == 1


def test_ascii_lower_leaves_other_letters_alone() -> None:
    assert ascii_lower("ÀBc") == "Àbc"
