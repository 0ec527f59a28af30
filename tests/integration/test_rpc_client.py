"""`RpcClient` against a real `portico serve` process, directly and through the fault proxy.

Each test takes users of its own (API keys `key-N` for `user-N`), so its update log
starts at offset 1 and holds exactly what the test did.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml

from portico.client import (
    ActionResult,
    CompactResult,
    ForkResult,
    LiveChunk,
    MessageEntity,
    Page,
    ReconnectPolicy,
    Reset,
    RpcAuthenticationError,
    RpcCallError,
    RpcClient,
    RpcClosedError,
    RpcConflictError,
    RpcConnectionLostError,
    RpcNotFoundError,
    RpcTimeoutError,
    RtcEntity,
    SendResult,
    SessionEntity,
    StopResult,
    TurnEntity,
    Update,
)
from support.faultproxy import (
    CLIENT_TO_SERVER,
    SERVER_TO_CLIENT,
    FaultProxy,
    Frame,
    Rule,
    close,
    cut,
    duplicate,
    replace,
    suppress,
)
from support.server import SCRIPT, ServerProcess

USERS = 500
WITHIN = 10.0  # seconds any single step of a test may take
FAST_RETRY = ReconnectPolicy(initial=0.02, maximum=0.2, give_up_after=10.0)
TERMINAL_TURN = frozenset({"completed", "failed", "cancelled", "interrupted"})
_users = itertools.count()
StreamItem = Update | Reset


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A scripted server whose API keys `key-N` belong to `user-N`."""
    data_dir = tmp_path_factory.mktemp("rpc-client")
    config = data_dir / "portico.yaml"
    keys = {f"key-{n}": f"user-{n}" for n in range(USERS)}
    config.write_text(
        yaml.safe_dump(
            {"auth": "apikey", "api_keys": keys, "runtime": "scripted", "script": str(SCRIPT)}
        )
    )
    process = ServerProcess(data_dir, args=("--config", str(config))).start()
    yield process
    process.stop()


@pytest.fixture
async def proxy(server: ServerProcess) -> AsyncIterator[FaultProxy]:
    async with FaultProxy(server.http_url) as running:
        yield running


@pytest.fixture
def token() -> str:
    """A user no other test touches."""
    return f"key-{next(_users)}"


def rpc_url(server: ServerProcess | FaultProxy) -> str:
    if isinstance(server, FaultProxy):
        return server.url("/v1/rpc")
    return f"ws://127.0.0.1:{server.port}/v1/rpc"


def make_client(target: ServerProcess | FaultProxy, token: str | None, **kw: Any) -> RpcClient:
    settings: dict[str, Any] = {"reconnect": FAST_RETRY, "request_timeout": WITHIN}
    settings.update(kw)
    return RpcClient(rpc_url(target), token=token, **settings)


# -- reading the stream ---------------------------------------------------------------------


async def read_until(
    client: RpcClient,
    done: Callable[[list[StreamItem]], bool],
    seen: list[StreamItem] | None = None,
) -> list[StreamItem]:
    """Items of `client.updates()` until `done(items)` holds (appended to `seen`)."""
    items = [] if seen is None else seen
    async with asyncio.timeout(WITHIN):
        async for item in client.updates():
            items.append(item)
            if done(items):
                break
    return items


def updates_of(items: list[StreamItem]) -> list[Update]:
    return [item for item in items if isinstance(item, Update)]


def entities(items: list[StreamItem], kind: type[Any]) -> list[Any]:
    return [entity for update in updates_of(items) for entity in update.entities(kind)]


def turn_ended(session_id: str, count: int = 1) -> Callable[[list[StreamItem]], bool]:
    def done(items: list[StreamItem]) -> bool:
        ended = {
            turn.id
            for turn in entities(items, TurnEntity)
            if turn.session_id == session_id and turn.status in TERMINAL_TURN
        }
        return len(ended) >= count

    return done


def last_turn(items: list[StreamItem], session_id: str) -> TurnEntity:
    turns = [t for t in entities(items, TurnEntity) if t.session_id == session_id]
    turn: TurnEntity = turns[-1]
    return turn


def offsets(items: list[StreamItem]) -> list[int]:
    return [update.offset for update in updates_of(items)]


def final_reply(items: list[StreamItem]) -> MessageEntity:
    replies = [
        m
        for m in entities(items, MessageEntity)
        if m.role == "assistant" and m.status == "completed" and m.content_type == "markdown"
    ]
    reply: MessageEntity = replies[-1]
    return reply


async def read_live(client: RpcClient, count: int) -> list[LiveChunk]:
    chunks: list[LiveChunk] = []
    async with asyncio.timeout(WITHIN):
        async for chunk in client.live():
            chunks.append(chunk)
            if len(chunks) == count:
                break
    return chunks


async def exchange(client: RpcClient, text: str = "hi", **kw: Any) -> tuple[str, list[StreamItem]]:
    """Send a message and read the stream until its turn ended: the session and the items."""
    sent = await client.message_send(text, **kw)
    session_id = sent.result.session_id
    return session_id, await read_until(client, turn_ended(session_id))


def is_reply_to(method_result_key: str) -> Callable[[Frame], bool]:
    """A server reply whose result has `method_result_key` (e.g. message.send's
    `message_id`, fork's `message_ids`)."""

    def test(frame: Frame) -> bool:
        data = frame.json
        return (
            isinstance(data, dict)
            and isinstance(data.get("result"), dict)
            and method_result_key in data["result"]
        )

    return test


def is_request(method: str) -> Callable[[Frame], bool]:
    def test(frame: Frame) -> bool:
        return isinstance(frame.json, dict) and frame.json.get("method") == method

    return test


# -- connect and the typed calls ------------------------------------------------------------------


async def test_connect_reports_the_user_and_starts_at_the_head(
    server: ServerProcess, token: str
) -> None:
    async with make_client(server, token) as client:
        assert client.connected
        assert client.user_id == token.replace("key", "user")
        assert (client.offset, client.recovered, client.connections) == (0, False, 1)
        assert client.epoch
    assert client.closed
    with pytest.raises(RpcClosedError):
        await client.session_list()


async def test_send_streams_updates_and_live_chunks_ending_with_the_completed_reply(
    server: ServerProcess, token: str
) -> None:
    async with make_client(server, token) as client:
        sent = await client.message_send("hello", client_id="c1", client_session_id="cs1")
        assert isinstance(sent, ActionResult)
        assert isinstance(sent.result, SendResult)
        assert (sent.result.turn_id, sent.deduplicated) == ("", False)
        session_id = sent.result.session_id
        kinds = [(i.entity, i.action) for u in sent.updates for i in u.items]
        assert kinds[0] == ("session", "created")
        assert ("message", "created") in kinds
        assert isinstance(sent.updates[0].data_list[0], SessionEntity)

        items = await read_until(client, turn_ended(session_id))
        assert last_turn(items, session_id).status == "completed"
        # Every offset once, from the first; the action's updates are the pushed ones.
        assert offsets(items) == list(range(1, len(items) + 1))
        pushed = {u.offset: u for u in updates_of(items)}
        assert all(pushed[u.offset] == u for u in sent.updates)
        assert client.offset == offsets(items)[-1]
        user = entities(items, MessageEntity)[0]
        assert (user.role, user.content_data, user.client_id) == ("user", "hello", "c1")
        reply = final_reply(items)
        assert (reply.content_data, reply.turn_id) == (
            "Hello world",
            last_turn(items, session_id).id,
        )
        chunks = await read_live(client, 2)
        assert [(c.index, c.delta) for c in chunks] == [(0, "Hello "), (1, "world")]
        assert {c.message_id for c in chunks} == {reply.id}


async def test_every_session_message_and_turn_method_returns_its_typed_result(
    server: ServerProcess, token: str
) -> None:
    async with make_client(server, token) as client:
        session_id, _ = await exchange(client, "one")
        await exchange(client, "two", server_session_id=session_id)

        listed = await client.session_list(limit=10)
        assert isinstance(listed, Page)
        assert ([s.id for s in listed.items], listed.has_more) == ([session_id], False)
        session = await client.session_get(session_id)
        assert isinstance(session, SessionEntity)
        assert (session.status, session.root_session_id) == ("idle", session_id)

        renamed = await client.session_update(session_id, title="Trip")
        assert renamed.result.title == "Trip"
        assert [i.entity for u in renamed.updates for i in u.items] == ["session"]
        deleted = await client.session_update(
            session_id, deleted_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
        )
        assert deleted.result.deleted_at == "2026-01-02T03:04:05.000Z"
        restored = await client.session_update(session_id, deleted_at=None)
        assert (restored.result.deleted_at, restored.result.title) == (None, "Trip")

        first = await client.message_list(session_id, limit=2)
        assert [m.global_offset for m in first.items] == [1, 2]
        assert isinstance(first.items[0], MessageEntity)
        rest = await client.message_list(session_id, cursor=first.next_cursor)
        assert ([m.content_data for m in rest.items], rest.has_more) == (
            ["two", "Hello world"],
            False,
        )
        got = await client.message_get(first.items[0].id)
        assert got == first.items[0]

        turns = await client.turn_list(session_id, limit=1)
        assert isinstance(turns.items[0], TurnEntity)
        assert turns.has_more
        turn = await client.turn_get(turns.items[0].id)
        assert (turn.status, turn.error) == ("completed", None)
        stopped = await client.turn_stop(session_id)  # nothing runs: a no-op
        assert (stopped.result, stopped.updates) == (StopResult(session_id=session_id), ())

        forked = await client.session_fork(
            old_server_session_id=session_id,
            old_server_message_id=rest.items[0].id,
            content_data="instead",
            new_client_session_id="fork-1",
        )
        assert isinstance(forked.result, ForkResult)
        assert len(forked.result.message_ids) == 3
        fork = await client.session_get(forked.result.session_id)
        assert (fork.parent_session_id, fork.client_session_id) == (session_id, "fork-1")

        compacted = await client.session_compact(session_id, custom_instruction="short")
        assert (compacted.result, compacted.updates) == (
            CompactResult(session_id=session_id, queued=True),
            (),
        )
        closed = await client.session_close(session_id)
        assert (closed.result.status, len(closed.updates)) == ("closed", 1)
        opened = await client.session_open(session_id)
        assert (opened.result.status, opened.result.closed_at) == ("idle", None)


async def test_turn_stop_cancels_the_running_turn(server: ServerProcess, token: str) -> None:
    async with make_client(server, token) as client:
        sent = await client.message_send("x", metadata={"mock_scenario": "slow"})
        session_id = sent.result.session_id
        await read_live(client, 1)  # the slow turn is running
        stopped = await client.turn_stop(session_id)
        assert stopped.updates == ()
        items = await read_until(client, turn_ended(session_id))
        assert last_turn(items, session_id).status == "cancelled"


async def test_the_rtc_methods_drive_a_tool_call_to_its_end(
    server: ServerProcess, token: str
) -> None:
    async with make_client(server, token) as client:
        sent = await client.message_send("where?", metadata={"mock_scenario": "tool"})
        session_id = sent.result.session_id

        def rtc_sent(items: list[StreamItem]) -> bool:
            return any(r.status == "sent" for r in entities(items, RtcEntity))

        items = await read_until(client, rtc_sent)
        rtc = next(r for r in entities(items, RtcEntity) if r.status == "sent")
        assert (rtc.name, rtc.arguments) == ("get_location", {"query": "current"})
        executing = await client.rtc_update_status(rtc.id, status="executing", client_id="tab")
        assert isinstance(executing.result, RtcEntity)
        assert (executing.result.status, executing.result.client_id) == ("executing", "tab")
        done = await client.rtc_submit_result(
            rtc.id, success=True, result={"city": "Oslo"}, client_id="tab"
        )
        assert (done.result.status, done.result.result) == ("completed", {"city": "Oslo"})
        assert [i.entity for u in done.updates for i in u.items] == ["rtc", "message"]
        await read_until(client, turn_ended(session_id), items)
        assert final_reply(items).content_data == 'status=completed result={"city":"Oslo"} error='
        listed = await client.rtc_list(session_id)
        assert [(r.id, r.status) for r in listed.items] == [(rtc.id, "completed")]
        assert (await client.rtc_get(rtc.id)).result == {"city": "Oslo"}


# -- errors ---------------------------------------------------------------------------------------


async def test_an_error_reply_raises_with_its_code_message_and_details(
    server: ServerProcess, token: str
) -> None:
    async with make_client(server, token) as client:
        with pytest.raises(RpcNotFoundError) as missing:
            await client.session_get("sess-nope")
        assert (missing.value.code, missing.value.message) == (
            "session.not_found",
            "session sess-nope not found",
        )
        assert missing.value.method == "v1.session.get"
        with pytest.raises(RpcCallError) as invalid:
            await client.session_list(limit=1000)
        assert (invalid.value.code, invalid.value.details) == (
            "invalid_request",
            {"field": "params.limit"},
        )
        first = await client.message_send("x", client_id="same")
        # A conflict on a first attempt is the application's: raised, not resolved.
        with pytest.raises(RpcConflictError) as conflict:
            await client.message_send("again", client_id="same")
        assert conflict.value.details == {
            "session_id": first.result.session_id,
            "message_id": first.result.message_id,
        }
        assert (await client.session_list()).items  # still usable


async def test_a_bad_token_is_terminal(proxy: FaultProxy) -> None:
    for bad in (None, "wrong"):
        client = make_client(proxy, bad)
        with pytest.raises(RpcAuthenticationError) as refused:
            await client.connect()
        assert (refused.value.code, refused.value.close_code) == ("unauthenticated", 4401)
        assert client.closed
    assert len(proxy.connections) == 2  # one attempt each, no retry


async def test_a_token_refused_on_reconnect_stops_the_client(proxy: FaultProxy, token: str) -> None:
    # The second connection is refused as a revoked token would be.
    proxy.add_rule(Rule(close(4401, "unauthenticated"), direction=SERVER_TO_CLIENT, connection=1))
    client = make_client(proxy, token)
    async with client:
        await proxy.cut(0)
        with pytest.raises(RpcAuthenticationError):
            await read_until(client, lambda items: False)
        assert client.closed
        with pytest.raises(RpcAuthenticationError):
            await client.session_list()
    assert len(proxy.connections) == 2


async def test_a_call_without_a_reply_times_out_and_the_client_goes_on(
    proxy: FaultProxy, token: str
) -> None:
    proxy.add_rule(Rule(suppress(), direction=SERVER_TO_CLIENT, where=is_reply_to("items")))
    async with make_client(proxy, token, request_timeout=0.3) as client:
        with pytest.raises(RpcTimeoutError):
            await client.session_list()
        assert (await client.session_list()).items == ()
        assert client.connections == 1


# -- reconnect and the update stream ----------------------------------------------------------


async def test_a_cut_mid_stream_is_recovered_with_no_offset_repeated_or_skipped(
    proxy: FaultProxy, token: str
) -> None:
    # The third update is lost with the first connection: it must come from the replay.
    lost = proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, type="update", nth=3))
    # Then a cut mid-way through the live chunks of the second connection.
    mid_live = proxy.add_rule(
        Rule(cut(forward=True), direction=SERVER_TO_CLIENT, type="live", connection=1, nth=3)
    )
    async with make_client(proxy, token) as client:
        sent = await client.message_send("x", metadata={"mock_scenario": "paced"})
        session_id = sent.result.session_id
        items = await read_until(client, turn_ended(session_id))
        assert last_turn(items, session_id).status == "completed"
        assert offsets(items) == list(range(1, len(items) + 1))
        assert final_reply(items).content_data == "".join(f"p{n} " for n in range(10))
        assert lost.fired == 1
        assert client.connections == 1 + lost.fired + mid_live.fired
        assert client.recovered
        assert client.offset == len(items)


async def test_repeated_update_frames_are_dropped(proxy: FaultProxy, token: str) -> None:
    proxy.add_rule(Rule(duplicate(2), direction=SERVER_TO_CLIENT, type="update", times=None))
    async with make_client(proxy, token) as client:
        session_id, items = await exchange(client)
        assert offsets(items) == list(range(1, len(items) + 1))
        # After a reconnect, the replay and the duplicates still repeat nothing.
        await proxy.cut(0)
        await client.session_update(session_id, title="after")

        def renamed(seen: list[StreamItem]) -> bool:
            return any(s.title == "after" for s in entities(seen, SessionEntity))

        await read_until(client, renamed, items)
        assert offsets(items) == list(range(1, len(items) + 1))
        assert client.connections == 2


async def test_a_gap_advances_the_offset_without_an_item(proxy: FaultProxy, token: str) -> None:
    def to_gap(frame: Frame) -> dict[str, Any]:
        return {"type": "gap", "offset": frame.json["update"]["offset"]}

    proxy.add_rule(Rule(replace(to_gap), direction=SERVER_TO_CLIENT, type="update", nth=2))
    async with make_client(proxy, token) as client:
        session_id = (await client.message_send("x")).result.session_id
        items = await read_until(client, turn_ended(session_id))
        assert offsets(items)[:2] == [1, 3]
        assert offsets(items)[1:] == list(range(3, len(items) + 2))
        assert client.offset == offsets(items)[-1]


async def test_a_send_whose_reply_is_lost_returns_the_first_attempts_ids_once(
    proxy: FaultProxy, token: str
) -> None:
    proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, where=is_reply_to("message_id")))
    async with make_client(proxy, token) as client:
        sent = await client.message_send("once", client_id="c-once")
        assert sent.deduplicated
        assert sent.updates == ()
        session_id = sent.result.session_id
        items = await read_until(client, turn_ended(session_id))
        assert offsets(items) == list(range(1, len(items) + 1))
        users = [m for m in entities(items, MessageEntity) if m.role == "user"]
        assert [(m.id, m.client_id) for m in users] == [(sent.result.message_id, "c-once")]
        listed = await client.message_list(session_id)
        assert [m.id for m in listed.items if m.role == "user"] == [sent.result.message_id]
        assert len(proxy.connections) == 2


async def test_a_send_lost_on_its_way_is_sent_again_and_lands_once(
    proxy: FaultProxy, token: str
) -> None:
    rule = Rule(cut(), direction=CLIENT_TO_SERVER, where=is_request("v1.message.send"))
    proxy.add_rule(rule)
    async with make_client(proxy, token) as client:
        sent = await client.message_send("once")
        assert not sent.deduplicated
        assert sent.updates
        listed = await client.message_list(sent.result.session_id)
        assert [m.content_data for m in listed.items if m.role == "user"] == ["once"]
        assert (rule.fired, len(proxy.connections)) == (1, 2)


async def test_a_query_whose_reply_is_lost_is_repeated(proxy: FaultProxy, token: str) -> None:
    proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, where=is_reply_to("items")))
    async with make_client(proxy, token) as client:
        assert (await client.session_list()).items == ()
        assert len(proxy.connections) == 2


async def test_a_fork_whose_reply_is_lost_raises_connection_lost(
    proxy: FaultProxy, token: str
) -> None:
    async with make_client(proxy, token) as client:
        session_id, items = await exchange(client)
        user = entities(items, MessageEntity)[0]
        proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, where=is_reply_to("message_ids")))
        with pytest.raises(RpcConnectionLostError):
            await client.session_fork(
                old_server_session_id=session_id,
                old_server_message_id=user.id,
                content_data="instead",
            )
        # The client itself goes on, on a new connection.
        assert len((await client.session_list()).items) == 2
        assert len(proxy.connections) == 2


async def test_a_rejection_whose_reply_was_cut_is_repeated_harmlessly(
    proxy: FaultProxy, token: str
) -> None:
    def is_rtc_reply(frame: Frame) -> bool:
        result = frame.json.get("result") if isinstance(frame.json, dict) else None
        return isinstance(result, dict) and result.get("status") == "rejected"

    async with make_client(proxy, token) as client:
        sent = await client.message_send("x", metadata={"mock_scenario": "tool"})

        def rtc_sent(items: list[StreamItem]) -> bool:
            return any(r.status == "sent" for r in entities(items, RtcEntity))

        items = await read_until(client, rtc_sent)
        rtc = entities(items, RtcEntity)[-1]
        proxy.add_rule(Rule(cut(), direction=SERVER_TO_CLIENT, where=is_rtc_reply))
        rejected = await client.rtc_update_status(rtc.id, status="rejected")
        assert rejected.result.status == "rejected"
        assert rejected.updates == ()  # the repeat changed nothing
        await read_until(client, turn_ended(sent.result.session_id), items)
        assert final_reply(items).content_data.startswith("status=denied")
        assert offsets(items) == list(range(1, offsets(items)[-1] + 1))


# -- positions and resets -----------------------------------------------------------------------


async def test_a_persisted_position_resumes_with_exactly_what_was_missed(
    server: ServerProcess, token: str
) -> None:
    async with make_client(server, token) as first:
        session_id, _ = await exchange(first)
        offset, epoch = first.offset, first.epoch
    assert offset is not None
    async with make_client(server, token) as other:
        await other.session_update(session_id, title="while away")
        head = (await other.session_update(session_id, title="latest")).updates[-1].offset
    async with make_client(server, token, offset=offset, epoch=epoch) as back:
        assert back.recovered
        items = await read_until(back, lambda seen: offsets(seen)[-1:] == [head])
        assert offsets(items) == list(range(offset + 1, head + 1))
        titles = [s.title for s in entities(items, SessionEntity)]
        assert titles == ["while away", "latest"]


@pytest.mark.parametrize(
    ("position", "reason"),
    [(lambda o, e: (o, "epoch-other"), "epoch_changed"), (lambda o, e: (999, e), "not_recovered")],
    ids=["foreign-epoch", "offset-from-the-future"],
)
async def test_a_position_the_server_cannot_resume_is_a_reset(
    server: ServerProcess,
    token: str,
    position: Callable[[int, str], tuple[int, str]],
    reason: str,
) -> None:
    async with make_client(server, token) as first:
        await exchange(first)
        offset, epoch = first.offset, first.epoch
    assert offset is not None
    assert epoch is not None
    sent_offset, sent_epoch = position(offset, epoch)
    async with make_client(server, token, offset=sent_offset, epoch=sent_epoch) as client:
        assert not client.recovered
        (reset,) = await read_until(client, lambda seen: True)
        assert reset == Reset(reason, epoch, offset)  # type: ignore[arg-type]
        assert (client.offset, client.epoch) == (offset, epoch)
        # The stream goes on from the head.
        renamed = await client.session_list()
        session_id = renamed.items[0].id
        await client.session_update(session_id, title="next")
        (update,) = await read_until(client, lambda seen: True)
        assert isinstance(update, Update)
        assert update.offset == offset + 1


async def test_a_reconnect_that_is_not_recovered_is_a_reset_in_the_stream(
    proxy: FaultProxy, token: str
) -> None:
    # The second connection's `connect` carries an epoch the server does not know.
    def foreign_epoch(frame: Frame) -> dict[str, Any]:
        return {**frame.json, "epoch": "epoch-other"}

    proxy.add_rule(
        Rule(replace(foreign_epoch), direction=CLIENT_TO_SERVER, type="connect", connection=1)
    )
    async with make_client(proxy, token) as client:
        session_id, items = await exchange(client)
        await proxy.cut(0)
        await client.session_update(session_id, title="after")  # waits for the reconnect
        seen = await read_until(client, lambda got: isinstance(got[-1], Update))
        reset, update = seen
        assert isinstance(reset, Reset)
        assert reset.reason == "not_recovered"
        assert reset.offset == offsets(items)[-1]
        assert isinstance(update, Update)
        assert update.offset == reset.offset + 1
        assert update.entities(SessionEntity)[0].title == "after"


async def test_a_reader_that_falls_behind_gets_an_overflow_reset(
    server: ServerProcess, token: str
) -> None:
    async with (
        make_client(server, token, max_buffered_updates=2) as slow,
        make_client(server, token) as watcher,
    ):
        session_id, items = await exchange(watcher)  # slow reads nothing meanwhile
        head = offsets(items)[-1]
        await watcher.session_update(session_id, title="later")
        seen = await read_until(slow, lambda got: got[-1].offset == head + 1)
        # Only the newest items are left, after the Reset that dropped the rest.
        assert isinstance(seen[0], Reset)
        resets = [item for item in seen if isinstance(item, Reset)]
        assert {reset.reason for reset in resets} == {"overflow"}
        after = seen[seen.index(resets[-1]) + 1 :]
        assert offsets(after) == list(range(resets[-1].offset + 1, head + 2))
        assert (slow.offset, slow.buffered_updates) == (head + 1, 0)


async def test_close_ends_the_streams_and_later_calls_raise(
    server: ServerProcess, token: str
) -> None:
    client = make_client(server, token)
    await client.connect()
    reader = asyncio.create_task(read_until(client, lambda items: False))
    await client.close()
    assert await asyncio.wait_for(reader, WITHIN) == []
    assert [chunk async for chunk in client.live()] == []
    with pytest.raises(RpcClosedError):
        await client.message_send("too late")
