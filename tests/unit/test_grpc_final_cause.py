"""`final_cause`: which words a failed write on a `Converse` stream is logged with.

The race it covers (a write losing to the runtime's own refusal, grpc.aio then ending the
call with its `INTERNAL` "Internal error from Core") is seen only under load in the TLS
conformance test, so the rule is pinned here with a call object that answers as grpc.aio's
does in each case."""

from __future__ import annotations

from typing import Any

import grpc

from portico.runtime.grpc.channel import CORE_ERROR, final_cause


class EndedCall:
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    async def code(self) -> grpc.StatusCode:
        return self._code

    async def details(self) -> str:
        return self._details


async def refused() -> str | None:
    return "unauthenticated"


async def cause(call: Any, probe: Any = refused) -> str:
    return await final_cause(call, "internal", within=1.0, probe=probe)


async def test_the_calls_own_credential_status_names_it() -> None:
    assert await cause(EndedCall(grpc.StatusCode.UNAUTHENTICATED, "bad token")) == "unauthenticated"


async def test_a_write_that_lost_the_race_asks_the_probe() -> None:
    assert await cause(EndedCall(grpc.StatusCode.INTERNAL, CORE_ERROR)) == "unauthenticated"


async def test_a_probe_that_finds_nothing_keeps_the_fallback() -> None:
    async def accepted() -> str | None:
        return None

    call = EndedCall(grpc.StatusCode.INTERNAL, CORE_ERROR)
    assert await cause(call, accepted) == "internal"


async def test_a_runtimes_own_internal_error_is_not_probed() -> None:
    assert await cause(EndedCall(grpc.StatusCode.INTERNAL, "handler crashed")) == "internal"
