"""Every error Portico raises, each carrying its wire consequence.

Protocol adapters never invent codes: they read ``code`` (the error code a
client sees), ``close_code`` (when the connection must close) and
``http_status`` (for upgrade refusals and HTTP routes) from the exception.
Foreign exceptions are translated at port boundaries
(``raise StoreError(...) from exc``) so nothing below leaks to a client.
"""

from __future__ import annotations

from typing import Any, ClassVar

# Codes a runtime may report that reach the client unchanged (Omnia spec, Error codes).
RUNTIME_PASSTHROUGH_CODES = frozenset(
    {
        "MAX_ROUNDS_EXCEEDED",
        "PROVIDER_RATE_LIMITED",
        "PROVIDER_UNAVAILABLE",
        "PROVIDER_STALLED",
        "PROVIDER_TIMEOUT",
        "PROVIDER_AUTH_FAILED",
        "RATE_LIMITED",
        "UNSATISFIABLE_FORMAT",
        "DUPLEX_ERROR",
        "CREDENTIAL_EXPIRED",
    }
)

GENERIC_INTERNAL_MESSAGE = "internal error"


class PorticoError(Exception):
    """Base class. ``code`` is what a client sees; ``message`` is safe to show."""

    code: ClassVar[str] = "INTERNAL_ERROR"
    close_code: ClassVar[int | None] = None
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidMessage(PorticoError):
    code = "INVALID_MESSAGE"
    http_status = 400


class FacetRefused(PorticoError):
    """The agent fixes its memory facet and the connection named another (`/ws`: 403)."""

    code = "FORBIDDEN"
    http_status = 403


class MemoryFull(InvalidMessage):
    """The memory key holds `memory_max_entries` entries: forget one to save another."""


class BinaryFrameError(InvalidMessage):
    """A binary frame that cannot be decoded; ``message`` names the defect.

    The messages are fixed strings (see ``protocols.omnia.binary``) so a client
    can tell a bad header from bad metadata without parsing prose.
    """


class DeclareTooLarge(InvalidMessage):
    """An Omnia `declare` over 16 KiB on the message that would open its session."""

    def __init__(self) -> None:
        super().__init__("declare exceeds 16 KiB")


class SessionExpired(PorticoError):
    """The named session cannot be resumed: expired, or not the caller's."""

    code = "SESSION_EXPIRED"
    http_status = 404
    MESSAGE: ClassVar[str] = "session context has expired; start a new session"

    def __init__(self) -> None:
        super().__init__(self.MESSAGE)


class TurnInProgress(PorticoError):
    code = "TURN_IN_PROGRESS"
    http_status = 409

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id} has a turn in progress; send again after its reply")


class DuplicateMessage(PorticoError):
    """`/v1/session`: the principal's archive already holds a message with this
    `client_id`; it was not archived or answered again. `details` say where it is and
    how far its reply got (docs/session.md, "Idempotency keys")."""

    code = "DUPLICATE_MESSAGE"
    http_status = 409

    def __init__(self, client_id: str, details: dict[str, Any]) -> None:
        super().__init__(f"client_id {client_id} was already sent", details=details)


class RateLimited(PorticoError):
    """Shed by a rate or concurrency limit (or a draining server); the socket stays open."""

    code = "RATE_LIMITED"
    http_status = 429


class TooManyConnections(RateLimited):
    """The principal has `max_connections_per_principal` sockets open already."""

    close_code = 4429  # 4000 + HTTP 429; an HTTP upgrade is refused with 429 itself

    def __init__(self) -> None:
        super().__init__("too many connections for this principal")


class TooManyUploads(RateLimited):
    """The principal holds `max_pending_uploads_per_principal` unused upload URLs."""

    def __init__(self) -> None:
        super().__init__("too many upload URLs pending; use or let some expire first")


class SessionDeclarationRefused(PorticoError):
    code = "SESSION_DECLARATION_REFUSED"
    http_status = 400


class InternalError(PorticoError):
    code = "INTERNAL_ERROR"

    def __init__(self, message: str = GENERIC_INTERNAL_MESSAGE) -> None:
        super().__init__(message)


class RuntimeFailure(PorticoError):
    """A runtime ended its turn with an error; ``code`` is chosen per instance."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.runtime_code = code

    def client_view(self) -> tuple[str, str]:
        """The code and message a client may see: spec codes pass, others are hidden."""
        if self.runtime_code in RUNTIME_PASSTHROUGH_CODES:
            return self.runtime_code, self.message
        return InternalError.code, GENERIC_INTERNAL_MESSAGE


class AgentError(RuntimeFailure):
    """Raised by an agent handler (`portico.agent`) to end its turn with a wire code.

    ``AgentError("PROVIDER_UNAVAILABLE", "the model is down")``: over gRPC the code and
    message go out as the turn's `error` as they are; a client sees them when the code is
    one of the client protocols' (`RUNTIME_PASSTHROUGH_CODES`), else `INTERNAL_ERROR`.

    The code is `runtime_code`; the message must be safe to show a user.
    """

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(code, message)


class UnknownAgent(PorticoError):
    code = "AGENT_NOT_FOUND"
    http_status = 404

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown agent {name!r}")


class Unauthenticated(PorticoError):
    code = "UNAUTHENTICATED"
    http_status = 401


class CredentialExpired(PorticoError):
    """A message arrived after the connection's credential deadline: not processed.
    The connection closes with 4401 "credential expired" (spec identity.md)."""

    code = "CREDENTIAL_EXPIRED"
    http_status = 401

    def __init__(self) -> None:
        super().__init__("the credential expired; reconnect with a fresh one")


class IdentityProviderUnavailable(Unauthenticated):
    """The issuer's keys could not be fetched: the credential cannot be checked now.
    HTTP answers 503 (so a client retries rather than drops its token); the WebSocket
    protocols answer as for any credential they cannot accept."""

    http_status = 503

    def __init__(self) -> None:
        super().__init__("identity provider unavailable; try again shortly")


class IllegalTransition(PorticoError):
    """A state machine was asked for a transition its table does not have."""

    code = "INTERNAL_ERROR"

    def __init__(self, machine: str, state: str, event: str) -> None:
        super().__init__(f"{machine}: no transition from {state!r} on {event!r}")
        self.state = state
        self.event = event


class StoreError(PorticoError):
    """The archive failed; the cause is chained, never shown to a client."""

    code = "INTERNAL_ERROR"
    http_status = 503


class DuplicateClientId(StoreError):
    """The owner already stored a message with this client id; nothing was written."""

    def __init__(self, client_id: str, *, session_id: str, message_id: str) -> None:
        super().__init__(f"client id {client_id} is taken")
        self.client_id = client_id
        self.session_id = session_id
        self.message_id = message_id


class ConfigError(PorticoError):
    """The settings cannot be used; the message names the setting."""

    code = "CONFIG_ERROR"


class StartupError(ConfigError):
    """The settings are valid but this machine refuses them: the address cannot be
    listened on, the data dir cannot be written. The message names the address or the
    folder and the flag that changes it."""


class PluginError(ConfigError):
    """An agent handler named by import path cannot be loaded or has the wrong shape."""


class ScriptError(ConfigError):
    """A scripted-runtime file does not follow the documented format."""


class MediaNotEnabled(PorticoError):
    code = "MEDIA_NOT_ENABLED"
    http_status = 404

    def __init__(self, message: str = "media storage is not enabled on this server") -> None:
        super().__init__(message)


class PayloadTooLarge(InvalidMessage):
    """An HTTP request body above its route's bound."""

    http_status = 413


class UploadFailed(PorticoError):
    """An upload was refused or did not complete; nothing was stored."""

    code = "UPLOAD_FAILED"
    http_status = 400


class UploadTooLarge(UploadFailed):
    """A declared size above `max_upload_bytes`, or a body longer than declared."""

    http_status = 413


class UploadNotFound(UploadFailed):
    http_status = 404

    def __init__(self, message: str = "unknown upload") -> None:
        super().__init__(message)


class UploadInProgress(UploadFailed):
    """Another request is sending this upload's body right now."""

    http_status = 409

    def __init__(self, message: str = "this upload is in progress") -> None:
        super().__init__(message)


class UploadGone(UploadFailed):
    """The upload URL expired or was already used: ask for a new one."""

    http_status = 410


class MediaNotFound(PorticoError):
    """No such media for this caller: missing, expired and foreign look the same."""

    code = "MEDIA_NOT_FOUND"
    http_status = 404

    def __init__(self, message: str = "no such media") -> None:
        super().__init__(message)


# -- /v1/session (spec/sessions-protocol.md, close codes) --------------------------------


class ProtocolViolation(PorticoError):
    """The peer broke a framing rule (first frame, seq gap, ack beyond sent)."""

    code = "PROTOCOL_ERROR"
    close_code = 4400


class SessionUnauthenticated(Unauthenticated):
    close_code = 4401


class ResumeFailed(PorticoError):
    """The session cannot be resumed; never says whether it exists."""

    code = "RESUME_FAILED"
    close_code = 4404
    http_status = 404

    def __init__(self, message: str = "the session cannot be resumed", **details: str) -> None:
        super().__init__(message, details=details or None)


class SessionAgentNotFound(PorticoError):
    code = "AGENT_NOT_FOUND"
    close_code = 4404

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown agent {name!r}")


class BufferOverflow(ResumeFailed):
    """The resend buffer is full: the peer reads but never acknowledges."""

    def __init__(self) -> None:
        super().__init__("the resend buffer overflowed", reason="buffer_overflow")


class SessionMoved(ResumeFailed):
    """A newer connection (maybe on another replica) claimed the session: this one is fenced."""

    def __init__(self) -> None:
        super().__init__("the session resumed elsewhere", reason="session_moved")


# -- /v1/rpc (rpc-protocol.md section 6: lower-case codes, `details` per error) ----------


class RpcError(PorticoError):
    code = "internal"


class InvalidRequest(RpcError):
    """Bad params or frame; `details` names the field (`{"field": "params.limit"}`)."""

    code = "invalid_request"
    http_status = 400

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message, details=None if field is None else {"field": field})


class MethodNotFound(RpcError):
    code = "method_not_found"


class RpcUnauthenticated(Unauthenticated):
    code = "unauthenticated"
    close_code = 4401


class RpcNotFound(RpcError):
    """Another user's entity is reported exactly like a missing one."""

    entity: ClassVar[str] = "entity"

    def __init__(self, entity_id: str) -> None:
        super().__init__(f"{self.entity} {entity_id} not found")


class SessionNotFound(RpcNotFound):
    code = "session.not_found"
    entity = "session"


class MessageNotFound(RpcNotFound):
    code = "message.not_found"
    entity = "message"


class TurnNotFound(RpcNotFound):
    code = "turn.not_found"
    entity = "turn"


class RtcNotFound(RpcNotFound):
    code = "rtc.not_found"
    entity = "rtc"


class SessionClosed(RpcError):
    code = "session.closed"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id} is closed; open it before sending")


class RtcInvalidTransition(RpcError):
    code = "rtc.invalid_transition"


class ClientIdConflict(RpcError):
    """A repeated `client_id`; `details` holds the ids the first request created."""

    code = "client_id_conflict"

    def __init__(self, client_id: str, *, session_id: str, message_id: str) -> None:
        super().__init__(
            f"client_id {client_id} was already used",
            details={"session_id": session_id, "message_id": message_id},
        )


class Forbidden(RpcError):
    """The entity is the caller's, but another client (`client_id`) owns this step of it."""

    code = "forbidden"


class RpcRateLimited(RpcError):
    code = "rate_limited"


class SessionCredentialExpired(CredentialExpired):
    """On `/v1/session` the message stays unhandled: the client resumes with a fresh
    token and resends it."""

    close_code = 4401


class RpcCredentialExpired(RpcError):
    """`CredentialExpired` in the RPC's lower-case codes."""

    code = "credential_expired"

    def __init__(self) -> None:
        super().__init__(CredentialExpired().message)


class RpcTooManyConnections(RpcRateLimited):
    close_code = TooManyConnections.close_code

    def __init__(self) -> None:
        super().__init__("too many connections for this principal")


class RpcInternal(RpcError):
    code = "internal"

    def __init__(self) -> None:
        super().__init__(GENERIC_INTERNAL_MESSAGE)


def as_rpc_error(error: PorticoError) -> PorticoError:
    """The RPC form of an error raised by code shared with the other protocols."""
    if isinstance(error, RpcError | RpcUnauthenticated):
        return error
    if isinstance(error, InvalidMessage):
        return InvalidRequest(error.message)
    if isinstance(error, RateLimited):
        return RpcRateLimited(error.message)
    if isinstance(error, Unauthenticated):
        return RpcUnauthenticated(error.message)
    if isinstance(error, MediaNotEnabled | MediaNotFound):
        return InvalidRequest(error.message)
    return RpcInternal()


class VoiceUnavailable(PorticoError):
    """The embedded voice agent's speech packages (`portico[voice]`) or its espeak-ng
    binary are missing: a call to an `embedded` agent fails with this, naming the fix."""

    code = "DUPLEX_ERROR"
    http_status = 503


class UnsatisfiableFormat(PorticoError):
    """A media format Portico cannot carry or did not negotiate."""

    code = "UNSATISFIABLE_FORMAT"
    http_status = 400


class DuplexError(PorticoError):
    """A voice call failed or could not start (`/ws`: one error per call)."""

    code = "DUPLEX_ERROR"
    http_status = 502


class BusUnavailable(PorticoError):
    """Replicas cannot reach their shared bus (Redis): a new turn is refused rather than
    run where another replica might run one of the same session (docs/replicas.md)."""

    code = "SERVICE_UNAVAILABLE"
    http_status = 503

    def __init__(
        self, message: str = "the replicas' bus is unreachable; try again shortly"
    ) -> None:
        super().__init__(message)


class SessionBackendUnavailable(PorticoError):
    """`/v1/session` cannot reach a backend a `hello` needs (the session state in Redis,
    the archive): no session is opened or resumed, and the connection is closed 1011
    so the client tries again soon."""

    code = "SERVICE_UNAVAILABLE"
    close_code = 1011
    http_status = 503

    def __init__(
        self, message: str = "the session state is unreachable; try again shortly"
    ) -> None:
        super().__init__(message)


class TurnReplicaGone(PorticoError):
    """The turn this control message concerns runs on a replica whose lease lapsed: it
    cannot be reached, and the turn ends `interrupted` when the sweep finds it."""

    code = "SERVICE_UNAVAILABLE"
    http_status = 503

    def __init__(
        self, message: str = "the replica running this turn is gone; it ends interrupted"
    ) -> None:
        super().__init__(message)
