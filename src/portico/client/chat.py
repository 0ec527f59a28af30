"""`portico chat`: a terminal chat on `SessionClient`.

Each line read from stdin is sent as a message and the reply streams to stdout
as it arrives; the next line is read once the turn has ended, so a piped script
of lines (`printf 'hi\\n/quit\\n' | portico chat`) runs as a conversation.
Tool calls are shown (name, consent message, categories) and answered by a
built-in demo tool set after a y/n line; any other tool is declined as
unknown. `/quit` or end of input ends the session. Reconnects are silent but
for one dim status line on stderr, written between lines, never inside a
streamed one. After a server restart the chat continues the same conversation
(`hello.continue`): a line typed meanwhile is sent when the server is back, and
a line whose reply had not started yet is sent again with its idempotency key
(by `SessionClient`), so one the old server had archived is answered from the
archive (`DUPLICATE_MESSAGE`), never twice. `--session ID` continues an archived
conversation and first prints it so far (read with `v1.message.list` on the
server's `/v1/rpc`): the user's lines after `> `, the replies, tool calls and
parts as the live view prints them. Media parts print as `[image: name]`,
`[audio: 0.5 s]`.

Voice: `/say FILE` speaks a 16-bit PCM WAV file (or raw PCM) in the format the
server hears (`ready.audio.input`; the chat offers 16 kHz mono) to an agent that
takes calls, as one audio item followed by half a second of silence, and prints
what the server heard (`[heard] ...`, its transcripts) and the agent's spoken reply
as text (with `[audio: 1.2 s]` for its speech, never played).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import struct
import sys
import threading
import wave
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, TextIO

import msgspec

from portico.client.rpc import MessageEntity, RpcClient, RpcClientError
from portico.client.session import (
    AudioItem,
    ConnectionStatus,
    SessionClient,
    SessionError,
    Turn,
    duplicate_details,
    is_voice_turn,
)
from portico.domain.model import ContentPart
from portico.protocols.session import frames as f

DEFAULT_URL: Final = "ws://127.0.0.1:8080/v1/session"
QUIT: Final = "/quit"
UNKNOWN_TOOL: Final = "unknown tool"
YES: Final = frozenset({"y", "yes"})
NO_PARAMETERS: Final[Mapping[str, Any]] = {"type": "object", "properties": {}}
# Streamed media are asked for so they can be named (`[audio: 0.5 s]`); never played.
AUDIO_OUTPUT: Final = tuple(f.AudioFormat(codec=c) for c in ("wav", "pcm16", "mp3", "opus"))
HISTORY_PAGE: Final = 200  # messages per `v1.message.list` call when printing a history
USER_PREFIX: Final = "> "  # a user's line in a printed history, as the prompt shows it
HIDDEN_KINDS: Final = frozenset({"thinking", "summary", "toolcall_output"})  # never shown live
SAY: Final = "/say"
# The input format offered for `/say` (the server chooses it when the agent takes calls).
VOICE_INPUT: Final = (f.AudioFormat(codec="pcm16", sample_rate=16000, channels=1),)
FRAME_MS: Final = 20  # audio is sent in frames of this length
TRAILING_SILENCE_MS: Final = 500  # after the file: a runtime that listens for a pause hears one
VOICE_REPLY_WAIT: Final = 60.0  # seconds the prompt waits for the spoken reply
RECONNECTED: Final = "(reconnected)"
CONTINUED: Final = "(reconnected: the server restarted; the conversation goes on)"


@dataclass(frozen=True)
class ChatOptions:
    url: str = DEFAULT_URL
    credential: str | None = None
    agent: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)  # sent with every message
    session: str | None = None  # continue this archived conversation


# -- the demo tools -----------------------------------------------------------------------


def get_time(**_: Any) -> str:
    """The local date and time, ISO 8601 with the UTC offset."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


def get_timezone(**_: Any) -> dict[str, str]:
    now = datetime.now().astimezone()
    return {"name": now.tzname() or "", "utc_offset": now.strftime("%z")}


def get_location(**_: Any) -> dict[str, str]:
    """Only what the machine knows without a GPS: its time zone."""
    return {"timezone": get_timezone()["name"], "accuracy": "time zone only"}


DEMO_TOOLS: Final = {
    "get_time": (get_time, "the local date and time"),
    "get_timezone": (get_timezone, "the local time zone and UTC offset"),
    "get_location": (get_location, "an approximate location (the local time zone)"),
}


# -- terminal input and output ------------------------------------------------------------


class Lines:
    """Lines of a text stream, read by a thread so a pipe, a file or a tty all work."""

    def __init__(self, stream: TextIO) -> None:
        self.interactive = stream.isatty()
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._eof = False
        loop = asyncio.get_running_loop()

        def pump() -> None:
            for line in stream:
                loop.call_soon_threadsafe(self._queue.put_nowait, line.rstrip("\r\n"))
            loop.call_soon_threadsafe(self._queue.put_nowait, None)

        # A daemon: a thread blocked in read() must not keep the process alive at exit.
        threading.Thread(target=pump, name="portico-chat-stdin", daemon=True).start()

    async def next(self) -> str | None:
        """The next line, or None at end of input (and every time after it)."""
        if self._eof:
            return None
        line = await self._queue.get()
        self._eof = line is None
        return line


class Screen:
    """Stdout for the conversation, stderr for status; knows whether a line is open."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self._out = out
        self._err = err
        self._mid_line = False
        self._dim = err.isatty()
        self._notices: list[str] = []  # status lines waiting for the open line to end

    def write(self, text: str) -> None:
        if text:
            self._out.write(text)
            self._out.flush()
            self._mid_line = not text.endswith("\n")
            self._flush_notices()

    def line(self, text: str) -> None:
        """`text` on a line of its own, even after a partly streamed reply."""
        self.write(("\n" if self._mid_line else "") + text + "\n")

    def end_line(self) -> None:
        if self._mid_line:
            self.write("\n")

    def typed(self, text: str, *, echo: bool) -> None:
        """The user answered a prompt: a terminal echoed it, a pipe did not."""
        if echo:
            self.write(text + "\n")
        else:
            self._mid_line = False
            self._flush_notices()

    def notice(self, text: str) -> None:
        """A status line, held back while a line is open: on a terminal stdout and
        stderr share the screen, and it must not land inside a streamed reply."""
        self._notices.append(text)
        self._flush_notices()

    def _flush_notices(self) -> None:
        while self._notices and not self._mid_line:
            self.status(self._notices.pop(0))

    def status(self, text: str) -> None:
        self._err.write(f"\x1b[2m{text}\x1b[0m\n" if self._dim else f"{text}\n")
        self._err.flush()


# -- the conversation ---------------------------------------------------------------------


class Chat:
    def __init__(self, options: ChatOptions, lines: Lines, screen: Screen) -> None:
        self._options = options
        self._lines = lines
        self._screen = screen
        self.interactive = lines.interactive
        self.client = SessionClient(
            options.url,
            credential=options.credential,
            agent=options.agent,
            on_status=self._on_status,
            audio_output=AUDIO_OUTPUT,
            audio_input=VOICE_INPUT,
            transcripts=True,
            continue_session=options.session,
            continue_after_restart=True,
        )
        self._opened = False
        self._voice_done = asyncio.Event()  # the spoken reply to `/say` ended
        self._voice_streamed = False
        for name, (func, description) in DEMO_TOOLS.items():
            self.client.register_tool(
                name, func, description=description, parameters=NO_PARAMETERS, consent=self._ask
            )

    async def converse(self) -> None:
        """Line after line until `/quit` or end of input; each turn shown to its end."""
        while (line := await self._prompt()) is not None and line.strip() != QUIT:
            if line.strip().startswith(SAY + " "):
                await self._speak(line.strip()[len(SAY) :].strip())
            elif line.strip():
                await self._say(line)

    async def _say(self, line: str) -> None:
        """Send `line` and show its turn (after a restart the client sends a line that
        was not answered yet again with its key; the server never takes it twice)."""
        turn = await self.client.start_turn(line, metadata=self._options.metadata or None)
        await self._show(turn)

    async def _speak(self, path: str) -> None:
        """`/say FILE`: the file as one audio item, then wait for the spoken reply."""
        fmt = self.client.audio_input
        if fmt is None:
            self._screen.line("[voice] this agent hears no audio")
            return
        try:
            pcm = read_pcm(path, fmt)
        except (OSError, ValueError, EOFError, wave.Error) as exc:
            self._screen.line(f"[voice] {path}: {exc}")
            return
        size = (fmt.sample_rate or 16000) * (fmt.channels or 1) * 2 * FRAME_MS // 1000
        silence = bytes(size) * (TRAILING_SILENCE_MS // FRAME_MS)
        self._voice_done.clear()
        audio = pcm + silence
        for start in range(0, len(audio), size):
            await self.client.send_audio(audio[start : start + size])
        await self.client.end_audio()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(VOICE_REPLY_WAIT):
                await self._voice_done.wait()

    async def _prompt(self) -> str | None:
        if self._lines.interactive:
            self._screen.write("> ")
        line = await self._lines.next()
        self._screen.typed("", echo=False)
        return line

    async def watch(self) -> None:
        """Messages outside any turn (late errors); returns or raises when the session stops."""
        async for frame in self.client:
            if isinstance(frame, f.Transcript):
                if frame.final:
                    self._screen.line(f"[heard] {frame.text}")
            elif is_voice_turn(getattr(frame, "turn_id", None)):
                self._voice(frame)
            elif isinstance(frame, f.Error):
                self._screen.status(f"[{frame.error.code}] {frame.error.message}")
                if frame.ref_seq is None:  # the call's own error: no reply is coming
                    self._voice_done.set()

    def _voice(self, frame: f.ServerNumbered) -> None:
        """A frame of a spoken agent turn: its text, its speech's length, its end."""
        if isinstance(frame, f.Chunk):
            self._screen.write(frame.content)
            self._voice_streamed = True
        elif isinstance(frame, f.AudioEnd):
            self._screen.line(audio_label(self.client.take_audio(frame.item_id)))
        elif isinstance(frame, f.Done | f.Error):
            if isinstance(frame, f.Done):
                self._done(frame, self._voice_streamed)
            else:
                self._error(frame, self._voice_streamed)
            self._voice_streamed = False
            self._voice_done.set()

    async def _show(self, turn: Turn) -> None:
        """The turn, to its end."""
        streamed = False
        async for frame in turn:
            if isinstance(frame, f.Chunk):
                self._screen.write(frame.content)
                streamed = True
            elif isinstance(frame, f.ToolCall) and frame.tool_call.name not in self.client.tools:
                self._screen.line(f"[tool] {frame.tool_call.name}: {UNKNOWN_TOOL}, declined")
                await self.client.nack_tool_call(frame.tool_call.id, UNKNOWN_TOOL)
            elif isinstance(frame, f.AudioEnd):
                self._screen.line(audio_label(self.client.take_audio(frame.item_id)))
            elif isinstance(frame, f.Done):
                self._done(frame, streamed)
            elif isinstance(frame, f.Error):
                self._error(frame, streamed)

    def _error(self, frame: f.Error, streamed: bool) -> None:
        duplicate = duplicate_details(frame.error)
        if duplicate is None:
            self._screen.line(f"[error {frame.error.code}] {frame.error.message}")
        elif duplicate.get("turn_state") != "running" and not streamed:
            # The server already had the line (a restart hid its answer): show that one.
            self._screen.write(str(duplicate.get("reply", "")))
            if duplicate.get("turn_state") not in ("completed", None):
                self._screen.write(f" [{duplicate['turn_state']}]")
            self._screen.end_line()

    def _done(self, frame: f.Done, streamed: bool) -> None:
        parts = frame.parts or ()
        if not streamed:
            texts = [part.text for part in parts if part.type == "text" and part.text]
            self._screen.write(frame.content or "\n\n".join(texts))
        if frame.cancelled:
            self._screen.write(" [cancelled]")
        for part in parts:
            if part.type != "text":
                self._screen.line(part_label(part))
        self._screen.end_line()

    async def _ask(self, frame: f.ToolCall) -> bool:
        """Consent for a demo tool: show the call, then one line answers y or n."""
        self._tool_lines(frame.tool_call)
        self._screen.write("allow? [y/N] ")
        answer = await self._lines.next()
        if answer is None:
            self._screen.line("(end of input: declined)")
            return False
        self._screen.typed(answer, echo=not self._lines.interactive)
        return answer.strip().lower() in YES

    def _tool_lines(self, call: f.ToolCallInfo) -> None:
        self._screen.line(" ".join(["[tool]", call.name, *_arguments(call.arguments)]))
        if call.consent_message:
            self._screen.line(f"       {call.consent_message}")
        if call.categories:
            self._screen.line(f"       categories: {', '.join(call.categories)}")

    async def print_history(self, session_id: str) -> None:
        """The conversation so far, in archive order, so a continued chat shows where
        it left off. A history that cannot be read is a status line, not a failure."""
        try:
            async with RpcClient(rpc_url(self._options.url), token=self._options.credential) as rpc:
                cursor: str | int = ""
                while True:
                    page = await rpc.message_list(session_id, cursor=cursor, limit=HISTORY_PAGE)
                    for message in page.items:
                        self._history_message(message)
                    if not page.has_more:
                        return
                    cursor = page.next_cursor
        except RpcClientError as exc:
            self._screen.status(f"(the conversation so far could not be read: {exc})")

    def _history_message(self, message: MessageEntity) -> None:
        data = message.content_data
        if message.content_type in HIDDEN_KINDS:
            return
        if message.content_type == "toolcall_input":
            with contextlib.suppress(msgspec.ValidationError):
                self._tool_lines(msgspec.convert(data, f.ToolCallInfo, strict=False))
            return
        text = data if isinstance(data, str) else ""
        if message.role == "user":
            self._screen.line(USER_PREFIX + text)
        elif text:
            self._screen.line(text)
        for part in message.parts:
            if part.type != "text":
                self._screen.line(part_label(part))

    def _on_status(self, status: ConnectionStatus) -> None:
        if status.state != "open":
            return
        if self._opened and (status.resumed or status.continued):
            self._screen.notice(CONTINUED if status.continued else RECONNECTED)
        self._opened = True


def rpc_url(session_url: str) -> str:
    """The server's `/v1/rpc`, beside the `/v1/session` the chat talks to."""
    base, _, _ = session_url.rstrip("/").rpartition("/v1/session")
    return f"{base}/v1/rpc" if base else session_url.rsplit("/", 1)[0] + "/v1/rpc"


def part_label(part: ContentPart) -> str:
    """`[image: name]`, `[audio: 0.5 s]`: a media part the terminal cannot show."""
    media = part.media
    if media is None:
        return f"[{part.type}]"
    if part.type == "audio" and media.duration_ms is not None:
        return f"[audio: {media.duration_ms / 1000:g} s]"
    return f"[{part.type}: {media.filename or media.mime_type}]"


def audio_label(item: AudioItem | None) -> str:
    """A streamed media item: its kind and length, or that it did not arrive whole."""
    if item is None or not item.complete:
        return "[audio: lost on the way]"
    mime = item.format.mime_type or ""
    if mime.startswith("image/"):
        return f"[image: {mime}]"
    seconds = audio_seconds(item)
    return f"[audio: {seconds:g} s]" if seconds is not None else f"[audio: {len(item.data)} bytes]"


def audio_seconds(item: AudioItem) -> float | None:
    """The duration of WAV or raw 16-bit PCM bytes, rounded to 0.1 s; None if unknown."""
    data, fmt = item.data, item.format
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE" and len(data) >= 44:
        (byte_rate,) = struct.unpack_from("<I", data, 28)
        size = len(data) - 44  # the canonical header; a longer one errs by a few bytes
    elif fmt.codec == "pcm16" and (rate := fmt.sample_rate or _mime_number(fmt, "rate")):
        channels = fmt.channels or _mime_number(fmt, "channels") or 1
        byte_rate, size = rate * channels * 2, len(data)
    else:
        return None
    return round(size / byte_rate, 1) if byte_rate else None


def _mime_number(fmt: f.AudioFormat, name: str) -> int | None:
    """A number from the MIME type's parameters (`audio/pcm;rate=16000;channels=1`)."""
    found = re.search(rf";\s*{name}=(\d+)", fmt.mime_type or "")
    return int(found.group(1)) if found else None


def read_pcm(path: str, fmt: f.AudioFormat) -> bytes:
    """16-bit PCM samples of `fmt` from a WAV file, or a raw file taken as such."""
    with open(path, "rb") as file:
        head = file.read(12)
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        with open(path, "rb") as file:
            return file.read()
    with wave.open(path, "rb") as wav:
        got = (wav.getsampwidth(), wav.getframerate(), wav.getnchannels())
        if got != (2, fmt.sample_rate, fmt.channels or 1):
            raise ValueError(
                f"a 16-bit {fmt.sample_rate} Hz, {fmt.channels or 1}-channel WAV is needed, "
                f"not {got[0] * 8}-bit {got[1]} Hz, {got[2]}-channel"
            )
        return wav.readframes(wav.getnframes())


def _arguments(arguments: Mapping[str, Any]) -> list[str]:
    return [f"{key}={value!r}" for key, value in arguments.items()]


async def run_chat(
    options: ChatOptions,
    *,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """The chat's exit status: 0 after `/quit` or end of input, 1 when the session failed."""
    screen = Screen(stdout or sys.stdout, stderr or sys.stderr)
    chat = Chat(options, Lines(stdin or sys.stdin), screen)
    try:
        await chat.client.connect()
    except SessionError as exc:
        screen.status(f"portico chat: {exc.message}")
        return 1
    if options.session is not None:
        await chat.print_history(options.session)
    if chat.interactive:
        screen.status(f"session {chat.client.session_id} ({QUIT} or end of input to leave)")
    conversation = asyncio.create_task(chat.converse())
    watcher = asyncio.create_task(chat.watch())
    try:
        await asyncio.wait({conversation, watcher}, return_when=asyncio.FIRST_COMPLETED)
        failure = _failure(conversation) or _failure(watcher)
        if failure is not None:
            screen.line("")
            screen.status(f"portico chat: {failure.message}")
            return 1
        await chat.client.end()
        return 0
    finally:
        for task in (conversation, watcher):
            task.cancel()
        await asyncio.gather(conversation, watcher, return_exceptions=True)
        await chat.client.close()


def _failure(task: asyncio.Task[None]) -> SessionError | None:
    """The task's SessionError; any other exception propagates."""
    if not task.done() or task.cancelled():
        return None
    error = task.exception()
    if error is None or isinstance(error, SessionError):
        return error
    raise error


__all__ = ["DEFAULT_URL", "ChatOptions", "run_chat"]
