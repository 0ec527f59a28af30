"""The RPC domain over the engine and archive: one principal's sessions, messages, turns
and tool calls, with ownership on every call.

Another user's entity is reported exactly like a missing one (`*.not_found`), so ids
leak nothing. Sessions, messages and turns are the same ones `/ws` and `/v1/session`
use: a conversation started anywhere is listed and continued here.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, Literal, TypeVar

import msgspec

from portico.core.engine import Engine, UserMessage
from portico.core.tools import ClientToolBroker
from portico.domain.model import ContentPart, Message, Session, ToolCallRecord, Turn, new_id
from portico.domain.trace import TraceEvent
from portico.domain.validation import check_parts, split_metadata
from portico.errors import (
    ClientIdConflict,
    DuplicateClientId,
    InvalidMessage,
    InvalidRequest,
    MessageNotFound,
    RtcNotFound,
    SessionClosed,
    SessionNotFound,
    TurnNotFound,
)
from portico.runtime.base import AGENT_PROMPT

E = TypeVar("E")


class Page(msgspec.Struct, Generic[E], frozen=True):
    items: list[E]
    next_cursor: str  # "" at the end
    # Messages only: id -> how many live chunks its `content` holds, for a reply being
    # streamed now (its content is the text so far; live chunks from there continue it).
    streamed: dict[str, int] = msgspec.field(default_factory=dict)


def page_of(found: Sequence[E], limit: int, cursor_of: Callable[[E], str]) -> Page[E]:
    """A page from `limit + 1` rows: the extra row only tells that more exist."""
    items = list(found[:limit])
    more = len(found) > limit
    return Page(items, cursor_of(items[-1]) if more and items else "")


class SendRequest(msgspec.Struct, frozen=True, kw_only=True):
    content: str
    client_id: str
    parts: tuple[ContentPart, ...] = ()
    agent_prompt: str = ""  # an instruction for the agent with this message only
    server_session_id: str = ""
    client_session_id: str = ""
    agent: str = ""
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


class ForkRequest(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str  # the session forked from
    message_id: str  # the fork point: copied messages are strictly before it
    content: str  # the replacement message, written in the fork point's place
    client_id: str = ""  # the replacement's client id
    client_session_id: str = ""
    limit: int = 200  # copy at most this many messages, counting back from the fork point


class Conversations:
    def __init__(
        self,
        engine: Engine,
        tools: ClientToolBroker,
        *,
        default_agent: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._engine = engine
        self._tools = tools
        self._sending: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._store = engine.store
        self._default_agent = default_agent
        self._clock = clock
        self._binding = ""

    def bound_to(self, binding: str) -> Conversations:
        """The archive as seen by a caller whose token carries the session-binding value
        `binding`: sessions it opens record it, and sessions recorded with another value
        are not found. Shares everything else with this instance."""
        view = copy.copy(self)
        view._binding = binding
        return view

    # -- sessions -------------------------------------------------------------------

    async def session(self, principal: str, session_id: str) -> Session:
        session = await self._store.get_session(session_id) if session_id else None
        if session is None or not self._mine(session, principal):
            raise SessionNotFound(session_id)
        return session

    async def trace(self, principal: str, session_id: str, *, limit: int) -> list[TraceEvent]:
        """The trace of the principal's session (a foreign one is `SessionNotFound`)."""
        await self.session(principal, session_id)
        return await self._store.list_trace(session_id, principal, limit=limit)

    async def list_sessions(self, principal: str, *, cursor: str, limit: int) -> Page[Session]:
        found = await self._store.list_sessions(
            principal, limit=limit + 1, cursor=cursor, include_deleted=False
        )
        return page_of(found, limit, lambda s: s.id)

    async def close(self, principal: str, session_id: str) -> Session:
        session = await self.session(principal, session_id)
        if session.status == "closed":
            return session
        now = self._clock()
        closed = msgspec.structs.replace(session, status="closed", closed_at=now, updated_at=now)
        stored = await self._store.update_session(closed)
        self._engine.session_ended(session.id, session.agent)
        return stored

    async def reopen(self, principal: str, session_id: str) -> Session:
        session = await self.session(principal, session_id)
        if session.status != "closed":
            return session
        opened = msgspec.structs.replace(
            session, status="idle", closed_at=None, updated_at=self._clock()
        )
        return await self._store.update_session(opened)

    async def update(
        self,
        principal: str,
        session_id: str,
        *,
        title: str | None = None,
        deleted_at: float | msgspec.UnsetType | None = msgspec.UNSET,
    ) -> Session:
        """Rename and/or soft-delete (a time) or restore (None) the session."""
        session = await self.session(principal, session_id)
        changes: dict[str, object] = {}
        if title is not None:
            changes["title"] = title
        if deleted_at is not msgspec.UNSET:
            changes["deleted_at"] = deleted_at
        if not changes:
            return session
        updated = msgspec.structs.replace(session, updated_at=self._clock(), **changes)
        return await self._store.update_session(updated)

    async def fork(self, principal: str, request: ForkRequest) -> tuple[Session, list[Message]]:
        """A new session with the history before the fork point and the replacement
        message in its place, whose turn starts the way a send's does."""
        old = await self.session(principal, request.session_id)
        point = await self._store.get_message(request.message_id) if request.message_id else None
        if point is None or point.session_id != old.id:
            raise MessageNotFound(request.message_id)
        before = point.global_offset - 1
        first = max(0, before - request.limit)
        copied = await self._store.list_messages(old.id, after_offset=first, limit=before - first)
        session = self._forked_session(old, point, request.client_session_id)
        stored = await self._store.fork_session(
            session, [_copy_into(session.id, message) for message in copied]
        )
        user = UserMessage(
            principal=principal,
            agent=session.agent,
            session_id=session.id,
            content=request.content,
            client_id=request.client_id,
            binding=self._binding,
        )
        replacement = await self._engine.enqueue(session, user)
        return session, [*stored, replacement]

    def _forked_session(self, old: Session, point: Message, client_session_id: str) -> Session:
        now = self._clock()
        return Session(
            id=new_id("sess"),
            owner=old.owner,
            agent=old.agent,
            created_at=now,
            updated_at=now,
            last_activity_at=now,
            title=old.title,
            client_session_id=client_session_id,
            parent_session_id=old.id,
            root_session_id=old.root_session_id or old.id,
            forked_from_message_id=point.id,
            binding=old.binding,
            declare=old.declare,
        )

    async def compact(self, principal: str, session_id: str, instruction: str) -> bool:
        """Queue a compaction; False when one is already queued (absorbed)."""
        session = await self.session(principal, session_id)
        return self._engine.compact(session, instruction)

    # -- messages -------------------------------------------------------------------

    async def send(self, principal: str, request: SendRequest) -> tuple[Session, Message]:
        """Store the user message and queue its turn; the turn's id is not known yet.

        Sends with the same client id are serialised (a retry racing its first attempt
        waits for it), so the second one finds the first and is a conflict.
        """
        key = (principal, request.client_id)
        while (earlier_send := self._sending.get(key)) is not None:
            await asyncio.wait({earlier_send})
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sending[key] = done
        try:
            return await self._send_once(principal, request)
        finally:
            del self._sending[key]
            done.set_result(None)

    async def _send_once(self, principal: str, request: SendRequest) -> tuple[Session, Message]:
        if not request.server_session_id:
            # Checked before a session is created for it; a send into an existing
            # session is checked by the archive in the message's own write instead.
            earlier = await self._store.find_message_by_client_id(principal, request.client_id)
            if earlier is not None:
                raise ClientIdConflict(
                    request.client_id, session_id=earlier.session_id, message_id=earlier.id
                )
        try:
            forwarded, directives = split_metadata(request.metadata)
        except InvalidMessage as exc:
            raise InvalidRequest(exc.message, field="params.metadata") from None
        _check_content(request)
        if request.agent_prompt:
            directives = {**directives, AGENT_PROMPT: request.agent_prompt}
        session = await self._session_for_send(principal, request)
        user = UserMessage(
            principal=principal,
            agent=session.agent,
            session_id=session.id,
            content=request.content,
            parts=request.parts,
            metadata=forwarded,
            directives=directives,
            client_id=request.client_id,
            unique_client_id=True,
            binding=self._binding,
        )
        try:
            return session, await self._engine.enqueue(session, user)
        except DuplicateClientId as exc:
            raise ClientIdConflict(
                exc.client_id, session_id=exc.session_id, message_id=exc.message_id
            ) from None

    async def _session_for_send(self, principal: str, request: SendRequest) -> Session:
        if request.server_session_id:
            session = await self.session(principal, request.server_session_id)
            if session.status == "closed":
                raise SessionClosed(session.id)
            return session
        agent = request.agent or self._default_agent
        if not self._engine.has_agent(agent):
            raise InvalidRequest(f"no agent named {agent!r}", field="params.agent")
        session_id = new_id("sess")
        return await self._engine.open_session(
            principal=principal,
            agent=agent,
            session_id=session_id,
            client_session_id=request.client_session_id,
            binding=self._binding,
        )

    async def message(self, principal: str, message_id: str) -> Message:
        message = await self._store.get_message(message_id) if message_id else None
        if message is None or not await self._owns(principal, message.session_id):
            raise MessageNotFound(message_id)
        return message

    async def list_messages(
        self, principal: str, session_id: str, *, after_offset: int, limit: int
    ) -> Page[Message]:
        await self.session(principal, session_id)
        found = await self._store.list_messages(
            session_id, after_offset=after_offset, limit=limit + 1
        )
        page = page_of(found, limit, lambda m: str(m.global_offset))
        return self._with_streamed_text(session_id, page)

    def _with_streamed_text(self, session_id: str, page: Page[Message]) -> Page[Message]:
        """A reply being streamed is archived with its text only at its end (the archive
        never holds up a chunk): a reader arriving mid-reply gets the text so far."""
        so_far = self._engine.streamed_so_far(session_id)
        if so_far is None or not so_far.chunks:
            return page
        items = [
            msgspec.structs.replace(m, content=so_far.text, status="streaming")
            if m.id == so_far.message_id and m.status in ("pending", "streaming")
            else m
            for m in page.items
        ]
        if items == page.items:
            return page
        return Page(items, page.next_cursor, {so_far.message_id: so_far.chunks})

    # -- turns and tool calls -------------------------------------------------------

    async def stop(self, principal: str, session_id: str) -> None:
        await self.session(principal, session_id)
        await self._engine.stop(session_id)

    async def turn(self, principal: str, turn_id: str) -> Turn:
        turn = await self._store.get_turn(turn_id) if turn_id else None
        if turn is None or not await self._owns(principal, turn.session_id):
            raise TurnNotFound(turn_id)
        return turn

    async def list_turns(
        self, principal: str, session_id: str, *, cursor: str, limit: int
    ) -> Page[Turn]:
        await self.session(principal, session_id)
        found = await self._store.page_turns(session_id, limit=limit + 1, cursor=cursor)
        return page_of(found, limit, lambda t: t.id)

    async def rtc(self, principal: str, rtc_id: str) -> ToolCallRecord:
        call = await self._store.get_tool_call(rtc_id) if rtc_id else None
        if call is None or not await self._owns(principal, call.session_id):
            raise RtcNotFound(rtc_id)
        return call

    async def rtc_status(
        self,
        principal: str,
        rtc_id: str,
        status: Literal["executing", "rejected"],
        client_id: str,
    ) -> ToolCallRecord:
        return await self._tools.rtc_status(await self.rtc(principal, rtc_id), status, client_id)

    async def rtc_submit(
        self, principal: str, rtc_id: str, *, success: bool, result: Any, error: str, client_id: str
    ) -> ToolCallRecord:
        record = await self.rtc(principal, rtc_id)
        return await self._tools.rtc_submit(
            record, success=success, result=result, error=error, client_id=client_id
        )

    async def list_rtcs(
        self, principal: str, session_id: str, *, cursor: str, limit: int
    ) -> Page[ToolCallRecord]:
        await self.session(principal, session_id)
        found = await self._store.page_tool_calls(session_id, limit=limit + 1, cursor=cursor)
        return page_of(found, limit, lambda c: c.id)

    async def _owns(self, principal: str, session_id: str) -> bool:
        session = await self._store.get_session(session_id)
        return session is not None and self._mine(session, principal)

    def _mine(self, session: Session, principal: str) -> bool:
        return session.owner == principal and session.binding == self._binding


def _copy_into(session_id: str, message: Message) -> Message:
    """A message of the forked session: new id, no turn or client id of its own (those
    belong to the original), `parent_message_id` naming the original."""
    return msgspec.structs.replace(
        message,
        id=new_id("msg"),
        session_id=session_id,
        turn_id="",
        client_id="",
        parent_message_id=message.id,
        global_offset=0,
    )


def _check_content(request: SendRequest) -> None:
    if not request.content and not request.parts:
        raise InvalidRequest("a message needs content_data or parts", field="params.content_data")
    try:
        check_parts(request.parts)
    except InvalidMessage as exc:
        raise InvalidRequest(exc.message, field="params.parts") from None
