"""One turn, run to its end in a task owned by the engine, not by a socket."""

from __future__ import annotations

import asyncio
import itertools
import logging
import mimetypes
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from portico.core.events import (
    Listener,
    TurnChunk,
    TurnCompleted,
    TurnEvent,
    TurnFailed,
    TurnMediaChunk,
)
from portico.core.telemetry import Telemetry
from portico.core.tools import ToolBroker
from portico.domain.model import ContentPart, Message, MessageStatus, PartType, Turn, new_id
from portico.domain.states import TurnState, TurnTrigger, next_turn_state
from portico.domain.trace import ERROR, SessionTraces
from portico.errors import (
    GENERIC_INTERNAL_MESSAGE,
    InternalError,
    PorticoError,
    RuntimeFailure,
    StoreError,
)
from portico.runtime.base import (
    Chunk,
    Done,
    Failure,
    MediaChunk,
    Runtime,
    RuntimeEvent,
    ToolCall,
    ToolOutcome,
    TurnInput,
    TurnStream,
    Usage,
)
from portico.store.base import Store

log = logging.getLogger("portico.turn")


class StreamedSoFar(NamedTuple):
    """The reply message being streamed now: its text so far, and how many live chunks
    (`TurnChunk.index` 0 ... `chunks - 1`) that text holds."""

    message_id: str
    text: str
    chunks: int


YIELD_EVERY = 64  # runtime events between forced yields to the event loop
_END_RETRIES: set[asyncio.Task[None]] = set()


class EndRetry(msgspec.Struct, frozen=True, kw_only=True):
    """A turn's end the archive refused (PostgreSQL reset, failing over) is written
    again: every `interval` seconds for `window` seconds (settings
    `turn_end_retry_interval`, `turn_end_retry_window`)."""

    interval: float = 0.5
    window: float = 120.0


class TurnRunner:
    """Drives a runtime's stream, fans events out, archives the reply exactly once."""

    def __init__(
        self,
        *,
        turn: Turn,
        turn_input: TurnInput,
        runtime: Runtime,
        store: Store,
        tools: ToolBroker,
        listeners: Callable[[], tuple[Listener, ...]],
        tap: Listener | None = None,
        clock: Callable[[], float],
        telemetry: Telemetry,
        reply: Message | None = None,
        reply_written: asyncio.Future[Any] | None = None,
        traces: SessionTraces | None = None,
        end_retry: EndRetry | None = None,
    ) -> None:
        self.turn = turn
        self._end_retry = end_retry or EndRetry()
        self._traces = traces
        self._telemetry = telemetry
        self._created = time.perf_counter()
        self._first_chunk: float | None = None
        self._input = turn_input
        self._runtime = runtime
        self._store = store
        self._tools = tools
        self._listeners = listeners
        # Sees every event and counts as no listener (the link to other replicas).
        self._tap = tap
        self._clock = clock
        self._text: list[str] = []
        self._chunks = 0  # chunks of the current reply message (RPC live `index`)
        self._streamed = 0  # chunks of the whole turn
        self._steps = 0  # events emitted: each event's `step` (core/events.py)
        # The text of the reply messages a tool call already ended (docs/storage.md,
        # "A turn's messages"): the turn's answer is theirs and the current one's.
        self._earlier: list[str] = []
        # Streamed media, archived whole through the media port as parts of the reply
        # message it came with, so that a reloaded client can still play it.
        self._media_pieces: dict[str, list[bytes]] = {}  # media id -> its chunks so far
        self._kept: list[asyncio.Future[ContentPart | None]] = []  # the current message's
        # The reply is archived before its first chunk: by the engine with the turn
        # (`reply`, `pending`) or here as a `streaming` message at the first chunk; it
        # is completed at the end, or at the agent's next tool call, after which the
        # text goes to a new message. Readers and RPC clients see it while it grows.
        self.reply_id = new_id("msg") if reply is None else reply.id
        # The turn's messages are numbered from 1 (the user's); tool calls take numbers too.
        self._reply_offset: int | None = None if reply is None else reply.turn_offset
        self._offsets = itertools.count(2 if reply is None else reply.turn_offset + 1)
        self._reply_opened: asyncio.Future[Any] | None = reply_written
        # Why a cancellation arrived: a user's stop, or the server shutting down.
        self.stop_trigger = TurnTrigger.INTERRUPT
        self._stop_requested = False
        # Only the runtime's stream is cancelled: a task cancelled before its first
        # step, or while archiving, would end without its one terminal event.
        self._driving = False
        self._task: asyncio.Task[object] | None = None
        self._started: asyncio.Future[None] | None = None

    @property
    def message(self) -> Message:
        """The user message this turn answers."""
        return self._input.message

    @property
    def owner(self) -> str:
        return self._input.owner

    @property
    def reply_archived(self) -> bool:
        """The reply's `streaming` message is in the archive (its `created` update out)."""
        opened = self._reply_opened
        return (
            opened is not None
            and opened.done()
            and not opened.cancelled()
            and (opened.exception() is None)
        )

    def streamed_so_far(self) -> StreamedSoFar | None:
        """What the archive does not hold yet (it gets a reply's text at its end): for a
        reader arriving mid-reply. None while the current reply is not archived."""
        if not self.reply_archived:
            return None
        return StreamedSoFar(self.reply_id, "".join(self._text), self._chunks)

    def request_stop(self, trigger: TurnTrigger) -> None:
        """End the turn early: at once while the runtime streams, else before it starts."""
        self.stop_trigger = trigger
        self._stop_requested = True
        if self._driving and self._task is not None:
            self._task.cancel()

    def emit(self, event: TurnEvent) -> int:
        """Number the event's step, hand it to every attached connection; returns how
        many took it."""
        step = self._steps = self._steps + 1
        if event.step != step:  # a chunk is built with its step: the others are rare
            event = msgspec.structs.replace(event, step=step)
        delivered = 0
        if self._tap is not None:
            self._tap(event)
        for listener in self._listeners():
            try:
                listener(event)
                delivered += 1
            except Exception:
                log.exception("turn listener failed session=%s", self.turn.session_id)
        return delivered

    def _refused(self, error: PorticoError) -> Failure:
        """A refusal the runtime let through (a `url` part whose fetch was refused):
        the client's error, logged in one line. Anything else is a crash."""
        if error.http_status >= 500:
            log.error(
                "runtime raised session=%s turn=%s",
                self.turn.session_id,
                self.turn.id,
                exc_info=error,
            )
            return Failure(code=InternalError.code, message=GENERIC_INTERNAL_MESSAGE)
        log.info(
            "turn refused session=%s turn=%s code=%s",
            self.turn.session_id,
            self.turn.id,
            error.code,
        )
        return Failure(code=error.code, message=error.message)

    async def run(self) -> Turn:
        self._task = asyncio.current_task()
        # The `running` record is written behind the runtime's first steps: the first
        # chunk must not wait for the archive. Archive writes are queued in order, so
        # the turn's end still lands after it.
        if self.turn.state is TurnState.PENDING:  # else the engine archived it running
            self._advance(TurnTrigger.START)
            self._started = asyncio.ensure_future(self._store.save_turn(self.turn))
        terminal: Done | Failure | None = None
        if not self._stop_requested:
            stream = self._runtime.run(self._input)
            self._driving = True
            try:
                terminal = await self._drive(stream)
            except asyncio.CancelledError:
                terminal = None
            except PorticoError as exc:
                terminal = self._refused(exc)
            except Exception:
                log.exception(
                    "runtime raised session=%s turn=%s", self.turn.session_id, self.turn.id
                )
                terminal = Failure(code=InternalError.code, message=GENERIC_INTERNAL_MESSAGE)
            finally:
                self._driving = False
                await _close_quietly(stream)
        await self._finish(terminal)
        duration = time.perf_counter() - self._created
        self._telemetry.turn_ended(
            self.turn.state, first_chunk_seconds=self._first_chunk, duration_seconds=duration
        )
        log.info(
            "turn ended session=%s turn=%s state=%s chunks=%d duration_ms=%.1f",
            self.turn.session_id,
            self.turn.id,
            self.turn.state,
            self._streamed,
            duration * 1000,
        )
        return self.turn

    async def _drive(self, stream: TurnStream) -> Done | Failure:
        reply: ToolOutcome | None = None
        handled = 0
        while True:
            try:
                event: RuntimeEvent = await stream.asend(reply)
            except StopAsyncIteration:
                return Done()
            reply = None
            if type(event) is Chunk:
                self._on_chunk(event)  # the hot path, without a coroutine per chunk
            elif isinstance(event, Done | Failure):
                return event
            else:
                reply = await self._handle(event)
            handled += 1
            if handled % YIELD_EVERY == 1:
                # A runtime that never awaits would starve every other session. Yielding
                # after the first event sends it at once; then every few events (not every
                # one), so writers send a burst's frames in a few batches.
                await asyncio.sleep(0)

    async def _handle(self, event: Chunk | MediaChunk | ToolCall | Usage) -> ToolOutcome | None:
        session_id, turn_id = self.turn.session_id, self.turn.id
        if isinstance(event, Usage):
            # Saved with the turn's end (one write), not per model request.
            self.turn = msgspec.structs.replace(
                self.turn,
                input_tokens=self.turn.input_tokens + event.input_tokens,
                output_tokens=self.turn.output_tokens + event.output_tokens,
            )
            return None
        if isinstance(event, Chunk):
            self._on_chunk(event)
            return None
        if isinstance(event, MediaChunk):
            self.emit(TurnMediaChunk(session_id, turn_id, event))
            self._collect(event)
            return None
        if self._tools.archives_calls:
            await self._close_reply()  # the call's messages come after what was said
        outcome = await self._tools.call(
            self._input.owner, session_id, turn_id, event, self.emit, self._next_offset
        )
        if self._traces is not None:
            self._traces.tool_outcome(session_id, self._input.owner, event.name, outcome.status)
        return outcome

    def _on_chunk(self, event: Chunk) -> None:
        self._text.append(event.text)
        if self._first_chunk is None:
            self._first_chunk = time.perf_counter() - self._created
        if self._reply_opened is None:  # the turn's first words, or the first after a call
            self._open_reply()
        turn = self.turn
        self.emit(
            TurnChunk(
                turn.session_id, turn.id, event.text, self.reply_id, self._chunks, self._steps + 1
            )
        )
        self._chunks += 1
        self._streamed += 1

    async def _close_reply(self) -> None:
        """A tool call ends the reply message streamed before it: completed now, and the
        text after the call goes to a new message, so the turn's messages read in offset
        order as it happened (the engine's `pending` reply ends empty if nothing came)."""
        if self._reply_opened is None:
            return  # no message open: nothing streamed since the last call
        await asyncio.wait({self._reply_opened})
        content = "".join(self._text)
        parts = await self._kept_parts()
        try:
            await self._store.update_message(self._reply(content, parts, "completed"))
        except StoreError:
            log.exception("archiving a reply before a tool call failed turn=%s", self.turn.id)
        self._earlier.append(content)
        self._text, self._chunks = [], 0
        self.reply_id, self._reply_offset, self._reply_opened = new_id("msg"), None, None

    def _collect(self, chunk: MediaChunk) -> None:
        if self._input.media is None:
            return  # nowhere to keep it
        pieces = self._media_pieces.setdefault(chunk.media_id, [])
        pieces.append(chunk.data)
        if chunk.is_last:
            data = b"".join(self._media_pieces.pop(chunk.media_id))
            # Not awaited: the stream goes on while the media store writes.
            self._kept.append(asyncio.ensure_future(self._keep(chunk, data)))

    async def _keep(self, chunk: MediaChunk, data: bytes) -> ContentPart | None:
        media = self._input.media
        assert media is not None
        extension = mimetypes.guess_extension(chunk.mime_type) or ""
        try:
            kept = await media.keep(
                principal=self.owner,
                session_id=self.turn.session_id,
                mime_type=chunk.mime_type,
                data=data,
                filename=f"streamed-{chunk.media_id}{extension}",
            )
        except Exception:
            # The live view had it; the archive goes without rather than fail the turn.
            log.exception("archiving streamed media failed turn=%s", self.turn.id)
            return None
        return None if kept is None else ContentPart(type=_part_type(chunk.mime_type), media=kept)

    async def _kept_parts(self) -> tuple[ContentPart, ...]:
        """The current message's streamed media, once archived."""
        kept, self._kept = self._kept, []
        return tuple(part for part in await asyncio.gather(*kept) if part is not None)

    def _next_offset(self) -> int:
        return next(self._offsets)

    async def _finish(self, terminal: Done | Failure | None) -> None:
        """Archive the reply, record the turn's end, then send the one terminal event."""
        if not await self._settle_start():
            # Without its message in the archive the turn cannot stand as answered.
            terminal = Failure(code=InternalError.code, message=GENERIC_INTERNAL_MESSAGE)
        content = "".join(self._text)
        parts: tuple[ContentPart, ...] | None = None
        if isinstance(terminal, Done):
            content = content if terminal.content is None else self._last_part(terminal.content)
            parts = terminal.parts
        trigger = self._trigger_for(terminal)
        archived_parts = (*(parts or ()), *await self._kept_parts())
        if self._reply_opened is not None and not self._reply_opened.done():
            # The reply's insert must have landed before its end is queued: the end
            # updates it in place (or appends it when that insert failed).
            await asyncio.wait({self._reply_opened})
        reply = None
        if content or archived_parts or self._reply_opened is not None:
            failed = trigger in (TurnTrigger.FAIL, TurnTrigger.INTERRUPT)
            reply = self._reply(content, archived_parts, "failed" if failed else "completed")
        event = self._terminal_event(terminal, "".join(self._earlier) + content, parts)
        if isinstance(event, TurnFailed):
            self.turn = msgspec.structs.replace(
                self.turn, error_code=event.code, error_message=event.message
            )
            if self._traces is not None:
                self._traces.record(
                    self.turn.session_id,
                    self._input.owner,
                    ERROR,
                    turn_id=self.turn.id,
                    code=event.code,
                )
        self._advance(trigger)
        try:
            # The reply and the turn's end: one write, one commit, one update.
            await self._store.end_turn(self.turn, reply)
        except StoreError:
            # Logged; the client still gets its one terminal event, and the write is
            # tried again: a turn the archive keeps `running` would stay so while this
            # replica lives (the orphan sweep spares a live replica's turns).
            log.exception("archiving the turn's end failed turn=%s", self.turn.id)
            _retry_end(self._store, self.turn, reply, self._end_retry)
        self.emit(event)

    def _last_part(self, answer: str) -> str:
        """The part of a runtime's whole answer (`Done.content`) after the text the
        earlier reply messages of the turn hold; all of it when it does not start so."""
        earlier = "".join(self._earlier)
        return answer[len(earlier) :] if answer.startswith(earlier) else answer

    def _trigger_for(self, terminal: Done | Failure | None) -> TurnTrigger:
        if terminal is None:
            return self.stop_trigger
        return TurnTrigger.COMPLETE if isinstance(terminal, Done) else TurnTrigger.FAIL

    def _terminal_event(
        self, terminal: Done | Failure | None, content: str, parts: tuple[ContentPart, ...] | None
    ) -> TurnEvent:
        session_id, turn_id = self.turn.session_id, self.turn.id
        if isinstance(terminal, Done):
            return TurnCompleted(session_id, turn_id, content, parts)
        if terminal is None and self.stop_trigger is TurnTrigger.CANCEL:
            return TurnCompleted(session_id, turn_id, content, None, cancelled=True)
        if terminal is None:
            return TurnFailed(session_id, turn_id, InternalError.code, "the server stopped")
        code, message = RuntimeFailure(terminal.code, terminal.message).client_view()
        return TurnFailed(session_id, turn_id, code, message)

    def _reply(
        self, content: str, parts: tuple[ContentPart, ...], status: MessageStatus
    ) -> Message:
        if self._reply_offset is None:
            self._reply_offset = self._next_offset()
        offset, now = self._reply_offset, self._clock()
        return Message(
            id=self.reply_id,
            session_id=self.turn.session_id,
            turn_id=self.turn.id,
            role="assistant",
            content=content,
            content_type="markdown",
            parts=parts,
            status=status,
            created_at=now,
            updated_at=now,
            turn_offset=offset,
        )

    def _open_reply(self) -> None:
        # Not awaited: the first chunk must not wait for the archive. The writes are
        # queued in order, so the final update still lands after this insert.
        self._reply_opened = asyncio.ensure_future(
            self._store.append_message(self._reply("", (), "streaming"))
        )

    async def _settle_start(self) -> bool:
        """Wait for the writes started behind the turn; False if its message was lost."""
        try:
            if self._input.archived is not None:
                await self._input.archived
        except StoreError:
            log.exception("archiving the user's message failed turn=%s", self.turn.id)
            return False
        try:
            if self._started is not None:
                await self._started
        except StoreError:
            log.exception("archiving the turn's start failed turn=%s", self.turn.id)
        return True

    def _advance(self, trigger: TurnTrigger) -> None:
        now = self._clock()
        state = next_turn_state(self.turn.state, trigger)
        changes: dict[str, object] = {"state": state}
        if state is TurnState.RUNNING:
            changes["started_at"] = now
        else:
            changes["ended_at"] = now
        self.turn = msgspec.structs.replace(self.turn, **changes)


_PART_TYPES: dict[str, PartType] = {"image": "image", "audio": "audio", "video": "video"}


def _retry_end(store: Store, turn: Turn, reply: Message | None, retry: EndRetry) -> None:
    task = asyncio.ensure_future(_archive_end_later(store, turn, reply, retry))
    _END_RETRIES.add(task)
    task.add_done_callback(_END_RETRIES.discard)


async def _archive_end_later(
    store: Store, turn: Turn, reply: Message | None, retry: EndRetry
) -> None:
    """The turn's end again, every `retry.interval` within `retry.window` (the
    write replaces the reply and the turn: repeating it is harmless). Past the window
    the turn stays `running` until this replica's next start sweeps it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry.window
    while loop.time() < deadline:
        await asyncio.sleep(retry.interval)
        try:
            await store.end_turn(turn, reply)
        except StoreError:
            continue
        log.info("archived the turn's end on a retry turn=%s", turn.id)
        return
    log.error("archiving the turn's end failed for good turn=%s", turn.id)


def _part_type(mime_type: str) -> PartType:
    return _PART_TYPES.get(mime_type.split("/", 1)[0], "file")


async def _close_quietly(stream: TurnStream) -> None:
    try:
        await stream.aclose()
    except Exception:
        log.exception("runtime stream failed to close")
