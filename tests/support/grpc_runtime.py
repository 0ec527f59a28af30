"""A scriptable agent runtime serving the gRPC runtime contract, run in its own process.

    python tests/support/grpc_runtime.py --port 0 [--token T] [--tls CERT KEY]

prints `listening on PORT` once it serves. Each turn plays the scenario named by
the message's reserved `mock_scenario` metadata key (`SCENARIOS` below), so a test
scripts the runtime to behave well or badly per message. A stream opening with
`duplex_start` is a voice call playing the `DUPLEX_SCENARIOS` entry its
`system_instruction` names. `Invoke` is the control
channel: `{"healthy": false, "status": "..."}` changes what `Health` answers,
`{"resume": "unavailable" | "unimplemented" | "unspecified" | "normal"}` what
`HasConversation` answers (normal: RESUMABLE for a session seen on `Converse`,
NOT_FOUND otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from portico.contract import runtime_pb2 as pb
from portico.contract import runtime_pb2_grpc as pb_grpc

Out = pb.ServerMessage
START_TIMEOUT = 20.0
Send = Callable[[Out], Awaitable[None]]


def chunk(text: str) -> Out:
    return Out(chunk=pb.Chunk(content=text))


def done(**fields: Any) -> Out:
    return Out(done=pb.Done(**fields))


def error(code: str, message: str = "runtime says no") -> Out:
    return Out(error=pb.Error(code=code, message=message))


def media(media_id: str, sequence: int, data: bytes, *, last: bool, mime: str = "audio/pcm") -> Out:
    return Out(
        media_chunk=pb.MediaChunk(
            media_id=media_id, sequence=sequence, data=data, is_last=last, mime_type=mime
        )
    )


class Turn:
    """One turn as the scenario sees it: the opening message, a way to send, and the
    client tool results arriving on the stream."""

    def __init__(self, runtime: Runtime, stream: Stream, opening: pb.ClientMessage) -> None:
        self.runtime = runtime
        self.stream = stream
        self.opening = opening

    async def send(self, message: Out) -> None:
        await self.stream.context.write(message)

    async def tool(self, **call: Any) -> pb.ClientToolResult:
        await self.send(Out(tool_call=pb.ToolCall(execution=pb.TOOL_EXECUTION_CLIENT, **call)))
        answer = await self.stream.next_message()
        return answer.client_tool_result


async def s_stream(turn: Turn) -> None:
    for word in ("Hello", " from", " gRPC"):
        await turn.send(chunk(word))
    await turn.send(done(usage=pb.Usage(input_tokens=3, output_tokens=5, cost_usd=0.01)))


async def s_final(turn: Turn) -> None:
    await turn.send(chunk("draft"))
    image = pb.MediaContent(url="https://example.com/cat.png", mime_type="image/png")
    parts = [pb.ContentPart(type="text", text="see"), pb.ContentPart(type="image", media=image)]
    await turn.send(done(final_content="FINAL", parts=parts))


async def s_tool(turn: Turn) -> None:
    result = await turn.tool(
        id="call-1",
        name="get_location",
        arguments_json='{"query": "current"}',
        consent_message="Allow location access?",
        categories=["location"],
    )
    report = {
        "call_id": result.call_id,
        "result_json": result.result_json,
        "is_rejected": result.is_rejected,
        "rejection_reason": result.rejection_reason,
    }
    await turn.send(chunk(json.dumps(report, sort_keys=True)))
    await turn.send(done())


async def s_server_tool(turn: Turn) -> None:
    await turn.send(Out(tool_call=pb.ToolCall(id="srv-1", name="lookup", arguments_json="{}")))
    await turn.send(Out(tool_result=pb.ToolResult(id="srv-1", result_json="1")))
    await turn.send(chunk("after the server tool"))
    await turn.send(done())


async def s_media(turn: Turn) -> None:
    await turn.send(chunk("listen"))
    for sequence in range(3):
        await turn.send(media("m1", sequence, bytes([sequence]) * 4, last=sequence == 2))
    await turn.send(done())


async def s_meta(turn: Turn) -> None:
    opening = turn.opening
    auth = dict(turn.stream.context.invocation_metadata() or ()).get("authorization", "")
    report = {
        "session_id": opening.session_id,
        "content": opening.content,
        "metadata": dict(opening.metadata),
        "consent_grants": list(opening.consent_grants),
        "parts": [
            {"type": p.type, "text": p.text, "url": p.media.url, "mime_type": p.media.mime_type}
            for p in opening.parts
        ],
        "authorization": auth,
        "turns_on_stream": turn.stream.turns,
    }
    await turn.send(chunk(json.dumps(report, sort_keys=True)))
    await turn.send(done())


async def s_error_then_done(turn: Turn) -> None:
    await turn.send(chunk("partial"))
    await turn.send(error("PROVIDER_RATE_LIMITED", "slow down"))
    await turn.send(done(final_content="must be ignored"))


async def s_silent(turn: Turn) -> None:
    await asyncio.Event().wait()


async def s_stall(turn: Turn) -> None:
    await turn.send(chunk("then silence"))
    await asyncio.Event().wait()


async def s_empty(turn: Turn) -> None:
    await turn.send(Out())


async def s_bad_args(turn: Turn) -> None:
    bad = pb.ToolCall(
        id="c", name="get_location", arguments_json="{not json", execution=pb.TOOL_EXECUTION_CLIENT
    )
    await turn.send(Out(tool_call=bad))


async def s_media_gap(turn: Turn) -> None:
    await turn.send(media("m1", 0, b"a", last=False))
    await turn.send(media("m1", 2, b"c", last=True))


async def s_abort(turn: Turn) -> None:
    await turn.send(chunk("before the break"))
    await turn.stream.context.abort(grpc.StatusCode.UNAVAILABLE, "runtime going away")


async def s_undecodable(turn: Turn) -> None:
    await turn.send(chunk("before"))
    # Field 1 with wire type 7, which does not exist: no ServerMessage decodes from it.
    await turn.stream.context.write(b"\x0f\x00")


async def s_end_stream(turn: Turn) -> None:
    await turn.send(chunk("bye"))
    turn.stream.closing = True


async def s_hang_mid(turn: Turn) -> None:
    await turn.send(chunk("working"))
    await asyncio.Event().wait()


def s_error(code: str) -> Callable[[Turn], Awaitable[None]]:
    async def scenario(turn: Turn) -> None:
        await turn.send(error(code))

    return scenario


SCENARIOS: dict[str, Callable[[Turn], Awaitable[None]]] = {
    "stream": s_stream,
    "final": s_final,
    "tool": s_tool,
    "server_tool": s_server_tool,
    "media": s_media,
    "meta": s_meta,
    "error_then_done": s_error_then_done,
    "silent": s_silent,
    "stall": s_stall,
    "empty": s_empty,
    "bad_args": s_bad_args,
    "media_gap": s_media_gap,
    "abort": s_abort,
    "end_stream": s_end_stream,
    "undecodable": s_undecodable,
    "hang_mid": s_hang_mid,
    "error_passed": s_error("PROVIDER_UNAVAILABLE"),
    "error_masked": s_error("BACKEND_EXPLODED"),
}


# -- duplex calls (the stream's first message is `duplex_start`) --------------------------


def hello(**media: Any) -> Out:
    return Out(
        runtime_hello=pb.RuntimeHello(capabilities=["audio"], media=pb.MediaNegotiation(**media))
    )


async def d_hello_then_empty(turn: Turn) -> None:
    await turn.send(hello())
    await turn.send(Out())
    await asyncio.Event().wait()


async def d_error_then_done(turn: Turn) -> None:
    await turn.send(hello())
    await turn.send(error("PROVIDER_UNAVAILABLE", "the voice model is down"))
    await turn.send(done(final_content="must be ignored"))
    await asyncio.Event().wait()


async def d_error_masked(turn: Turn) -> None:
    await turn.send(hello())
    await turn.send(error("BACKEND_EXPLODED", "a secret detail"))


async def d_silent(turn: Turn) -> None:
    await asyncio.Event().wait()


async def d_stall_mid_turn(turn: Turn) -> None:
    await turn.send(hello())
    await turn.send(media("a", 0, b"\x01\x00", last=False))
    await asyncio.Event().wait()


async def d_abort(turn: Turn) -> None:
    await turn.send(hello())
    await turn.stream.context.abort(grpc.StatusCode.UNAVAILABLE, "runtime going away")


async def d_hang_up(turn: Turn) -> None:
    await turn.send(hello())
    await turn.send(chunk("goodbye"))
    await turn.send(done())


async def d_meta(turn: Turn) -> None:
    """Reports what reached it: the start, the token, then every frame until is_last."""
    start = turn.opening.duplex_start
    auth = dict(turn.stream.context.invocation_metadata() or ()).get("authorization", "")
    await turn.send(hello(codec="pcm16", sample_rate=24000, channels=1))
    frames = []
    while True:
        try:
            message = await turn.stream.next_message()
        except EOFError:
            break
        frames.append([message.audio_input.sequence, message.audio_input.data.hex()])
        if message.audio_input.is_last:
            break
    report = {
        "session_id": turn.opening.session_id,
        "codec": start.codec,
        "sample_rate": start.sample_rate,
        "channels": start.channels,
        "system_instruction": start.system_instruction,
        "authorization": auth,
        "frames": frames,
    }
    await turn.send(chunk(json.dumps(report, sort_keys=True)))
    await turn.send(done())


async def d_tool(turn: Turn) -> None:
    await turn.send(hello())
    answer = await turn.tool(id="call-1", name="get_time", arguments_json="{}")
    await turn.send(chunk(f"rejected={answer.is_rejected} reason={answer.rejection_reason}"))
    await turn.send(done())


async def d_video(turn: Turn) -> None:
    await turn.send(hello(codec="h264", frame_rate=30, resolution=720))
    await asyncio.Event().wait()


DUPLEX_SCENARIOS: dict[str, Callable[[Turn], Awaitable[None]]] = {
    "hello_then_empty": d_hello_then_empty,
    "error_then_done": d_error_then_done,
    "error_masked": d_error_masked,
    "silent": d_silent,
    "stall_mid_turn": d_stall_mid_turn,
    "abort": d_abort,
    "hang_up": d_hang_up,
    "meta": d_meta,
    "tool": d_tool,
    "video": d_video,
}


class Stream:
    """One `Converse` stream: reads the facade's messages one at a time."""

    def __init__(self, context: grpc.aio.ServicerContext[pb.ClientMessage, Out]) -> None:
        self.context = context
        self.turns = 0
        self.closing = False

    async def next_message(self) -> pb.ClientMessage:
        message = await self.context.read()
        if message is grpc.aio.EOF:
            raise EOFError
        assert isinstance(message, pb.ClientMessage)
        return message


class Runtime(pb_grpc.RuntimeServiceServicer):
    def __init__(self, token: str | None) -> None:
        self.token = token
        self.healthy = True
        self.status = "ok"
        self.resume = "normal"
        self.sessions: set[str] = set()
        self.open_streams: dict[str, int] = {}  # session id -> Converse streams open now

    def _authorized(self, context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        if self.token is None:
            return True
        metadata = dict(context.invocation_metadata() or ())
        return metadata.get("authorization") == f"Bearer {self.token}"

    async def Converse(  # noqa: N802 - the contract's name
        self, request_iterator: AsyncIterator[pb.ClientMessage], context: Any
    ) -> None:
        if not self._authorized(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        stream = Stream(context)
        session_id = ""
        try:
            while not stream.closing:
                try:
                    opening = await stream.next_message()
                except EOFError:
                    return
                if not session_id:
                    session_id = opening.session_id
                    self.open_streams[session_id] = self.open_streams.get(session_id, 0) + 1
                if opening.HasField("duplex_start"):
                    scenario = DUPLEX_SCENARIOS[opening.duplex_start.system_instruction]
                    await scenario(Turn(self, stream, opening))
                    return
                self.sessions.add(opening.session_id)
                stream.turns += 1
                name = opening.metadata.get("mock_scenario", "stream")
                await SCENARIOS.get(name, s_stream)(Turn(self, stream, opening))
        finally:
            if session_id:
                self.open_streams[session_id] -= 1

    async def Health(self, request: pb.HealthRequest, context: Any) -> pb.HealthResponse:  # noqa: N802
        if not self._authorized(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        return pb.HealthResponse(healthy=self.healthy, status=self.status, contract_version="1.3.0")

    async def HasConversation(  # noqa: N802
        self, request: pb.HasConversationRequest, context: Any
    ) -> pb.HasConversationResponse:
        if self.resume == "unimplemented":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no")
        states = {
            "unavailable": pb.RESUME_STATE_UNAVAILABLE,
            "unspecified": pb.RESUME_STATE_UNSPECIFIED,
        }
        state = states.get(self.resume)
        if state is None:
            found = request.session_id in self.sessions
            state = pb.RESUME_STATE_RESUMABLE if found else pb.RESUME_STATE_NOT_FOUND
        return pb.HasConversationResponse(state=state)

    async def Invoke(  # noqa: N802
        self, request: pb.InvocationRequest, context: Any
    ) -> pb.InvocationResponse:
        control = json.loads(request.input_json)
        self.healthy = control.get("healthy", self.healthy)
        self.status = control.get("status", self.status)
        self.resume = control.get("resume", self.resume)
        if control.get("forget"):
            self.sessions.clear()
        open_streams = {key: count for key, count in self.open_streams.items() if count}
        return pb.InvocationResponse(output_json=json.dumps({"open_streams": open_streams}))


def serialize(message: Out | bytes) -> bytes:
    """A `ServerMessage`, or bytes as they are: a runtime that sends what does not decode."""
    return message if isinstance(message, bytes) else message.SerializeToString()


async def start_converse_server(
    converse: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[None]],
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server on a free port whose only method is `Converse`, answered by
    `converse` with raw bytes allowed (`serialize`), started; the caller stops it."""
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(
        converse,
        request_deserializer=pb.ClientMessage.FromString,
        response_serializer=serialize,
    )
    service = grpc.method_handlers_generic_handler(
        "omnia.runtime.v1.RuntimeService", {"Converse": handler}
    )
    server.add_generic_rpc_handlers((service,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def add_runtime(runtime: Runtime, server: grpc.aio.Server) -> None:
    """The generated registration, but `Converse` replies go through `serialize`."""
    service = "omnia.runtime.v1.RuntimeService"
    unary = {
        "Invoke": (runtime.Invoke, pb.InvocationRequest, pb.InvocationResponse),
        "Health": (runtime.Health, pb.HealthRequest, pb.HealthResponse),
        "HasConversation": (
            runtime.HasConversation,
            pb.HasConversationRequest,
            pb.HasConversationResponse,
        ),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            method,
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
        for name, (method, request, response) in unary.items()
    }
    handlers["Converse"] = grpc.stream_stream_rpc_method_handler(
        runtime.Converse,
        request_deserializer=pb.ClientMessage.FromString,
        response_serializer=serialize,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))


async def serve(port: int, token: str | None, tls: tuple[bytes, bytes] | None) -> None:
    server = grpc.aio.server()
    add_runtime(Runtime(token), server)
    address = f"127.0.0.1:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        cert, key = tls
        credentials = grpc.ssl_server_credentials([(key, cert)])
        bound = server.add_secure_port(address, credentials)
    await server.start()
    print(f"listening on {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(grace=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token")
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    args = parser.parse_args()
    tls = None
    if args.tls:
        cert, key = (Path(path).read_bytes() for path in args.tls)
        tls = (cert, key)
    asyncio.run(serve(args.port, args.token, tls))


if __name__ == "__main__":
    main()


# -- the test side: the runtime as a child process ---------------------------------------


class RuntimeProcess:
    """This module as a child process on 127.0.0.1; `start` returns once it serves."""

    def __init__(
        self,
        log_path: Path,
        *,
        port: int = 0,
        token: str | None = None,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        self.log_path = log_path
        self.port = port
        self.token = token
        self.tls = tls
        self.process: subprocess.Popen[str] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> RuntimeProcess:
        command = [sys.executable, __file__, "--port", str(self.port)]
        if self.token:
            command += ["--token", self.token]
        if self.tls:
            command += ["--tls", *map(str, self.tls)]
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.process.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if line.startswith("listening on "):
                self.port = int(line.split()[-1])
                return self
            if not line and self.process.poll() is not None:
                break
        self.process.kill()
        raise RuntimeError(f"the test runtime did not start:\n{self.log_path.read_text()}")

    def kill(self) -> None:
        """SIGKILL: no goodbye on any stream."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    def control(self, **fields: Any) -> dict[str, Any]:
        """Change what Health or HasConversation answer (through `Invoke`); the runtime's
        state: `open_streams`, session id -> its `Converse` streams open now."""
        with grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.RuntimeServiceStub(channel)
            answer = stub.Invoke(pb.InvocationRequest(input_json=json.dumps(fields)), timeout=5)
        state: dict[str, Any] = json.loads(answer.output_json)
        return state
