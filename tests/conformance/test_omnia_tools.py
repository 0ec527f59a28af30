"""Client-side tools on `/ws`: the broker's every path, against a real server.

The short server's tool waits are 1 s for the ack and 2 s for the answer; the
patient server's are 0.5 s and 30 s, far enough apart to tell which one ran out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from portico.domain.states import ToolCallState
from support.archive import open_archive, wait_for_messages
from support.conformance import BOB, SHORT_TOOL_ACK_TIMEOUT, Connect
from support.omnia import OmniaClient, scenario
from support.server import SCRIPT, ServerProcess

TIMED_OUT = "the client did not answer the tool call in time"
PATIENT_ACK_TIMEOUT = 0.5
PATIENT_ANSWER_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def patient_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("portico-patient"),
        args=("--runtime", "scripted", "--script", str(SCRIPT)),
        env={
            "PORTICO_TOOL_ACK_TIMEOUT": str(PATIENT_ACK_TIMEOUT),
            "PORTICO_CLIENT_TOOL_TIMEOUT": str(PATIENT_ANSWER_TIMEOUT),
        },
    ).start()
    yield process
    process.stop()


@pytest.fixture
def connect_patient(http: aiohttp.ClientSession, patient_server: ServerProcess) -> Connect:
    async def connect() -> OmniaClient:
        return OmniaClient(await http.ws_connect(patient_server.ws_url))

    return connect


async def start_tool_turn(client: OmniaClient, name: str = "tool") -> tuple[str, dict[str, Any]]:
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "message", "content": "where am I", **scenario(name)})
    frame = await client.recv()
    assert frame["type"] == "tool_call", frame
    return session_id, frame


async def archived_calls(path: Path, session_id: str) -> list[tuple[str, str | None]]:
    async with open_archive(path) as store:
        calls = await store.list_tool_calls(session_id)
    return [(call.name, call.outcome) for call in calls]


async def test_tool_round_trip(connect_short: Connect, short_archive_path: Path) -> None:
    client = await connect_short()
    session_id, call = await start_tool_turn(client)
    assert call == {
        "type": "tool_call",
        "tool_call": {
            "id": call["tool_call"]["id"],
            "name": "get_location",
            "arguments": {"query": "current"},
            "consent_message": "Allow location access?",
            "categories": ["location"],
        },
        "session_id": session_id,
    }
    call_id = call["tool_call"]["id"]
    await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call_id}})
    await client.send(
        {"type": "tool_result", "tool_result": {"call_id": call_id, "result": {"city": "Oslo"}}}
    )
    frames = await client.turn()
    assert frames[-1]["content"] == 'status=completed result={"city":"Oslo"} error='
    async with open_archive(short_archive_path) as store:
        (record,) = await store.list_tool_calls(session_id)
    assert record.state is ToolCallState.COMPLETED
    assert record.outcome == "completed"
    assert record.result == {"city": "Oslo"}
    assert record.turn_id


async def test_result_without_ack_is_accepted(connect_short: Connect) -> None:
    client = await connect_short()
    _, call = await start_tool_turn(client)
    call_id = call["tool_call"]["id"]
    await client.send({"type": "tool_result", "tool_result": {"call_id": call_id, "result": 7}})
    assert (await client.turn())[-1]["content"] == "status=completed result=7 error="


async def test_ack_extends_the_wait_past_the_ack_timeout(connect_short: Connect) -> None:
    client = await connect_short()
    _, call = await start_tool_turn(client)
    call_id = call["tool_call"]["id"]
    await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call_id}})
    await client.expect_silence(SHORT_TOOL_ACK_TIMEOUT * 1.3)
    await client.send({"type": "tool_result", "tool_result": {"call_id": call_id, "result": "ok"}})
    assert (await client.turn())[-1]["content"] == 'status=completed result="ok" error='


async def test_no_ack_is_denied_and_the_client_is_told(
    connect_patient: Connect, patient_server: ServerProcess
) -> None:
    client = await connect_patient()
    loop = asyncio.get_running_loop()
    started = loop.time()  # before the message, so before the broker's deadline is set
    session_id, call = await start_tool_turn(client)
    call_id = call["tool_call"]["id"]
    frames = await client.turn(within=PATIENT_ANSWER_TIMEOUT)
    waited = loop.time() - started
    # The ack timeout ran out, not the answer timeout (an ordering check, not a bound).
    assert PATIENT_ACK_TIMEOUT <= waited < PATIENT_ANSWER_TIMEOUT / 2, waited
    assert frames[0] == {
        "type": "tool_result",
        "tool_result": {"id": call_id, "error": TIMED_OUT},
        "session_id": session_id,
    }
    assert frames[1:] == [
        {
            "type": "chunk",
            "content": f"status=denied result= error={TIMED_OUT}",
            "session_id": session_id,
        },
        {
            "type": "done",
            "content": f"status=denied result= error={TIMED_OUT}",
            "session_id": session_id,
        },
    ]
    await client.expect_silence()
    archived = await archived_calls(patient_server.archive_path, session_id)
    assert archived == [("get_location", "denied")]
    async with open_archive(patient_server.archive_path) as store:
        (record,) = await store.list_tool_calls(session_id)
    assert record.state is ToolCallState.TIMEOUT
    # A late answer changes nothing.
    await client.send({"type": "tool_result", "tool_result": {"call_id": call_id, "result": 1}})
    assert (await client.recv())["error"]["code"] == "INVALID_MESSAGE"


async def test_ack_then_silence_is_denied(connect_short: Connect, short_archive_path: Path) -> None:
    client = await connect_short()
    session_id, call = await start_tool_turn(client)
    call_id = call["tool_call"]["id"]
    await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call_id}})
    frames = await client.turn()
    assert frames[0]["tool_result"] == {"id": call_id, "error": TIMED_OUT}
    assert frames[-1]["type"] == "done"
    async with open_archive(short_archive_path) as store:
        (record,) = await store.list_tool_calls(session_id)
    assert record.state is ToolCallState.TIMEOUT


async def test_nack_with_a_reason_is_denied_with_it(
    connect_short: Connect, short_archive_path: Path
) -> None:
    client = await connect_short()
    session_id, call = await start_tool_turn(client)
    nack = {"call_id": call["tool_call"]["id"], "reason": "user declined"}
    await client.send({"type": "tool_call_nack", "tool_call_nack": nack})
    assert (await client.turn())[-1]["content"] == "status=denied result= error=user declined"
    assert await archived_calls(short_archive_path, session_id) == [("get_location", "denied")]


async def test_nack_with_an_empty_reason_is_still_a_denial(connect_short: Connect) -> None:
    client = await connect_short()
    _, call = await start_tool_turn(client)
    nack = {"call_id": call["tool_call"]["id"], "reason": ""}
    await client.send({"type": "tool_call_nack", "tool_call_nack": nack})
    assert (await client.turn())[-1]["content"] == "status=denied result= error="


async def test_nack_without_reason_is_invalid_and_the_call_stays_open(
    connect_short: Connect,
) -> None:
    client = await connect_short()
    _, call = await start_tool_turn(client)
    call_id = call["tool_call"]["id"]
    await client.send({"type": "tool_call_nack", "tool_call_nack": {"call_id": call_id}})
    assert (await client.recv())["error"]["code"] == "INVALID_MESSAGE"
    await client.send({"type": "tool_result", "tool_result": {"call_id": call_id, "result": 1}})
    assert (await client.turn())[-1]["content"] == "status=completed result=1 error="


async def test_result_with_error_is_recorded_as_error(
    connect_short: Connect, short_archive_path: Path
) -> None:
    client = await connect_short()
    session_id, call = await start_tool_turn(client)
    result = {"call_id": call["tool_call"]["id"], "error": "GPS unavailable"}
    await client.send({"type": "tool_result", "tool_result": result})
    assert (await client.turn())[-1]["content"] == "status=error result= error=GPS unavailable"
    assert await archived_calls(short_archive_path, session_id) == [("get_location", "error")]


async def test_unknown_call_id_is_invalid_and_changes_nothing(connect_short: Connect) -> None:
    client = await connect_short()
    _, call = await start_tool_turn(client)
    for frame in (
        {"type": "tool_call_ack", "tool_call_ack": {"call_id": "nope"}},
        {"type": "tool_call_nack", "tool_call_nack": {"call_id": "nope", "reason": "x"}},
        {"type": "tool_result", "tool_result": {"call_id": "nope", "result": 1}},
    ):
        await client.send(frame)
        refused = await client.recv()
        assert refused["error"]["code"] == "INVALID_MESSAGE"
        assert "nope" in refused["error"]["message"]
    result = {"call_id": call["tool_call"]["id"], "result": 2}
    await client.send({"type": "tool_result", "tool_result": result})
    assert (await client.turn())[-1]["content"] == "status=completed result=2 error="


async def test_another_principals_call_looks_unknown(connect: Connect) -> None:
    alice = await connect()
    await alice.connected()
    await alice.send({"type": "message", "content": "x", **scenario("tool")})
    call = await alice.recv()
    bob = await connect(as_token=BOB)
    await bob.connected()
    result = {"call_id": call["tool_call"]["id"], "result": "hijack"}
    await bob.send({"type": "tool_result", "tool_result": result})
    assert (await bob.recv())["error"]["code"] == "INVALID_MESSAGE"
    await alice.send({"type": "tool_result", "tool_result": {**result, "result": "mine"}})
    assert (await alice.turn())[-1]["content"] == 'status=completed result="mine" error='


async def test_two_calls_in_one_turn_are_answered_independently(
    connect_short: Connect, short_archive_path: Path
) -> None:
    client = await connect_short()
    session_id, first = await start_tool_turn(client, "two_tools")
    await client.send(
        {"type": "tool_result", "tool_result": {"call_id": first["tool_call"]["id"], "result": 1}}
    )
    assert (await client.recv())["content"] == "first=completed:1 "
    second = await client.recv()
    assert second["tool_call"]["name"] == "get_time"
    assert second["tool_call"]["id"] != first["tool_call"]["id"]
    nack = {"call_id": second["tool_call"]["id"], "reason": "no"}
    await client.send({"type": "tool_call_nack", "tool_call_nack": nack})
    frames = await client.turn()
    assert frames[-1]["content"] == "first=completed:1 second=denied:no"
    assert await archived_calls(short_archive_path, session_id) == [
        ("get_location", "completed"),
        ("get_time", "denied"),
    ]


async def test_tool_frames_are_read_while_the_turn_runs_never_busy(
    connect_short: Connect,
) -> None:
    client = await connect_short()
    _, call = await start_tool_turn(client)
    # A new message is busy, but the tool frames of the running turn are not.
    await client.send({"type": "message", "content": "x"})
    assert (await client.recv())["error"]["code"] == "TURN_IN_PROGRESS"
    call_id = call["tool_call"]["id"]
    await client.send({"type": "tool_call_ack", "tool_call_ack": {"call_id": call_id}})
    await client.send({"type": "tool_result", "tool_result": {"call_id": call_id, "result": 3}})
    frames = await client.turn()
    assert [f["type"] for f in frames] == ["chunk", "done"]


async def test_disconnect_during_a_tool_call_still_ends_the_turn(
    connect_short: Connect, short_archive_path: Path
) -> None:
    client = await connect_short()
    session_id, _ = await start_tool_turn(client)
    await client.ws.close()
    messages = await wait_for_messages(short_archive_path, session_id, 5)
    async with open_archive(short_archive_path) as store:
        (record,) = await store.list_tool_calls(session_id)
    assert record.outcome == "denied"
    # The reply created with the turn ends empty at the call the agent made first; the
    # text after the call and its outcome is a message of its own (docs/storage.md).
    assert [(m.role, m.content_type, m.turn_offset) for m in messages] == [
        ("user", "text", 1),
        ("assistant", "markdown", 2),
        ("assistant", "toolcall_input", 3),
        ("tool", "toolcall_output", 4),
        ("assistant", "markdown", 5),
    ]
    assert record.message_id == messages[2].id
    assert (messages[1].content, messages[1].status) == ("", "completed")
    assert messages[4].content.startswith("status=denied")
