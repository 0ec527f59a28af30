"""Fuzz the `/v1/rpc` params decoder at its edges: what it accepts fits the archive.

Every integer a request carries fits SQLite's 64 bits, every string is within the
bound its type declares (and every string param declares one), every time has a
zone; anything else is `invalid_request` naming the field, never an event that
would fail later as `internal`.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_rpc_fuzz import opened

from portico.protocols.rpc import frames as f
from portico.protocols.rpc.connection import RequestReceived

INT64 = range(-(2**63), 2**63)
edge_ints = st.one_of(
    st.integers(),
    st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, -1, 0]),
)
edge_strings = st.one_of(
    st.text(max_size=8),
    st.integers(min_value=0, max_value=600).map(lambda n: "x" * n),
)
times = st.one_of(
    st.datetimes().map(datetime.isoformat),  # no zone
    st.datetimes(timezones=st.timezones()).map(datetime.isoformat),
    st.text(max_size=30),
)
values = st.one_of(edge_ints, edge_strings, times, st.none(), st.booleans())


def param_names(method: str) -> list[str]:
    return [field.name for field in msgspec.structs.fields(f.METHODS[method].params)]


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    method = draw(st.sampled_from(sorted(f.METHODS)))
    names = param_names(method)
    params = draw(st.dictionaries(st.sampled_from(names), values, max_size=len(names)))
    return {"id": "r", "method": method, "params": params}


def string_bounds(params: type[msgspec.Struct]) -> dict[str, int | None]:
    """Each top-level string param and its declared `max_length` (None: unbounded)."""
    info = msgspec.inspect.type_info(params)
    assert isinstance(info, msgspec.inspect.StructType)
    bounds: dict[str, int | None] = {}
    for field in info.fields:
        for member in _members(field.type):
            if isinstance(member, msgspec.inspect.StrType):
                bounds[field.name] = member.max_length
    return bounds


def _members(kind: msgspec.inspect.Type) -> list[msgspec.inspect.Type]:
    if isinstance(kind, msgspec.inspect.UnionType):
        return list(kind.types)
    return [kind]


def check_fits(params: msgspec.Struct) -> None:
    bounds = string_bounds(type(params))
    for name in params.__struct_fields__:
        value = getattr(params, name)
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            assert value in INT64, (name, value)
        elif isinstance(value, str) and name in bounds:  # not `result: Any`
            bound = bounds[name]
            assert bound is not None, name
            assert len(value) <= bound, (name, len(value))
        elif isinstance(value, datetime):
            assert value.tzinfo is not None, (name, value)


@pytest.mark.parametrize("method", sorted(f.METHODS))
def test_every_string_param_is_bounded(method: str) -> None:
    unbounded = [n for n, bound in string_bounds(f.METHODS[method].params).items() if bound is None]
    assert not unbounded, unbounded


@settings(max_examples=1000, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_accepted_params_fit_the_archive(frame: dict[str, Any]) -> None:
    conn = opened()
    events = conn.receive_text(json.dumps(frame))
    for event in events:
        assert isinstance(event, RequestReceived)
        check_fits(event.request.params)
    while (data := conn.next_frame()) is not None:
        reply = json.loads(data)
        assert reply["error"]["code"] == "invalid_request", reply
        assert reply["error"]["details"]["field"].startswith("params"), reply
