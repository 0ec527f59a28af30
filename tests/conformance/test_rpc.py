"""`/v1/rpc` against a real server, frame by frame (spec/rpc-protocol.md, websocket-rpc.md).

Each test takes users of its own (API keys `key-N` for `user-N`), so its update log
holds exactly what it did, while one server process serves the whole module.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest

from support.conformance import rpc_url, start_rpc_server
from support.omnia import OmniaClient
from support.rpc import RpcClosed, RpcProbe
from support.server import ServerProcess

_next_user = itertools.count()
Open = Callable[..., Awaitable[RpcProbe]]


@pytest.fixture(scope="module")
def rpc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_rpc_server(tmp_path_factory, "portico-rpc")
    yield process
    process.stop()


@pytest.fixture
def new_user() -> Callable[[], str]:
    """A user no other test touches: returns its API key."""
    return lambda: f"key-{next(_next_user)}"


@pytest.fixture
async def open_rpc(http: aiohttp.ClientSession, rpc_server: ServerProcess) -> AsyncIterator[Open]:
    probes: list[RpcProbe] = []

    async def open_probe(token: str, **kwargs: Any) -> RpcProbe:
        probe = await RpcProbe.open(http, rpc_url(rpc_server), token=token, **kwargs)
        probes.append(probe)
        return probe

    yield open_probe
    for probe in probes:
        await probe.close()


@pytest.fixture
async def alice(open_rpc: Open, new_user: Callable[[], str]) -> RpcProbe:
    return await open_rpc(new_user())


async def send(probe: RpcProbe, text: str = "hi", **params: Any) -> dict[str, Any]:
    params.setdefault("client_id", f"c-{next(_next_user)}-{text}")
    result: dict[str, Any] = await probe.call("v1.message.send", {"content_data": text, **params})
    return result


async def send_scenario(probe: RpcProbe, scenario: str, **params: Any) -> dict[str, Any]:
    return await send(probe, scenario, metadata={"mock_scenario": scenario}, **params)


async def finished(probe: RpcProbe, session_id: str) -> dict[str, Any]:
    return await probe.wait_turn_end(session_id)


# -- connect ----------------------------------------------------------------------------------


async def test_connect_without_a_token_is_unauthenticated_and_closes_4401(
    http: aiohttp.ClientSession, rpc_server: ServerProcess
) -> None:
    for token in (None, "wrong"):
        probe = await RpcProbe.open(http, rpc_url(rpc_server), token=token)
        assert probe.connected["type"] == "error"
        assert probe.connected["error"]["code"] == "unauthenticated"
        with pytest.raises(RpcClosed):
            await probe.next_frame()
        assert probe.ws.close_code == 4401


async def test_a_request_before_connect_is_unauthenticated(
    http: aiohttp.ClientSession, rpc_server: ServerProcess
) -> None:
    ws = await http.ws_connect(rpc_url(rpc_server))
    await ws.send_json({"id": "1", "method": "v1.session.list"})
    frame = await ws.receive_json()
    assert frame["error"]["code"] == "unauthenticated"
    await ws.receive()
    assert ws.close_code == 4401


async def test_a_first_connect_is_not_recovered_and_reports_the_head(
    open_rpc: Open, new_user: Callable[[], str]
) -> None:
    token = new_user()
    first = await open_rpc(token)
    assert first.connected["type"] == "connected"
    assert first.connected["recovered"] is False
    assert first.connected["offset"] == 0
    assert first.connected["user_id"] == token.replace("key", "user")
    await send(first)
    second = await open_rpc(token)
    assert second.connected["offset"] >= 2  # session created, message and turn created
    assert second.connected["epoch"] == first.connected["epoch"]


async def test_malformed_frames_are_answered_and_the_connection_stays_open(alice: RpcProbe) -> None:
    await alice.ws.send_str("not json")
    frame = await alice.next_frame()
    assert frame["type"] == "error"
    assert frame["error"]["code"] == "invalid_request"
    await alice.send({"id": "x", "method": "v1.no.such"})
    frame = await alice.next_frame()
    assert frame == {
        "id": "x",
        "error": {"code": "method_not_found", "message": "no method 'v1.no.such'"},
    }
    assert (await alice.call("v1.session.list"))["items"] == []


# -- message.send and the turn it starts --------------------------------------------------------


async def test_send_creates_a_session_stores_the_message_and_streams_the_reply(
    alice: RpcProbe,
) -> None:
    reply = await alice.request(
        "v1.message.send", {"content_data": "hello", "client_id": "c1", "client_session_id": "cs1"}
    )
    result = reply["result"]
    assert result["turn_id"] == ""
    assert result["session_id"]
    assert result["message_id"]
    session_id = result["session_id"]
    # The reply's updates: the session, then (one update) the user message, its turn,
    # the session's activity and the assistant's reply, created empty and `pending`,
    # then the turn's start (it starts at once: the same write, an update of its own).
    items = [(i["entity"], i["action"]) for u in reply["updates"] for i in u["items"]]
    assert items == [
        ("session", "created"),
        ("message", "created"),
        ("turn", "created"),
        ("session", "updated"),
        ("message", "created"),
        ("turn", "updated"),
    ]
    turns = [
        data
        for update in reply["updates"]
        for item, data in zip(update["items"], update["data_list"], strict=True)
        if item["entity"] == "turn"
    ]
    assert [t["status"] for t in turns] == ["pending", "running"]
    assert [u["offset"] for u in reply["updates"]] == sorted(u["offset"] for u in reply["updates"])
    turn = await finished(alice, session_id)
    assert turn["status"] == "completed"
    # The same updates were pushed, with the same offsets, and the offsets have no holes.
    pushed = {u["offset"]: u for u in alice.updates}
    assert all(pushed[u["offset"]] == u for u in reply["updates"])
    assert alice.offsets() == list(range(1, len(alice.updates) + 1))
    # Live chunks follow the reply message's `created` update (already in the send's
    # reply); its final content comes last.
    messages = alice.entities("message")
    user, streaming, final = messages[0], messages[1], messages[-1]
    assert (user["role"], user["content_type"], user["content_data"]) == ("user", "text", "hello")
    assert (user["client_id"], user["global_offset"], user["turn_id"]) == ("c1", 1, turn["id"])
    assert (streaming["role"], streaming["status"]) == ("assistant", "pending")
    assert streaming["global_offset"] == 2
    assert (final["id"], final["status"], final["content_type"]) == (
        streaming["id"],
        "completed",
        "markdown",
    )
    assert final["content_data"] == "Hello world"
    assert [(lv["index"], lv["delta"]) for lv in alice.live] == [(0, "Hello "), (1, "world")]
    assert {lv["message_id"] for lv in alice.live} == {streaming["id"]}
    session = await alice.call("v1.session.get", {"session_id": session_id})
    assert session["client_session_id"] == "cs1"
    assert session["root_session_id"] == session_id


async def test_send_validates_its_params(alice: RpcProbe) -> None:
    missing = await alice.error("v1.message.send", {"content_data": "x"})
    assert (missing["code"], missing["details"]) == (
        "invalid_request",
        {"field": "params.client_id"},
    )
    empty = await alice.error("v1.message.send", {"content_data": "x", "client_id": ""})
    assert empty["details"] == {"field": "params.client_id"}
    bad_meta = await alice.error(
        "v1.message.send", {"content_data": "x", "client_id": "m", "metadata": {"bad key!": "v"}}
    )
    assert bad_meta["details"] == {"field": "params.metadata"}
    agent = await alice.error(
        "v1.message.send", {"content_data": "x", "client_id": "a", "agent": "nobody"}
    )
    assert agent["details"] == {"field": "params.agent"}
    assert (await alice.call("v1.session.list"))["items"] == []  # nothing was created


async def test_a_repeated_client_id_is_a_conflict_naming_what_the_first_send_created(
    alice: RpcProbe,
) -> None:
    first = await send(alice, client_id="same")
    error = await alice.error("v1.message.send", {"content_data": "again", "client_id": "same"})
    assert error["code"] == "client_id_conflict"
    assert error["details"] == {
        "session_id": first["session_id"],
        "message_id": first["message_id"],
    }


async def test_send_to_an_unknown_or_foreign_session_is_not_found(
    alice: RpcProbe, open_rpc: Open, new_user: Callable[[], str]
) -> None:
    bob = await open_rpc(new_user())
    bobs = await send(bob)
    for session_id in ("sess-nope", bobs["session_id"]):
        error = await alice.error(
            "v1.message.send",
            {"content_data": "x", "client_id": f"c{session_id}", "server_session_id": session_id},
        )
        assert error["code"] == "session.not_found"


async def test_a_closed_session_refuses_sends_until_reopened(alice: RpcProbe) -> None:
    sent = await send(alice)
    session_id = sent["session_id"]
    await finished(alice, session_id)
    closed = await alice.request("v1.session.close", {"session_id": session_id})
    assert closed["result"]["status"] == "closed"
    assert closed["result"]["closed_at"]
    assert [i["entity"] for u in closed["updates"] for i in u["items"]] == ["session"]
    error = await alice.error(
        "v1.message.send",
        {"content_data": "x", "client_id": "late", "server_session_id": session_id},
    )
    assert error["code"] == "session.closed"
    # Still readable.
    assert (await alice.call("v1.message.list", {"session_id": session_id}))["items"]
    again = await alice.request("v1.session.close", {"session_id": session_id})
    assert again["updates"] == []  # already closed: nothing changed
    opened = await alice.request("v1.session.open", {"session_id": session_id})
    assert (opened["result"]["status"], opened["result"]["closed_at"]) == ("idle", None)
    await send(alice, server_session_id=session_id)
    not_closed = await alice.request("v1.session.open", {"session_id": session_id})
    assert not_closed["updates"] == []
    assert "error" not in not_closed


async def test_messages_sent_while_a_turn_runs_wait_and_merge(alice: RpcProbe) -> None:
    first = await send_scenario(alice, "slow")
    session_id = first["session_id"]
    await alice.until(lambda p: bool(p.live))  # the slow turn is running
    await send(alice, "second", server_session_id=session_id)
    await send(alice, "third", server_session_id=session_id)

    def turns_settled(probe: RpcProbe) -> bool:
        latest = {t["id"]: t for t in probe.entities("turn")}
        return len(latest) == 3 and all(
            t["status"] in {"completed", "merged"} for t in latest.values()
        )

    await alice.until(turns_settled, within=15)
    turns = {t["id"]: t for t in alice.entities("turn")}
    statuses = sorted(t["status"] for t in turns.values())
    assert statuses == ["completed", "completed", "merged"]
    merged = next(t for t in turns.values() if t["status"] == "merged")
    assert turns[merged["merged_into"]]["status"] == "completed"
    listed = await alice.call("v1.turn.list", {"session_id": session_id})
    assert {t["id"]: t["status"] for t in listed["items"]} == {
        i: t["status"] for i, t in turns.items()
    }


# -- turn.stop ------------------------------------------------------------------------------


async def test_stop_cancels_the_running_turn_exactly_once(alice: RpcProbe) -> None:
    sent = await send_scenario(alice, "slow")
    session_id = sent["session_id"]
    await alice.until(lambda p: bool(p.live))
    stop = await alice.request("v1.turn.stop", {"session_id": session_id, "client_id": "x"})
    assert stop["updates"] == []
    turn = await finished(alice, session_id)
    assert turn["status"] == "cancelled"
    await asyncio.sleep(0.1)
    listed = await alice.call("v1.turn.list", {"session_id": session_id})
    assert [t["status"] for t in listed["items"]] == ["cancelled"]
    ends = [
        t for t in alice.entities("turn") if t["status"] in {"cancelled", "completed", "failed"}
    ]
    assert len(ends) == 1
    # The partial reply is kept, complete.
    messages = (await alice.call("v1.message.list", {"session_id": session_id}))["items"]
    assert (messages[-1]["content_data"], messages[-1]["status"]) == ("a", "completed")


async def test_stop_with_nothing_running_is_a_no_op(alice: RpcProbe) -> None:
    sent = await send(alice)
    await finished(alice, sent["session_id"])
    before = len(alice.updates)
    reply = await alice.request("v1.turn.stop", {"session_id": sent["session_id"]})
    assert "error" not in reply
    assert reply["updates"] == []
    assert len(alice.updates) == before
    error = await alice.error("v1.turn.stop", {"session_id": "sess-unknown"})
    assert error["code"] == "session.not_found"


# -- sessions ---------------------------------------------------------------------------------


async def test_session_list_pages_newest_first_and_hides_deleted(alice: RpcProbe) -> None:
    ids = []
    for n in range(5):
        ids.append((await send(alice, f"m{n}"))["session_id"])
        await finished(alice, ids[-1])
    newest_first = ids[::-1]
    page1 = await alice.call("v1.session.list", {"limit": 2})
    assert [s["id"] for s in page1["items"]] == newest_first[:2]
    page2 = await alice.call("v1.session.list", {"limit": 2, "cursor": page1["next_cursor"]})
    assert [s["id"] for s in page2["items"]] == newest_first[2:4]
    page3 = await alice.call("v1.session.list", {"limit": 2, "cursor": page2["next_cursor"]})
    assert ([s["id"] for s in page3["items"]], page3["next_cursor"]) == (newest_first[4:], "")
    deleted = await alice.request(
        "v1.session.update", {"session_id": ids[0], "deleted_at": "2026-01-02T03:04:05Z"}
    )
    assert deleted["result"]["deleted_at"] == "2026-01-02T03:04:05.000Z"
    assert [i["entity"] for u in deleted["updates"] for i in u["items"]] == ["session"]
    listed = await alice.call("v1.session.list", {"limit": 10})
    assert ids[0] not in [s["id"] for s in listed["items"]]
    assert (await alice.call("v1.session.get", {"session_id": ids[0]}))["deleted_at"]
    restored = await alice.call("v1.session.update", {"session_id": ids[0], "deleted_at": None})
    assert restored["deleted_at"] is None
    assert len((await alice.call("v1.session.list", {"limit": 10}))["items"]) == 5


async def test_session_update_renames_and_validates(alice: RpcProbe) -> None:
    session_id = (await send(alice))["session_id"]
    renamed = await alice.call("v1.session.update", {"session_id": session_id, "title": "Trip"})
    assert renamed["title"] == "Trip"
    assert (await alice.call("v1.session.get", {"session_id": session_id}))["title"] == "Trip"
    for params, field in (
        ({"session_id": session_id, "deleted_at": "yesterday"}, "params.deleted_at"),
        ({"session_id": session_id, "title": "x" * 257}, "params.title"),
        ({"session_id": session_id, "title": 5}, "params.title"),
        ({"title": "t"}, "params.session_id"),
    ):
        error = await alice.error("v1.session.update", params)
        assert (error["code"], error["details"]) == ("invalid_request", {"field": field})
    assert (await alice.call("v1.session.get", {"session_id": session_id}))["title"] == "Trip"


async def test_another_users_entities_are_not_found(
    alice: RpcProbe, open_rpc: Open, new_user: Callable[[], str]
) -> None:
    sent = await send(alice)
    turn = await finished(alice, sent["session_id"])
    mallory = await open_rpc(new_user())
    checks = [
        ("v1.session.get", {"session_id": sent["session_id"]}, "session.not_found"),
        ("v1.session.close", {"session_id": sent["session_id"]}, "session.not_found"),
        ("v1.session.open", {"session_id": sent["session_id"]}, "session.not_found"),
        (
            "v1.session.update",
            {"session_id": sent["session_id"], "title": "mine"},
            "session.not_found",
        ),
        ("v1.message.get", {"message_id": sent["message_id"]}, "message.not_found"),
        ("v1.message.list", {"session_id": sent["session_id"]}, "session.not_found"),
        ("v1.turn.get", {"turn_id": turn["id"]}, "turn.not_found"),
        ("v1.turn.list", {"session_id": sent["session_id"]}, "session.not_found"),
        ("v1.turn.stop", {"session_id": sent["session_id"]}, "session.not_found"),
        ("v1.rtc.list", {"session_id": sent["session_id"]}, "session.not_found"),
        ("v1.rtc.get", {"rtc_id": "rtc-nope"}, "rtc.not_found"),
    ]
    for method, params, code in checks:
        assert (await mallory.error(method, params))["code"] == code, method
    assert mallory.updates == []  # nothing of alice's leaked as a push either
    session = await alice.call("v1.session.get", {"session_id": sent["session_id"]})
    assert session["title"] == ""
    assert session["status"] == "idle"


# -- messages and turns ------------------------------------------------------------------------


async def test_message_list_pages_by_global_offset(alice: RpcProbe) -> None:
    session_id = (await send(alice, "one"))["session_id"]
    await finished(alice, session_id)
    for text in ("two", "three"):
        await send(alice, text, server_session_id=session_id)
    await alice.until(
        lambda p: len([t for t in p.entities("turn") if t["status"] == "completed"]) >= 3
    )
    page = await alice.call("v1.message.list", {"session_id": session_id, "limit": 4})
    assert [m["global_offset"] for m in page["items"]] == [1, 2, 3, 4]
    assert page["next_cursor"] == "4"
    rest = await alice.call("v1.message.list", {"session_id": session_id, "cursor": 4, "limit": 4})
    assert ([m["global_offset"] for m in rest["items"]], rest["next_cursor"]) == ([5, 6], "")
    same = await alice.call("v1.message.list", {"session_id": session_id, "cursor": "4"})
    assert same["items"] == rest["items"]
    bad = await alice.error("v1.message.list", {"session_id": session_id, "cursor": "four"})
    assert bad["details"] == {"field": "params.cursor"}
    first = page["items"][0]
    assert await alice.call("v1.message.get", {"message_id": first["id"]}) == first
    assert (await alice.error("v1.message.get", {"message_id": "msg-nope"}))[
        "code"
    ] == "message.not_found"


async def test_message_list_mid_reply_holds_the_text_so_far(
    alice: RpcProbe, open_rpc: Open, new_user: Callable[[], str]
) -> None:
    """The archive gets a reply's text at its end; a reader arriving mid-reply (a
    reloaded page) is given the text so far and where the live chunks continue it."""
    session_id = (await send_scenario(alice, "paced"))["session_id"]  # p0 ... p9, 100 ms apart
    await alice.until(lambda p: any(live["index"] >= 2 for live in p.live))
    page = await alice.call("v1.message.list", {"session_id": session_id})
    reply = page["items"][1]
    assert (reply["role"], reply["status"]) == ("assistant", "streaming")
    chunks = reply["streamed_chunks"]
    assert 3 <= chunks < 10
    assert reply["content_data"] == "".join(f"p{n} " for n in range(chunks))
    # The live chunks from that index on complete it: nothing missing, nothing twice.
    await finished(alice, session_id)
    later = {live["index"]: live["delta"] for live in alice.live if live["index"] >= chunks}
    whole = reply["content_data"] + "".join(later[n] for n in sorted(later))
    assert whole == "".join(f"p{n} " for n in range(10))
    # Once it ended, the archive holds the text and the page says nothing more.
    (ended,) = [
        m
        for m in (await alice.call("v1.message.list", {"session_id": session_id}))["items"]
        if m["id"] == reply["id"]
    ]
    assert "streamed_chunks" not in ended
    assert ended["content_data"] == whole


async def test_turn_get_and_list(alice: RpcProbe) -> None:
    session_id = (await send(alice))["session_id"]
    turn = await finished(alice, session_id)
    got = await alice.call("v1.turn.get", {"turn_id": turn["id"]})
    assert got["status"] == "completed"
    assert got["started_at"]
    assert got["ended_at"]
    assert got["error"] is None
    listed = await alice.call("v1.turn.list", {"session_id": session_id, "limit": 1})
    assert ([t["id"] for t in listed["items"]], listed["next_cursor"]) == ([turn["id"]], "")
    missing = await alice.error("v1.turn.list", {})
    assert missing["details"] == {"field": "params.session_id"}


async def test_a_failed_turn_carries_its_error(alice: RpcProbe) -> None:
    session_id = (await send_scenario(alice, "fail"))["session_id"]
    turn = await finished(alice, session_id)
    assert turn["status"] == "failed"
    assert turn["error"] == {
        "code": "PROVIDER_UNAVAILABLE",
        "message": "model endpoint unavailable",
    }


# -- one archive for every endpoint -------------------------------------------------------------


async def test_a_session_opened_on_ws_is_listed_and_read_over_rpc(
    http: aiohttp.ClientSession,
    rpc_server: ServerProcess,
    open_rpc: Open,
    new_user: Callable[[], str],
) -> None:
    token = new_user()
    rpc = await open_rpc(token)
    ws = await http.ws_connect(rpc_server.ws_url, headers={"Authorization": f"Bearer {token}"})
    omnia = OmniaClient(ws)
    session_id = (await omnia.connected())["session_id"]
    await omnia.ask("from ws", session_id=session_id)
    await rpc.wait_turn_end(session_id)
    listed = await rpc.call("v1.session.list")
    assert [s["id"] for s in listed["items"]] == [session_id]
    messages = (await rpc.call("v1.message.list", {"session_id": session_id}))["items"]
    assert [(m["role"], m["content_data"]) for m in messages] == [
        ("user", "from ws"),
        ("assistant", "Hello world"),
    ]
    # And continued over RPC, in the same session.
    await send(rpc, "from rpc", server_session_id=session_id)
    await rpc.until(
        lambda p: len([t for t in p.entities("turn") if t["status"] == "completed"]) >= 2
    )
    await ws.close()


# -- recovery -----------------------------------------------------------------------------------


async def test_reconnect_with_the_last_offset_replays_what_was_missed_in_order(
    open_rpc: Open, new_user: Callable[[], str]
) -> None:
    token = new_user()
    first = await open_rpc(token)
    session_id = (await send(first))["session_id"]
    await finished(first, session_id)
    seen, epoch = first.offsets()[-1], first.connected["epoch"]
    await first.close()
    # Updates produced while the client is away, by another connection of the user.
    other = await open_rpc(token)
    await other.call("v1.session.update", {"session_id": session_id, "title": "away"})
    await send(other, "more", server_session_id=session_id)
    await other.wait_turn_end(session_id)
    await other.until(
        lambda p: len([t for t in p.entities("turn") if t["status"] == "completed"]) >= 1
    )
    head = (await open_rpc(token)).connected["offset"]
    back = await open_rpc(token, offset=seen, epoch=epoch)
    assert back.connected["recovered"] is True
    assert back.connected["offset"] == head
    await back.until(lambda p: bool(p.updates) and p.offsets()[-1] == head)
    assert back.offsets() == list(range(seen + 1, head + 1))
    assert back.gaps == []
    titles = [s["title"] for s in back.entities("session")]
    assert "away" in titles
    # Live traffic continues after the replay, without repeats.
    await back.call("v1.session.update", {"session_id": session_id, "title": "back"})
    assert back.offsets() == list(range(seen + 1, head + 2))


async def test_a_foreign_epoch_or_an_offset_from_the_future_is_not_recovered(
    open_rpc: Open, new_user: Callable[[], str]
) -> None:
    token = new_user()
    first = await open_rpc(token)
    await finished(first, (await send(first))["session_id"])
    epoch = first.connected["epoch"]
    for kwargs in ({"offset": 0, "epoch": "epoch-other"}, {"offset": 999, "epoch": epoch}):
        probe = await open_rpc(token, **kwargs)
        assert probe.connected["recovered"] is False
        await probe.call("v1.session.list")
        assert probe.updates == []  # nothing replayed


# -- fork and compact ---------------------------------------------------------------------------


async def three_exchanges(probe: RpcProbe) -> tuple[str, list[dict[str, Any]]]:
    """A session of six messages (three user messages and their replies)."""
    session_id = (await send(probe, "one"))["session_id"]
    await finished(probe, session_id)
    for n, text in enumerate(("two", "three"), start=2):
        await send(probe, text, server_session_id=session_id)
        await probe.until(
            lambda p, n=n: len([t for t in p.entities("turn") if t["status"] == "completed"]) >= n
        )
    messages = (await probe.call("v1.message.list", {"session_id": session_id}))["items"]
    assert [m["global_offset"] for m in messages] == [1, 2, 3, 4, 5, 6]
    return session_id, messages


async def test_fork_copies_up_to_limit_messages_before_the_point_and_replaces_it(
    alice: RpcProbe,
) -> None:
    session_id, messages = await three_exchanges(alice)
    point = messages[4]  # the third user message
    reply = await alice.request(
        "v1.session.fork",
        {
            "old_server_session_id": session_id,
            "old_server_message_id": point["id"],
            "new_client_session_id": "fork-1",
            "new_client_message_id": "cm-fork",
            "content_data": "instead",
            "limit": 2,
        },
    )
    result = reply["result"]
    fork_id = result["session_id"]
    assert result["turn_id"] == ""
    assert len(result["message_ids"]) == 3
    forked = await alice.call("v1.session.get", {"session_id": fork_id})
    assert (forked["parent_session_id"], forked["root_session_id"]) == (session_id, session_id)
    assert (forked["forked_from_message_id"], forked["client_session_id"]) == (
        point["id"],
        "fork-1",
    )
    kinds = [(i["entity"], i["action"]) for u in reply["updates"] for i in u["items"]]
    assert kinds[:3] == [("session", "created"), ("message", "created"), ("message", "created")]
    turn = await finished(alice, fork_id)
    assert turn["status"] == "completed"
    copied = (await alice.call("v1.message.list", {"session_id": fork_id}))["items"]
    assert [m["content_data"] for m in copied] == ["two", "Hello world", "instead", "Hello world"]
    assert [m["global_offset"] for m in copied] == [1, 2, 3, 4]
    assert [m["id"] for m in copied[:3]] == result["message_ids"]
    assert [m["parent_message_id"] for m in copied[:2]] == [messages[2]["id"], messages[3]["id"]]
    assert (copied[2]["client_id"], copied[2]["role"]) == ("cm-fork", "user")
    # The original is untouched.
    again = (await alice.call("v1.message.list", {"session_id": session_id}))["items"]
    assert again == messages
    # A fork of the fork keeps the root; limit 0 copies nothing.
    deeper = await alice.call(
        "v1.session.fork",
        {
            "old_server_session_id": fork_id,
            "old_server_message_id": copied[2]["id"],
            "content_data": "deeper",
            "limit": 0,
        },
    )
    grandchild = await alice.call("v1.session.get", {"session_id": deeper["session_id"]})
    assert (grandchild["parent_session_id"], grandchild["root_session_id"]) == (fork_id, session_id)
    assert len(deeper["message_ids"]) == 1


async def test_fork_refuses_unknown_points_and_foreign_sessions(
    alice: RpcProbe, open_rpc: Open, new_user: Callable[[], str]
) -> None:
    session_id, messages = await three_exchanges(alice)
    other = (await send(alice, "elsewhere"))["session_id"]
    await finished(alice, other)
    other_message = (await alice.call("v1.message.list", {"session_id": other}))["items"][0]
    base = {"old_server_session_id": session_id, "content_data": "x"}
    for message_id in ("msg-unknown", other_message["id"]):
        error = await alice.error("v1.session.fork", {**base, "old_server_message_id": message_id})
        assert error["code"] == "message.not_found"
    too_many = await alice.error(
        "v1.session.fork", {**base, "old_server_message_id": messages[0]["id"], "limit": 1001}
    )
    assert too_many["details"] == {"field": "params.limit"}
    mallory = await open_rpc(new_user())
    error = await mallory.error(
        "v1.session.fork", {**base, "old_server_message_id": messages[0]["id"]}
    )
    assert error["code"] == "session.not_found"
    assert len((await alice.call("v1.session.list"))["items"]) == 2  # nothing was created


async def test_a_closed_session_can_be_forked(alice: RpcProbe) -> None:
    session_id, messages = await three_exchanges(alice)
    await alice.call("v1.session.close", {"session_id": session_id})
    forked = await alice.call(
        "v1.session.fork",
        {
            "old_server_session_id": session_id,
            "old_server_message_id": messages[2]["id"],
            "content_data": "x",
        },
    )
    assert (await alice.call("v1.session.get", {"session_id": forked["session_id"]}))[
        "status"
    ] == "idle"


async def test_compact_writes_a_summary_later_and_absorbs_a_second_request(alice: RpcProbe) -> None:
    session_id = (await send(alice, "remember the blue door"))["session_id"]
    await finished(alice, session_id)
    await send_scenario(alice, "slow", server_session_id=session_id)
    await alice.until(lambda p: any(lv["delta"] == "a" for lv in p.live))
    first = await alice.request(
        "v1.session.compact", {"session_id": session_id, "custom_instruction": "short"}
    )
    second = await alice.request("v1.session.compact", {"session_id": session_id})
    assert (first["result"]["queued"], first["updates"]) == (True, [])
    assert (second["result"]["queued"], second["updates"]) == (False, [])

    def summarised(probe: RpcProbe) -> bool:
        return any(m["content_type"] == "summary" for m in probe.entities("message"))

    await alice.until(summarised)
    summary = next(m for m in alice.entities("message") if m["content_type"] == "summary")
    assert summary["role"] == "system"
    items = summary["content_data"]
    assert items[0] == {"role": "instruction", "text": "short"}
    assert {"role": "user", "text": "remember the blue door"} in items
    # It waited for the running turn: the slow reply is in the summary too.
    assert {"role": "assistant", "text": "a"} in items
    messages = (await alice.call("v1.message.list", {"session_id": session_id}))["items"]
    assert messages[-1]["content_type"] == "summary"
    assert len([m for m in messages if m["content_type"] == "summary"]) == 1
    assert (await alice.error("v1.session.compact", {"session_id": "sess-x"}))[
        "code"
    ] == "session.not_found"


async def test_a_burst_of_requests_past_the_limit_is_rate_limited_and_all_answered(
    alice: RpcProbe,
) -> None:
    # Above the default burst (100 requests) and the requests one connection may have in
    # flight at once (64): the excess is refused, never queued without bound or dropped.
    count = 130
    for n in range(count):
        await alice.send({"id": f"b-{n}", "method": "v1.session.list"})
    await alice.until(lambda p: all(f"b-{n}" in p.replies for n in range(count)))
    codes = [alice.replies[f"b-{n}"].get("error", {}).get("code") for n in range(count)]
    assert set(codes) == {None, "rate_limited"}


REQUIRED_PARAMS = {
    "v1.session.get": "session_id",
    "v1.session.close": "session_id",
    "v1.session.open": "session_id",
    "v1.session.update": "session_id",
    "v1.session.fork": "old_server_session_id",
    "v1.session.compact": "session_id",
    "v1.message.send": "content_data",
    "v1.message.list": "session_id",
    "v1.message.get": "message_id",
    "v1.turn.stop": "session_id",
    "v1.turn.list": "session_id",
    "v1.turn.get": "turn_id",
    "v1.rtc.update_status": "rtc_id",
    "v1.rtc.submit_result": "rtc_id",
    "v1.rtc.list": "session_id",
    "v1.rtc.get": "rtc_id",
}


@pytest.mark.parametrize(("method", "field"), sorted(REQUIRED_PARAMS.items()))
async def test_every_method_names_a_missing_required_param(
    alice: RpcProbe, method: str, field: str
) -> None:
    error = await alice.error(method, {})
    assert error["code"] == "invalid_request"
    assert error["details"] == {"field": f"params.{field}"}
    assert alice.updates == []  # nothing changed


async def test_session_list_takes_no_required_params_and_validates_its_limit(
    alice: RpcProbe,
) -> None:
    assert (await alice.call("v1.session.list", {}))["next_cursor"] == ""
    for limit in (0, 101, -1, 2.5):
        error = await alice.error("v1.session.list", {"limit": limit})
        assert error["details"] == {"field": "params.limit"}


async def test_live_chunks_of_a_reply_streaming_across_a_reconnect_keep_flowing(
    open_rpc: Open, new_user: Callable[[], str]
) -> None:
    token = new_user()
    first = await open_rpc(token)
    session_id = (await send_scenario(first, "paced"))["session_id"]
    await first.until(lambda p: len(p.live) >= 2)
    offset, epoch = first.offsets()[-1], first.connected["epoch"]
    message_id = first.live[0]["message_id"]
    await first.close()
    back = await open_rpc(token, offset=offset, epoch=epoch)
    await back.wait_turn_end(session_id)
    later = [lv for lv in back.live if lv["message_id"] == message_id]
    assert later, "no live chunk after the reconnect"
    assert all(lv["index"] >= 2 for lv in later)


async def test_concurrent_sends_with_one_client_id_store_one_message(alice: RpcProbe) -> None:
    params = {"content_data": "once", "client_id": "racing"}
    await alice.send({"id": "a", "method": "v1.message.send", "params": params})
    await alice.send({"id": "b", "method": "v1.message.send", "params": params})
    await alice.until(lambda p: "a" in p.replies and "b" in p.replies)
    replies = [alice.replies["a"], alice.replies["b"]]
    results = [r["result"] for r in replies if "result" in r]
    errors = [r["error"] for r in replies if "error" in r]
    assert len(results) == 1
    assert [e["code"] for e in errors] == ["client_id_conflict"]
    assert errors[0]["details"] == {
        "session_id": results[0]["session_id"],
        "message_id": results[0]["message_id"],
    }
    assert len((await alice.call("v1.session.list"))["items"]) == 1


async def test_a_repeated_client_id_into_an_existing_session_is_a_conflict(alice: RpcProbe) -> None:
    first = await send(alice, client_id="dup")
    session_id = first["session_id"]
    await finished(alice, session_id)
    error = await alice.error(
        "v1.message.send",
        {"content_data": "again", "client_id": "dup", "server_session_id": session_id},
    )
    assert error["code"] == "client_id_conflict"
    assert error["details"] == {"session_id": session_id, "message_id": first["message_id"]}
    messages = (await alice.call("v1.message.list", {"session_id": session_id}))["items"]
    assert [m["content_data"] for m in messages if m["role"] == "user"] == ["hi"]


async def test_a_ping_gets_a_pong(alice: RpcProbe) -> None:
    await alice.send({"type": "ping"})
    assert await alice.next_frame() == {"type": "pong"}


async def test_send_takes_media_parts_with_the_ws_rules(alice: RpcProbe) -> None:
    image = {"type": "image", "media": {"mime_type": "image/png", "data": "aGVsbG8="}}
    sent = await alice.call(
        "v1.message.send",
        {
            "content_data": "",
            "client_id": "with-image",
            "parts": [{"type": "text", "text": "look"}, image],
        },
    )
    stored = await alice.call("v1.message.get", {"message_id": sent["message_id"]})
    assert [p["type"] for p in stored["parts"]] == ["text", "image"]
    assert stored["parts"][1]["media"]["mime_type"] == "image/png"
    for params, field in (
        ({"content_data": "", "client_id": "empty"}, "params.content_data"),
        (
            {
                "content_data": "x",
                "client_id": "bad",
                "parts": [{"type": "image", "media": {"mime_type": "image/png"}}],
            },
            "params.parts",
        ),
        (
            {"content_data": "x", "client_id": "worse", "parts": [{"type": "sticker"}]},
            "params.parts[0].type",
        ),
    ):
        error = await alice.error("v1.message.send", params)
        assert (error["code"], error["details"]) == ("invalid_request", {"field": field})
    foreign = {
        "type": "image",
        "media": {"mime_type": "image/png", "storage_ref": "omnia://sessions/sess-x/media/med-y"},
    }
    error = await alice.error(
        "v1.message.send", {"content_data": "x", "client_id": "ref", "parts": [foreign]}
    )
    assert error["code"] == "invalid_request"
