"""Python clients of Portico's protocols."""

from portico.client.session import (
    AuthenticationError,
    ConnectError,
    ConnectionLostError,
    ConnectionStatus,
    ProtocolError,
    ReconnectPolicy,
    Reply,
    ResumeFailedError,
    SendBufferFullError,
    ServerMessage,
    SessionClient,
    SessionClosedError,
    SessionError,
    SessionReplacedError,
    Turn,
)

__all__ = [
    "AuthenticationError",
    "ConnectError",
    "ConnectionLostError",
    "ConnectionStatus",
    "ProtocolError",
    "ReconnectPolicy",
    "Reply",
    "ResumeFailedError",
    "SendBufferFullError",
    "ServerMessage",
    "SessionClient",
    "SessionClosedError",
    "SessionError",
    "SessionReplacedError",
    "Turn",
]
