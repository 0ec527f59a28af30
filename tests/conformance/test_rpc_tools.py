"""Remote tool calls (Rtc) over `/v1/rpc` against a real server (rpc-protocol.md section 7)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import aiohttp
import pytest

from support.archive import wait_for_tool_calls
from support.conformance import rpc_url, start_rpc_server
from support.rpc import RpcProbe
from support.server import ServerProcess

SHORT_TOOL_TIMEOUT = 1.0
_users = itertools.count()


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A short client tool timeout."""
    env = {"PORTICO_CLIENT_TOOL_TIMEOUT": str(SHORT_TOOL_TIMEOUT)}
    process = start_rpc_server(tmp_path_factory, "portico-rtc", env)
    yield process
    process.stop()


@pytest.fixture
def token() -> str:
    return f"key-{next(_users)}"


@pytest.fixture
def connect(http: aiohttp.ClientSession, tool_server: ServerProcess) -> Callable[..., Any]:
    async def open_probe(token: str, **kwargs: Any) -> RpcProbe:
        return await RpcProbe.open(http, rpc_url(tool_server), token=token, **kwargs)

    return open_probe


async def start_tool_turn(probe: RpcProbe, scenario: str = "tool") -> tuple[str, dict[str, Any]]:
    """Send a message whose turn calls `get_location`; the session and the Rtc."""
    sent = await probe.call(
        "v1.message.send",
        {
            "content_data": "x",
            "client_id": f"c-{next(_users)}",
            "metadata": {"mock_scenario": scenario},
        },
    )
    await probe.until(lambda p: any(r["status"] == "sent" for r in p.entities("rtc")))
    rtc = next(r for r in probe.entities("rtc") if r["status"] == "sent")
    return sent["session_id"], rtc


def reply_text(probe: RpcProbe) -> str:
    final = [
        m
        for m in probe.entities("message")
        if m["status"] == "completed" and m["content_type"] == "markdown"
    ]
    return str(final[-1]["content_data"])


def rtc_states(probe: RpcProbe, rtc_id: str) -> list[str]:
    return [r["status"] for r in probe.entities("rtc") if r["id"] == rtc_id]


async def test_an_rtc_goes_pending_sent_executing_completed_and_the_turn_continues(
    connect: Callable[..., Any], token: str
) -> None:
    probe = await connect(token)
    session_id, rtc = await start_tool_turn(probe)
    assert (rtc["name"], rtc["arguments"], rtc["turn_id"]) == (
        "get_location",
        {"query": "current"},
        rtc["turn_id"],
    )
    # What a client shows when it asks the user travels with the Rtc.
    assert (rtc["consent_message"], rtc["categories"]) == ("Allow location access?", ["location"])
    # The call is archived as a `toolcall_input` message the Rtc points at.
    request = next(m for m in probe.entities("message") if m["content_type"] == "toolcall_input")
    assert rtc["message_id"] == request["id"]
    assert request["content_data"] == {
        "id": rtc["id"],
        "name": "get_location",
        "arguments": {"query": "current"},
    }
    executing = await probe.request(
        "v1.rtc.update_status", {"rtc_id": rtc["id"], "status": "executing", "client_id": "tab-1"}
    )
    assert (executing["result"]["status"], executing["result"]["client_id"]) == (
        "executing",
        "tab-1",
    )
    assert [i["entity"] for u in executing["updates"] for i in u["items"]] == ["rtc"]
    done = await probe.request(
        "v1.rtc.submit_result",
        {"rtc_id": rtc["id"], "success": True, "result": {"city": "Oslo"}, "client_id": "tab-1"},
    )
    assert (done["result"]["status"], done["result"]["result"]) == ("completed", {"city": "Oslo"})
    kinds = [(i["entity"], i["action"]) for u in done["updates"] for i in u["items"]]
    assert kinds == [("rtc", "updated"), ("message", "created")]  # the toolcall_output
    output = done["updates"][-1]["data_list"][0]
    assert (output["role"], output["content_type"]) == ("tool", "toolcall_output")
    assert output["content_data"]["status"] == "completed"
    turn = await probe.wait_turn_end(session_id)
    assert turn["status"] == "completed"
    assert reply_text(probe) == 'status=completed result={"city":"Oslo"} error='
    assert rtc_states(probe, rtc["id"]) == ["pending", "sent", "executing", "completed"]
    listed = await probe.call("v1.rtc.list", {"session_id": session_id})
    assert [(r["id"], r["status"]) for r in listed["items"]] == [(rtc["id"], "completed")]
    assert (await probe.call("v1.rtc.get", {"rtc_id": rtc["id"]}))["status"] == "completed"


async def test_a_rejected_rtc_is_denied_to_the_agent(
    connect: Callable[..., Any], token: str
) -> None:
    probe = await connect(token)
    session_id, rtc = await start_tool_turn(probe)
    rejected = await probe.call("v1.rtc.update_status", {"rtc_id": rtc["id"], "status": "rejected"})
    assert rejected["status"] == "rejected"
    # A repeated rejection (a retry after a lost reply) returns it unchanged.
    again = await probe.request("v1.rtc.update_status", {"rtc_id": rtc["id"], "status": "rejected"})
    assert again["result"]["status"] == "rejected"
    assert again["updates"] == []
    await probe.wait_turn_end(session_id)
    assert reply_text(probe).startswith("status=denied")


async def test_a_failed_tool_reaches_the_agent_as_an_error(
    connect: Callable[..., Any], token: str
) -> None:
    probe = await connect(token)
    session_id, rtc = await start_tool_turn(probe)
    failed = await probe.call(
        "v1.rtc.submit_result", {"rtc_id": rtc["id"], "success": False, "error": "no GPS"}
    )
    assert (failed["status"], failed["error"]) == ("failed", "no GPS")
    await probe.wait_turn_end(session_id)
    assert reply_text(probe) == "status=error result= error=no GPS"


async def test_an_unanswered_rtc_times_out_and_the_turn_continues(
    connect: Callable[..., Any], token: str
) -> None:
    probe = await connect(token)
    session_id, rtc = await start_tool_turn(probe)
    turn = await probe.wait_turn_end(session_id)
    assert turn["status"] == "completed"
    assert rtc_states(probe, rtc["id"])[-1] == "timeout"
    assert reply_text(probe).startswith("status=denied")
    late = await probe.request(
        "v1.rtc.submit_result", {"rtc_id": rtc["id"], "success": True, "result": 1}
    )
    assert late["result"]["status"] == "timeout"  # existing data, not an error
    assert late["updates"] == []


# -- the idempotency table of websocket-rpc.md, row by row --------------------------------------


async def test_submit_result_on_a_terminal_rtc_returns_it_whatever_the_client_id(
    connect: Callable[..., Any], token: str
) -> None:
    probe = await connect(token)
    session_id, rtc = await start_tool_turn(probe)
    params = {"rtc_id": rtc["id"], "success": True, "result": "first", "client_id": "a"}
    first = await probe.request("v1.rtc.submit_result", params)
    await probe.wait_turn_end(session_id)
    same = await probe.request("v1.rtc.submit_result", {**params, "result": "again"})
    other = await probe.request("v1.rtc.submit_result", {**params, "client_id": "b", "result": "x"})
    for repeat in (same, other):
        assert repeat["result"]["result"] == "first"
        assert repeat["result"]["status"] == "completed"
        assert repeat["updates"] == []
    assert first["result"]["result"] == "first"
    outputs = [m for m in probe.entities("message") if m["content_type"] == "toolcall_output"]
    assert len(outputs) == 1


async def test_update_status_checks_the_owning_client_and_the_state_machine(
    connect: Callable[..., Any], token: str
) -> None:
    probe = await connect(token)
    session_id, rtc = await start_tool_turn(probe)
    rtc_id = rtc["id"]
    await probe.call(
        "v1.rtc.update_status", {"rtc_id": rtc_id, "status": "executing", "client_id": "a"}
    )
    repeat = await probe.request(
        "v1.rtc.update_status", {"rtc_id": rtc_id, "status": "executing", "client_id": "a"}
    )
    assert repeat["result"]["status"] == "executing"
    assert repeat["updates"] == []
    other = await probe.error(
        "v1.rtc.update_status", {"rtc_id": rtc_id, "status": "rejected", "client_id": "b"}
    )
    assert other["code"] == "forbidden"
    other_result = await probe.error(
        "v1.rtc.submit_result", {"rtc_id": rtc_id, "success": True, "client_id": "b"}
    )
    assert other_result["code"] == "forbidden"
    await probe.call("v1.rtc.submit_result", {"rtc_id": rtc_id, "success": True, "client_id": "a"})
    await probe.wait_turn_end(session_id)
    for status in ("executing", "rejected"):
        error = await probe.error("v1.rtc.update_status", {"rtc_id": rtc_id, "status": status})
        assert error["code"] == "rtc.invalid_transition"
    bad = await probe.error("v1.rtc.update_status", {"rtc_id": rtc_id, "status": "completed"})
    assert (bad["code"], bad["details"]) == ("invalid_request", {"field": "params.status"})


async def test_session_close_and_turn_stop_accept_a_client_id_without_dedup(
    connect: Callable[..., Any], token: str
) -> None:
    probe = await connect(token)
    sent = await probe.call(
        "v1.message.send", {"content_data": "x", "client_id": f"c-{next(_users)}"}
    )
    await probe.wait_turn_end(sent["session_id"])
    for _ in range(2):
        stop = await probe.request(
            "v1.turn.stop", {"session_id": sent["session_id"], "client_id": "k"}
        )
        assert stop["updates"] == []
    first = await probe.request(
        "v1.session.close", {"session_id": sent["session_id"], "client_id": "k"}
    )
    again = await probe.request(
        "v1.session.close", {"session_id": sent["session_id"], "client_id": "k"}
    )
    assert first["result"]["status"] == again["result"]["status"] == "closed"
    assert len(first["updates"]) == 1
    assert again["updates"] == []  # nothing left to change, not a dedup


async def test_another_users_rtc_is_not_found(connect: Callable[..., Any], token: str) -> None:
    probe = await connect(token)
    _, rtc = await start_tool_turn(probe)
    mallory = await connect(f"key-{next(_users)}")
    for method, params in (
        ("v1.rtc.get", {"rtc_id": rtc["id"]}),
        ("v1.rtc.update_status", {"rtc_id": rtc["id"], "status": "executing"}),
        ("v1.rtc.submit_result", {"rtc_id": rtc["id"], "success": True}),
    ):
        assert (await mallory.error(method, params))["code"] == "rtc.not_found"
    assert rtc_states(probe, rtc["id"])[-1] == "sent"


# -- delivery across connections ---------------------------------------------------------------


async def test_an_rtc_answered_after_a_reconnect_reaches_the_agent_once(
    connect: Callable[..., Any], token: str
) -> None:
    first = await connect(token)
    session_id, rtc = await start_tool_turn(first)
    offset, epoch = first.offsets()[-1], first.connected["epoch"]
    await first.close()
    back = await connect(token, offset=offset, epoch=epoch)
    assert back.connected["recovered"] is True
    await back.call("v1.rtc.submit_result", {"rtc_id": rtc["id"], "success": True, "result": 7})
    turn = await back.wait_turn_end(session_id)
    assert turn["status"] == "completed"
    assert reply_text(back) == "status=completed result=7 error="
    outputs = [m for m in back.entities("message") if m["content_type"] == "toolcall_output"]
    assert len(outputs) == 1
    assert rtc_states(back, rtc["id"]) == ["completed"]


async def test_an_rtc_made_while_no_connection_is_open_is_delivered_on_connect(
    connect: Callable[..., Any], token: str
) -> None:
    first = await connect(token)
    sent = await first.call(
        "v1.message.send",
        {"content_data": "x", "client_id": "late", "metadata": {"mock_scenario": "late_tool"}},
    )
    offset, epoch = first.offsets()[-1], first.connected["epoch"]
    await first.close()  # gone before the agent calls the tool
    back = await connect(token, offset=offset, epoch=epoch)
    await back.until(lambda p: "sent" in [r["status"] for r in p.entities("rtc")])
    rtc = back.entities("rtc")[0]
    assert rtc_states(back, rtc["id"])[:2] == ["pending", "sent"]  # replayed, then delivered
    await back.call("v1.rtc.submit_result", {"rtc_id": rtc["id"], "success": True, "result": "ok"})
    await back.wait_turn_end(sent["session_id"])
    assert reply_text(back) == 'status=completed result="ok" error='


async def test_an_rtc_waiting_for_a_client_is_delivered_to_a_fresh_connection(
    connect: Callable[..., Any], token: str, tool_server: ServerProcess
) -> None:
    first = await connect(token)
    sent = await first.call(
        "v1.message.send",
        {"content_data": "x", "client_id": "fresh", "metadata": {"mock_scenario": "late_tool"}},
    )
    await first.close()
    # The agent calls the tool while nobody is connected.
    assert await wait_for_tool_calls(tool_server.archive_path, sent["session_id"])
    fresh = await connect(token)  # no offset: nothing is replayed
    assert fresh.connected["recovered"] is False
    await fresh.until(lambda p: bool(p.entities("rtc")))
    (rtc,) = fresh.entities("rtc")
    assert rtc["status"] == "sent"  # the change pushed when this connection opened
    await fresh.call("v1.rtc.submit_result", {"rtc_id": rtc["id"], "success": True, "result": 1})
    await fresh.wait_turn_end(sent["session_id"])
    assert reply_text(fresh) == "status=completed result=1 error="


async def test_a_turns_messages_list_in_the_order_it_happened(
    connect: Callable[..., Any], token: str
) -> None:
    """Text, a tool call, its result, text: `v1.message.list` in offset order tells the
    turn as it happened (the reply is split into messages at the call, docs/storage.md)."""
    probe = await connect(token)
    session_id, rtc = await start_tool_turn(probe, "text_tool_text")
    await probe.request(
        "v1.rtc.submit_result",
        {"rtc_id": rtc["id"], "success": True, "result": "Oslo", "client_id": "tab-1"},
    )
    await probe.wait_turn_end(session_id)
    listed = await probe.call("v1.message.list", {"session_id": session_id})
    told = [(m["role"], m["content_type"], m["content_data"]) for m in listed["items"]]
    assert [(role, kind) for role, kind, _ in told] == [
        ("user", "text"),
        ("assistant", "markdown"),
        ("assistant", "toolcall_input"),
        ("tool", "toolcall_output"),
        ("assistant", "markdown"),
    ]
    assert (told[1][2], told[4][2]) == ("Let me look. ", 'You are in "Oslo".')
    assert told[2][2]["id"] == told[3][2]["id"] == rtc["id"]
    offsets = [(m["global_offset"], m["turn_offset"]) for m in listed["items"]]
    assert offsets == sorted(offsets)
    assert [t for _, t in offsets] == [1, 2, 3, 4, 5]
    assert {m["status"] for m in listed["items"]} == {"completed"}


async def test_streamed_media_is_archived_as_a_part_of_its_reply(
    connect: Callable[..., Any], http: aiohttp.ClientSession, tool_server: ServerProcess, token: str
) -> None:
    """The agent's streamed audio (`media` scenario: 200,000 bytes) is kept through the
    media port for `media_ttl` (86,400 s by default) as a part of the reply it came with,
    so a client reading the history later can still play it."""
    probe = await connect(token)
    sent = await probe.call(
        "v1.message.send",
        {
            "content_data": "x",
            "client_id": f"c-{next(_users)}",
            "metadata": {"mock_scenario": "media"},
        },
    )
    await probe.wait_turn_end(sent["session_id"])
    listed = await probe.call("v1.message.list", {"session_id": sent["session_id"]})
    (reply,) = [m for m in listed["items"] if m["content_type"] == "markdown"]
    (part,) = reply["parts"]
    assert (part["type"], part["media"]["mime_type"]) == ("audio", "audio/pcm")
    assert part["media"]["size_bytes"] == 200_000
    _, session_id, _, media_id = part["media"]["storage_ref"].rsplit("/", 3)
    assert session_id == sent["session_id"]
    headers = {"Authorization": f"Bearer {token}"}
    base = tool_server.http_url
    async with http.get(f"{base}/media/download/{session_id}/{media_id}", headers=headers) as got:
        assert got.status == 200
        assert await got.read() == (bytes(range(256)) * 782)[:200_000]
    async with http.get(f"{base}/media/info/{session_id}/{media_id}", headers=headers) as got:
        described = await got.json()
    created, expires = (
        datetime.fromisoformat(described[key]).timestamp() for key in ("created_at", "expires_at")
    )
    assert expires - created == pytest.approx(86_400, abs=1)
