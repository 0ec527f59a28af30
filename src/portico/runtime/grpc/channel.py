"""Dialling a contract runtime: the channel, the call metadata, connecting, and the
cause of a failure in a few words. Shared by the text runtime (`runtime.py`) and the
duplex one (`runtime/duplex/grpc.py`), so both reach an agent with the same TLS, token,
backoff and timeouts (docs/runtime-grpc.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from portico.config import AgentSettings
from portico.contract import runtime_pb2 as pb
from portico.contract.runtime_pb2_grpc import RuntimeServiceStub
from portico.runtime.causes import described_cause

if TYPE_CHECKING:
    from portico.contract.runtime_pb2_grpc import RuntimeServiceAsyncStub

Metadata = tuple[tuple[str, str], ...]


class Unreachable(Exception):
    """No stream could be opened; `cause` is safe to log."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


# What `decode_server_message` gives for bytes that are not a `ServerMessage`, told
# apart by identity. grpc's own deserializer logs a traceback and hands back None.
UNDECODABLE = pb.ServerMessage()
CONVERSE = "/omnia.runtime.v1.RuntimeService/Converse"


def decode_server_message(data: bytes) -> pb.ServerMessage:
    try:
        return pb.ServerMessage.FromString(data)
    except DecodeError:
        return UNDECODABLE


def converse(channel: grpc.aio.Channel) -> RuntimeServiceAsyncStub:
    """A stub whose `Converse` replies decode with `decode_server_message`."""
    stub: RuntimeServiceAsyncStub = RuntimeServiceStub(channel)
    stub.Converse = channel.stream_stream(
        CONVERSE,
        request_serializer=pb.ClientMessage.SerializeToString,
        response_deserializer=decode_server_message,
    )
    return stub


CORE_ERROR = "Internal error from Core"  # grpc.aio's text for a failed batch of its own


def classify(error: grpc.aio.AioRpcError | None) -> str:
    """The cause of a connection failure in a few words, from gRPC's status and text."""
    if error is None:
        return "no connection within the connect timeout"
    code = error.code()
    return status_cause(code) or described_cause(error.details() or "") or code.name.lower()


def status_cause(code: grpc.StatusCode) -> str | None:
    """The cause a status code alone names (the credential ones), else None."""
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return "unauthenticated"
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return "permission denied"
    return None


async def final_cause(
    call: grpc.aio.StreamStreamCall[Any, Any],
    fallback: str,
    *,
    within: float,
    probe: Callable[[], Awaitable[str | None]] | None = None,
) -> str:
    """The cause by the call's final status. A write on a call the runtime is ending
    may fail with a status of its own (`INTERNAL`) before the call's real one
    (`UNAUTHENTICATED`, say) arrives: that one is what the operator needs.

    When the write lost the race outright, grpc.aio ends the call itself with
    `INTERNAL` "Internal error from Core" and the runtime's status never surfaces;
    `probe` (a unary call with the same credentials) then names a credential refusal."""
    try:
        async with asyncio.timeout(within):
            code = await call.code()
            lost_race = code is grpc.StatusCode.INTERNAL and await call.details() == CORE_ERROR
            if lost_race and probe is not None:
                return await probe() or fallback
    except (TimeoutError, grpc.aio.AioRpcError):
        return fallback
    return status_cause(code) or fallback


def call_metadata(settings: AgentSettings, env: Mapping[str, str]) -> Metadata:
    """The bearer token from `grpc_token_env` as call metadata. Read here, kept out of
    the settings tree (which `config show` prints) and out of every log line."""
    token = env.get(settings.grpc_token_env) if settings.grpc_token_env else None
    return (("authorization", f"Bearer {token}"),) if token else ()


def open_channel(settings: AgentSettings) -> grpc.aio.Channel:
    """A channel to `grpc_target` with the agent's TLS, backoff and message limit; made
    in the running loop."""
    assert settings.grpc_target, "check_startable() requires it"
    backoff_ms = int(settings.grpc_reconnect_backoff_max * 1000)
    options = [
        ("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)),
        ("grpc.min_reconnect_backoff_ms", min(100, backoff_ms)),
        ("grpc.max_reconnect_backoff_ms", backoff_ms),
        ("grpc.max_receive_message_length", settings.grpc_max_message_bytes),
    ]
    if not settings.grpc_tls:
        return grpc.aio.insecure_channel(settings.grpc_target, options=options)
    roots = Path(settings.grpc_ca_file).read_bytes() if settings.grpc_ca_file else None
    credentials = grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc.aio.secure_channel(settings.grpc_target, credentials, options=options)


async def connect(
    channel: grpc.aio.Channel,
    stub: RuntimeServiceAsyncStub,
    *,
    within: float,
    metadata: Metadata,
) -> None:
    """Returns once `channel` is connected; raises `Unreachable` naming the cause."""
    try:
        await asyncio.wait_for(channel.channel_ready(), within)
    except TimeoutError:
        raise Unreachable(await last_connection_error(stub, metadata)) from None


async def last_connection_error(stub: RuntimeServiceAsyncStub, metadata: Metadata) -> str:
    # gRPC keeps why it cannot connect to itself; a call that does not wait for the
    # connection fails at once with that text.
    try:
        await stub.Health(pb.HealthRequest(), timeout=1.0, metadata=metadata)
    except grpc.aio.AioRpcError as error:
        return classify(error)
    return classify(None)


async def credential_refusal(
    stub: RuntimeServiceAsyncStub, metadata: Metadata, within: float
) -> str | None:
    """ "unauthenticated" or "permission denied" when the runtime refuses these call
    credentials on a unary call; None when it takes them or fails otherwise."""
    try:
        await stub.Health(pb.HealthRequest(), timeout=within, metadata=metadata)
    except grpc.aio.AioRpcError as error:
        return status_cause(error.code())
    return None
