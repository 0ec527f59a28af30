"""Black-box conformance of `GET /ws` against a real `portico serve`, frame by frame."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from portico.domain.states import TurnState
from portico.errors import SessionExpired
from support.archive import open_archive, wait_for_messages
from support.conformance import (
    BOB,
    SHORT_CONTEXT_TTL,
    SHORT_PONG_TIMEOUT,
    SMALL_MAX_PAYLOAD,
    Connect,
)
from support.omnia import scenario
from support.server import ServerProcess

# -- connection ----------------------------------------------------------------------


async def test_connected_is_the_first_frame_with_capabilities(connect: Connect) -> None:
    client = await connect()
    frame = await client.connected()
    assert frame["session_id"]
    assert frame["connected"]["capabilities"] == {
        "binary_frames": False,
        "max_payload_size": 16 * 1024 * 1024,
        "protocol_version": 1,
    }


async def test_binary_query_parameter_is_reflected_in_capabilities(connect: Connect) -> None:
    client = await connect("?binary=true")
    frame = await client.connected()
    assert frame["connected"]["capabilities"]["binary_frames"] is True


async def test_connected_is_sent_once(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    first = await client.ask()
    second = await client.ask()
    assert all(frame["type"] != "connected" for frame in first + second)


async def test_client_may_send_before_connected_arrives(connect: Connect) -> None:
    client = await connect()
    await client.send({"type": "message", "content": "hi"})
    frames = await client.turn()
    assert frames[0]["type"] == "connected"
    assert frames[-1] == {
        "type": "done",
        "content": "Hello world",
        "session_id": frames[0]["session_id"],
    }


async def test_unknown_agent_is_refused_at_upgrade(connect: Connect) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await connect("?agent=nobody")
    assert refused.value.status == 404


@pytest.mark.parametrize("token", [None, "wrong-token"])
async def test_missing_or_bad_credential_gets_401(connect: Connect, token: str | None) -> None:
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await connect(as_token=token)
    assert refused.value.status == 401


async def test_named_agent_and_namespace_are_accepted(connect: Connect) -> None:
    client = await connect("?agent=sandboxed&namespace=production")
    await client.connected()
    assert (await client.ask())[-1]["content"] == "Hello world"


# -- streaming -----------------------------------------------------------------------


async def test_reply_streams_chunks_then_one_done_all_with_session_id(connect: Connect) -> None:
    client = await connect()
    session_id = (await client.connected())["session_id"]
    frames = await client.ask("hi")
    assert frames == [
        {"type": "chunk", "content": "Hello ", "session_id": session_id},
        {"type": "chunk", "content": "world", "session_id": session_id},
        {"type": "done", "content": "Hello world", "session_id": session_id},
    ]
    await client.expect_silence()


async def test_echo_scenario_streams_the_user_text_word_by_word(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    frames = await client.ask("one two three", **scenario("echo"))
    assert [f["content"] for f in frames] == ["one ", "two ", "three", "one two three"]


async def test_done_carries_parts_from_the_runtime(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    (done,) = await client.ask("picture", **scenario("image"))
    assert done["parts"] == [
        {"type": "text", "text": "here"},
        {"type": "image", "media": {"data": "aGVsbG8=", "mime_type": "image/png"}},
    ]


async def test_message_with_parts_only_is_accepted(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    await client.send(
        {"type": "message", "parts": [{"type": "text", "text": "a b"}], **scenario("echo")}
    )
    assert (await client.turn())[-1]["content"] == "a b"


async def test_failing_turn_ends_with_exactly_one_error(connect: Connect) -> None:
    client = await connect()
    session_id = (await client.connected())["session_id"]
    frames = await client.ask("x", **scenario("fail"))
    assert frames == [
        {"type": "chunk", "content": "partial", "session_id": session_id},
        {
            "type": "error",
            "error": {"code": "PROVIDER_UNAVAILABLE", "message": "model endpoint unavailable"},
            "session_id": session_id,
        },
    ]
    await client.expect_silence()
    # The session is usable again: the next turn starts cleanly.
    assert (await client.ask())[-1]["type"] == "done"


async def test_unknown_runtime_error_becomes_generic_internal_error(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    frames = await client.ask("x", **scenario("leaky"))
    error = frames[-1]
    assert error["type"] == "error"
    assert error["error"] == {"code": "INTERNAL_ERROR", "message": "internal error"}
    assert "hunter2" not in json.dumps(client.frames)


# -- one turn per session ------------------------------------------------------------


async def test_second_message_while_busy_gets_turn_in_progress(
    connect: Connect, archive_path: Path
) -> None:
    client = await connect()
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "message", "content": "slowly", **scenario("slow")})
    assert (await client.recv())["content"] == "a"
    await client.send({"type": "message", "content": "again"})
    busy = await client.recv()
    assert busy["type"] == "error"
    assert busy["error"]["code"] == "TURN_IN_PROGRESS"
    assert busy["session_id"] == session_id
    assert (await client.turn())[-1] == {"type": "done", "content": "a", "session_id": session_id}
    messages = await wait_for_messages(archive_path, session_id, 2)
    assert [(m.role, m.content) for m in messages] == [("user", "slowly"), ("assistant", "a")]


async def test_turn_finishes_and_is_archived_after_disconnect(
    connect: Connect, archive_path: Path
) -> None:
    client = await connect()
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "message", "content": "leaving", **scenario("slow")})
    assert (await client.recv())["content"] == "a"
    await client.ws.close()
    messages = await wait_for_messages(archive_path, session_id, 2)
    assert [(m.role, m.content, m.global_offset) for m in messages] == [
        ("user", "leaving", 1),
        ("assistant", "a", 2),
    ]
    async with open_archive(archive_path) as store:
        (turn,) = await store.list_turns(session_id)
    assert turn.state is TurnState.COMPLETED


# -- resume --------------------------------------------------------------------------


async def test_resume_of_an_owned_session_continues_it(
    connect: Connect, archive_path: Path
) -> None:
    first = await connect()
    session_id = (await first.connected())["session_id"]
    await first.ask("one")
    await first.ws.close()

    second = await connect()
    own = (await second.connected())["session_id"]
    frames = await second.ask("two", session_id=session_id)
    assert {frame["session_id"] for frame in frames} == {session_id}
    messages = await wait_for_messages(archive_path, session_id, 4)
    assert [m.content for m in messages] == ["one", "Hello world", "two", "Hello world"]
    # A message without session_id still joins the connection's own session.
    assert {f["session_id"] for f in await second.ask("three")} == {own}


async def test_foreign_session_looks_expired_and_changes_nothing(
    connect: Connect, archive_path: Path
) -> None:
    alice = await connect()
    session_id = (await alice.connected())["session_id"]
    await alice.ask("private")

    bob = await connect(as_token=BOB)
    await bob.connected()
    await bob.send({"type": "message", "content": "let me in", "session_id": session_id})
    refused = await bob.recv()
    assert refused["type"] == "error"
    assert refused["error"] == {"code": "SESSION_EXPIRED", "message": SessionExpired.MESSAGE}
    await bob.expect_silence()
    async with open_archive(archive_path) as store:
        assert [m.content for m in await store.list_messages(session_id)] == [
            "private",
            "Hello world",
        ]
    # The socket stays open and the connection's own session still works.
    assert (await bob.ask("mine"))[-1]["type"] == "done"


async def test_foreign_busy_session_looks_expired_not_busy(connect: Connect) -> None:
    alice = await connect()
    session_id = (await alice.connected())["session_id"]
    await alice.send({"type": "message", "content": "slow", **scenario("slow")})
    await alice.recv()
    bob = await connect(as_token=BOB)
    await bob.connected()
    await bob.send({"type": "message", "content": "x", "session_id": session_id})
    assert (await bob.recv())["error"]["code"] == "SESSION_EXPIRED"


async def test_unseen_session_id_opens_a_new_session_owned_by_the_caller(
    connect: Connect, archive_path: Path
) -> None:
    client = await connect()
    await client.connected()
    frames = await client.ask("hello", session_id="my-own-id-123")
    assert {frame["session_id"] for frame in frames} == {"my-own-id-123"}
    async with open_archive(archive_path) as store:
        session = await store.get_session("my-own-id-123")
    assert session is not None
    assert session.owner == "alice"


async def test_session_opened_without_authentication_is_owned_by_local(
    connect_short: Connect, short_archive_path: Path
) -> None:
    client = await connect_short()
    session_id = (await client.connected())["session_id"]
    await client.ask("whose?")
    async with open_archive(short_archive_path) as store:
        session = await store.get_session(session_id)
    assert session is not None
    assert session.owner == "local"


async def test_expired_context_gets_session_expired(connect_short: Connect) -> None:
    first = await connect_short()
    session_id = (await first.connected())["session_id"]
    await first.ask("remember me")
    await first.ws.close()
    await asyncio.sleep(SHORT_CONTEXT_TTL * 2)  # the TTL is wall-clock time by definition

    second = await connect_short()
    own = (await second.connected())["session_id"]
    await second.send({"type": "message", "content": "still there?", "session_id": session_id})
    refused = await second.recv()
    assert refused["error"] == {"code": "SESSION_EXPIRED", "message": SessionExpired.MESSAGE}
    # Sent again without session_id, it joins the connection's own session.
    assert {f["session_id"] for f in await second.ask("still there?")} == {own}


# -- metadata ------------------------------------------------------------------------


def _keys(count: int) -> dict[str, str]:
    return {f"key{i}": "v" for i in range(count)}


@pytest.mark.parametrize(
    ("metadata", "names"),
    [
        (_keys(33), "32 keys"),
        ({"bad key!": "v"}, "1 to 64 characters"),
        ({"k" * 65: "v"}, "1 to 64 characters"),
        ({"big": "x" * (8 * 1024 + 1)}, "8 KiB"),
        ({f"k{i}": "x" * 8000 for i in range(5)}, "32 KiB"),
    ],
    ids=["too-many-keys", "bad-key-chars", "key-too-long", "value-too-big", "total-too-big"],
)
async def test_metadata_over_a_limit_is_refused_naming_it(
    connect: Connect, archive_path: Path, metadata: dict[str, str], names: str
) -> None:
    client = await connect()
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "message", "content": "x", "metadata": metadata})
    refused = await client.recv()
    assert refused["error"]["code"] == "INVALID_MESSAGE"
    assert names in refused["error"]["message"]
    async with open_archive(archive_path) as store:
        assert await store.get_session(session_id) is None


async def test_reserved_metadata_keys_are_not_counted_or_forwarded(
    connect: Connect, archive_path: Path
) -> None:
    client = await connect()
    session_id = (await client.connected())["session_id"]
    metadata = {**_keys(32), "mock_scenario": "echo", "content_type": "text", "omnia.trace": "t"}
    frames = await client.ask("fine", metadata=metadata)
    assert frames[-1]["content"] == "fine"
    (user, _) = await wait_for_messages(archive_path, session_id, 2)
    assert user.metadata == _keys(32)


async def test_reserved_value_over_8_kib_is_accepted_and_not_forwarded(
    connect: Connect, archive_path: Path
) -> None:
    client = await connect()
    session_id = (await client.connected())["session_id"]
    metadata = {"user": "u1", "omnia.big": "x" * (8 * 1024 + 1), "mock_scenario": "echo"}
    frames = await client.ask("fine", metadata=metadata)
    # The echo scenario ran: the directives reached the runtime.
    assert frames[-1] == {"type": "done", "content": "fine", "session_id": session_id}
    (user, _) = await wait_for_messages(archive_path, session_id, 2)
    assert user.metadata == {"user": "u1"}


@pytest.mark.parametrize("value", [5, ["a"], None])
async def test_non_string_metadata_value_is_invalid(connect: Connect, value: object) -> None:
    client = await connect()
    await client.connected()
    await client.send({"type": "message", "content": "x", "metadata": {"k": value}})
    assert (await client.recv())["error"]["code"] == "INVALID_MESSAGE"


# -- declare -------------------------------------------------------------------------


BIG_DECLARE = {"sandboxes": {"workspace": {"note": "x" * (16 * 1024)}}}
SMALL_DECLARE = {"sandboxes": {"workspace": {"mounts": []}}}


async def test_declare_over_16_kib_on_the_opening_message_is_invalid(
    connect: Connect, archive_path: Path
) -> None:
    client = await connect("?agent=sandboxed")
    session_id = (await client.connected())["session_id"]
    await client.send({"type": "message", "content": "x", "declare": BIG_DECLARE})
    refused = await client.recv()
    assert refused == {
        "type": "error",
        "error": {"code": "INVALID_MESSAGE", "message": "declare exceeds 16 KiB"},
        "session_id": session_id,
    }
    async with open_archive(archive_path) as store:
        assert await store.get_session(session_id) is None
    # Nothing opened: the next message opens the session with its own declaration.
    assert (await client.ask("y", declare=SMALL_DECLARE))[-1]["type"] == "done"
    async with open_archive(archive_path) as store:
        session = await store.get_session(session_id)
    assert session is not None
    assert session.declare == SMALL_DECLARE


async def test_declare_over_16_kib_on_a_later_message_is_ignored(
    connect: Connect, archive_path: Path
) -> None:
    """declare is read only where a session opens, so on later messages its size does
    not matter either: the message is answered, the stored declaration is unchanged."""
    client = await connect("?agent=sandboxed")
    session_id = (await client.connected())["session_id"]
    await client.ask("open", declare=SMALL_DECLARE)
    assert (await client.ask("again", declare=BIG_DECLARE))[-1]["type"] == "done"
    # A resume from another connection does not open the session either.
    other = await connect("?agent=sandboxed")
    await other.connected()
    frames = await other.ask("resumed", session_id=session_id, declare=BIG_DECLARE)
    assert frames[-1]["type"] == "done"
    async with open_archive(archive_path) as store:
        session = await store.get_session(session_id)
    assert session is not None
    assert session.declare == SMALL_DECLARE


async def test_declare_over_16_kib_opening_an_unseen_session_id_is_invalid(
    connect: Connect, archive_path: Path
) -> None:
    client = await connect("?agent=sandboxed")
    await client.connected()
    frame = {"type": "message", "content": "x", "session_id": "big-declare-1"}
    await client.send({**frame, "declare": BIG_DECLARE})
    refused = await client.recv()
    assert refused["error"] == {"code": "INVALID_MESSAGE", "message": "declare exceeds 16 KiB"}
    async with open_archive(archive_path) as store:
        assert await store.get_session("big-declare-1") is None


async def test_empty_declare_is_accepted(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    assert (await client.ask("x", declare={}))[-1]["type"] == "done"


async def test_unknown_sandbox_is_refused_and_the_next_message_opens_the_session(
    connect: Connect, archive_path: Path
) -> None:
    client = await connect("?agent=sandboxed")
    session_id = (await client.connected())["session_id"]
    declare = {"sandboxes": {"nope/1": {"mounts": [{"role": "project", "id": "p"}]}}}
    await client.send({"type": "message", "content": "x", "declare": declare})
    refused = await client.recv()
    assert refused["error"]["code"] == "SESSION_DECLARATION_REFUSED"
    assert refused["error"]["details"] == {
        "type": "sandbox",
        "handle": "nope/1",
        "reason": "UnknownSandbox",
        "message": "the agent has no sandbox named 'nope'",
    }
    async with open_archive(archive_path) as store:
        assert await store.get_session(session_id) is None
    good = {"sandboxes": {"workspace/main": {"mounts": []}}}
    assert (await client.ask("y", declare=good))[-1]["type"] == "done"
    async with open_archive(archive_path) as store:
        session = await store.get_session(session_id)
    assert session is not None
    assert session.declare == good


async def test_unknown_declaration_type_is_refused(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    await client.send({"type": "message", "content": "x", "declare": {"gpus": {"a": 1}}})
    refused = await client.recv()
    assert refused["error"]["code"] == "SESSION_DECLARATION_REFUSED"
    assert refused["error"]["details"]["reason"] == "UnknownDeclarationType"
    assert refused["error"]["details"]["type"] == "gpus"


async def test_declare_is_ignored_after_the_session_opened(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    await client.ask("open")
    assert (await client.ask("x", declare={"gpus": {}}))[-1]["type"] == "done"


# -- malformed input -----------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        "not json",
        "[1, 2]",
        '{"content": "no type"}',
        '{"type": "launch_missiles"}',
        '{"type": "message", "content": 5}',
        '{"type": "message"}',
        '{"type": "message", "content": ""}',
        '{"type": "message", "parts": "text"}',
        '{"type": "message", "parts": [{"type": "image"}]}',
        '{"type": "message", "parts": [{"type": "hologram", "text": "x"}]}',
        '{"type": "message", "content": "x", "session_id": "bad id with spaces"}',
        '{"type": "tool_call_nack", "tool_call_nack": {"call_id": "c1"}}',
    ],
)
async def test_malformed_frames_get_invalid_message_and_keep_the_socket(
    connect: Connect, raw: str
) -> None:
    client = await connect()
    await client.connected()
    await client.send_raw(raw)
    refused = await client.recv()
    assert refused["type"] == "error"
    assert refused["error"]["code"] == "INVALID_MESSAGE"
    assert (await client.ask())[-1]["type"] == "done"


async def test_tool_result_for_an_unknown_call_is_invalid(connect: Connect) -> None:
    client = await connect()
    await client.connected()
    await client.send({"type": "tool_result", "tool_result": {"call_id": "nope", "result": 1}})
    refused = await client.recv()
    assert refused["error"]["code"] == "INVALID_MESSAGE"
    assert "nope" in refused["error"]["message"]


async def test_frame_above_max_payload_size_closes_1009(
    connect_short: Connect, short_server: ServerProcess
) -> None:
    client = await connect_short()
    await client.connected()
    await client.send_raw(json.dumps({"type": "message", "content": "x" * SMALL_MAX_PAYLOAD}))
    msg = await client.ws.receive(timeout=10)
    assert msg.type is aiohttp.WSMsgType.CLOSE
    assert client.ws.close_code == 1009


# -- keepalive -----------------------------------------------------------------------


async def test_server_pings_and_closes_a_silent_peer(
    http: aiohttp.ClientSession, short_server: ServerProcess
) -> None:
    ws = await http.ws_connect(short_server.ws_url, autoping=False)
    kinds: list[aiohttp.WSMsgType] = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not ws.closed:
        msg = await ws.receive(timeout=10)
        kinds.append(msg.type)
    assert aiohttp.WSMsgType.PING in kinds
    assert ws.close_code == 1011
    assert loop.time() - started >= SHORT_PONG_TIMEOUT * 0.9


async def test_answered_pings_keep_the_connection_open(connect_short: Connect) -> None:
    client = await connect_short()  # aiohttp answers pings automatically
    await client.connected()
    await client.expect_silence(SHORT_PONG_TIMEOUT * 2)
    assert not client.ws.closed
    assert (await client.ask())[-1]["type"] == "done"


async def test_a_ping_further_than_a_wheel_slot_comes_on_time_not_early(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    # A ping interval over the deadline wheel's slot (server/deadlines.py, 1 s) waits
    # in the shared wheel, then on a timer of its own: the ping comes, never early.
    interval = 1.6
    env = {"PORTICO_PING_INTERVAL": str(interval), "PORTICO_PONG_TIMEOUT": "30"}
    server = ServerProcess(tmp_path / "data", env=env).start()
    try:
        ws = await http.ws_connect(server.ws_url, autoping=False)
        loop = asyncio.get_running_loop()
        started = loop.time()
        msg = await ws.receive(timeout=10)
        assert msg.type is aiohttp.WSMsgType.TEXT  # `connected`
        msg = await ws.receive(timeout=10)
        assert msg.type is aiohttp.WSMsgType.PING
        assert loop.time() - started >= interval * 0.99
        await ws.pong(msg.data)
        msg = await ws.receive(timeout=10)
        assert msg.type is aiohttp.WSMsgType.PING  # the next one, armed again
        await ws.close()
    finally:
        server.stop()
