"""One typed settings tree.

Precedence, lowest first: defaults < config file < ``PORTICO_*`` environment <
command-line flags. Every limit, timeout and buffer is a named setting here,
with its unit in the name's documentation; durations are seconds (float).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import jsonschema
import msgspec

from portico.config_errors import Origin, explain, nearest, read_yaml
from portico.errors import ConfigError

ENV_PREFIX = "PORTICO_"
# Variables read by something other than the settings tree.
OTHER_VARIABLES = ("PORTICO_CONFIG", "PORTICO_CREDENTIAL")
# Settings with no environment variable: nested structures.
FILE_ONLY_SETTINGS = frozenset({"agents"})
# Settings whose values an error message never repeats.
SECRET_SETTINGS = frozenset({"api_keys", "database_url", "redis_url", "s3_secret_access_key"})
DEFAULT_AGENT = "default"

Seconds = Annotated[float, msgspec.Meta(gt=0)]
Count = Annotated[int, msgspec.Meta(ge=1)]
Bytes = Annotated[int, msgspec.Meta(ge=1)]
RuntimeName = Literal["demo", "echo", "scripted", "openai", "openai-realtime", "grpc", "python"]
# Duplex (voice) runtimes: spec/realtime-audio.md, docs/voice.md.
DuplexRuntimeName = Literal["scripted", "grpc", "openai-realtime", "embedded"]
StoreName = Literal["sqlite", "memory", "postgres"]
SqliteWriter = Literal["auto", "inline", "process", "thread"]
# What chat-completions endpoints accept as a function name.
ToolName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
# A memory facet (spec/identity.md): the same rule as domain/memory.py FACET_PATTERN.
MemoryFacet = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/\-]{0,127}$")]


def _no_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


class _Tool(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind"
):
    pass


class HttpToolSettings(_Tool, frozen=True, kw_only=True, tag="http"):
    """A server-side tool: Portico calls an HTTP endpoint; clients never see the call."""

    name: ToolName
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=_no_parameters)  # JSON Schema
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "GET"
    # `{argument}` placeholders are filled URL-encoded; the other arguments go in the
    # query string (GET, DELETE) or a JSON body (POST, PUT, PATCH).
    url: str
    headers: dict[str, str] = msgspec.field(default_factory=dict)  # not for secrets
    headers_env: dict[str, str] = msgspec.field(default_factory=dict)  # header -> env variable
    timeout: Seconds = 10.0  # the whole call
    max_response_bytes: Bytes = 64 * 1024  # a longer response is a tool error


class BuiltinToolSettings(_Tool, frozen=True, kw_only=True, tag="builtin"):
    """A server-side tool built into Portico, chosen by name."""

    name: Literal["current_time"]
    description: str | None = None  # None: the built-in's own


class ClientToolSettings(_Tool, frozen=True, kw_only=True, tag="client"):
    """A tool the client runs: the call goes out through the tool-call broker."""

    name: ToolName
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=_no_parameters)  # JSON Schema
    consent_message: str | None = None
    categories: tuple[str, ...] = ()


ToolSettings = HttpToolSettings | BuiltinToolSettings | ClientToolSettings
McpServerName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,32}$")]


class McpServerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An MCP server whose tools the agent's model may call (docs/mcp.md); Portico runs
    the calls. Exactly one of `command` (stdio) and `url` (streamable HTTP)."""

    command: str | None = None  # started by Portico; it speaks MCP on its stdin and stdout
    args: tuple[str, ...] = ()
    cwd: str | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)  # as written: not for secrets
    env_from: dict[str, str] = msgspec.field(default_factory=dict)  # server's name -> ours
    url: str | None = None  # a streamable-HTTP endpoint, e.g. http://127.0.0.1:3001/mcp
    headers: dict[str, str] = msgspec.field(default_factory=dict)  # not for secrets
    headers_env: dict[str, str] = msgspec.field(default_factory=dict)  # header -> env variable
    tools: tuple[str, ...] | None = None  # the allow-list (the server's names); None: all
    tool_prefix: str | None = None  # before each tool's name; None: "<server name>__"
    start_timeout: Seconds = 10.0  # start or connect, handshake and tool listing
    call_timeout: Seconds = 30.0  # one tool call
    max_result_chars: Count = 100_000  # a longer result is cut (the model is told)


class AgentSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One agent clients can select by name (``/ws?agent=NAME``)."""

    runtime: RuntimeName = "demo"
    script: str | None = None
    # Sandbox names a session may declare (Omnia `declare.sandboxes`).
    sandboxes: tuple[str, ...] = ()
    description: str = ""
    # The facet every connection's memory uses: `/ws` without `memory_facet` gets it,
    # naming another is refused (403). None: the client chooses (spec/identity.md).
    memory_facet: MemoryFacet | None = None
    # Sent as `connected.ai_disclosure` and in `/v1/session` `ready`; None: absent.
    requires_ai_disclosure: bool | None = None
    # The `python` runtime: the agent handler, `module:attr` or a `portico.agents` entry
    # point's name (docs/agents.md).
    plugin: str | None = None

    # The `openai` runtime: an OpenAI-compatible /chat/completions endpoint (docs/openai.md).
    base_url: str | None = None  # e.g. https://api.openai.com/v1
    model: str | None = None
    api_key_env: str | None = None  # the NAME of the environment variable holding the key
    # `Authorization` sends `Bearer <key>`; any other header carries the key as is.
    api_key_header: str = "Authorization"
    provider: str = "openai"  # the provider type that error messages name
    system_prompt: str = ""
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: Count | None = None
    # Rendered from the message's metadata and appended to its text (spec: Message metadata).
    message_metadata_template: str | None = None
    max_rounds: Count = 10  # rounds of tool calls per turn
    first_token_timeout: Seconds = 90.0  # from sending a request to the first streamed event
    stream_idle_timeout: Seconds = 30.0  # longest silence once the stream has started
    request_timeout: Seconds = 300.0  # one whole request, from sending it to its stream's end
    retries: Annotated[int, msgspec.Meta(ge=0)] = 2  # after the first attempt (429, 502-504)
    retry_backoff: Seconds = 0.5  # first delay; doubles per retry, with jitter
    retry_backoff_max: Seconds = 8.0  # longest delay, also caps a provider's Retry-After
    max_stream_event_bytes: Bytes = 4 * 1024 * 1024  # one server-sent event
    tools: tuple[ToolSettings, ...] = ()
    # Offer the model the agent-memory tools (memory_save, memory_search, memory_forget).
    memory_tools: bool = False
    mcp_servers: dict[McpServerName, McpServerSettings] = msgspec.field(default_factory=dict)
    # Compact the session after a turn whose input tokens passed this; None: never.
    compact_after_tokens: Count | None = None
    summary_input_chars: Count = 100_000  # transcript the model summarises (the newest part)

    # The `grpc` runtime: an agent runtime dialled over the runtime contract
    # (docs/runtime-grpc.md). `first_token_timeout` and `stream_idle_timeout` bound its turns.
    grpc_target: str | None = None  # host:port
    grpc_tls: bool = False
    grpc_ca_file: str | None = None  # PEM roots that sign the runtime's certificate; None: system
    grpc_token_env: str | None = None  # the NAME of the env variable holding a bearer token
    grpc_connect_timeout: Seconds = 5.0  # reaching the runtime when a turn opens a stream
    grpc_reconnect_backoff_max: Seconds = 1.0  # longest wait between connection attempts
    grpc_stream_idle_close: Seconds = 300.0  # a conversation's stream unused this long closes
    grpc_health_required: bool = True  # /readyz is 503 while the runtime is unhealthy
    grpc_health_interval: Seconds = 5.0  # a Health answer is reused this long
    grpc_health_timeout: Seconds = 2.0  # deadline of one Health call
    grpc_max_message_bytes: Bytes = 16 * 1024 * 1024  # largest ServerMessage accepted
    grpc_read_buffer_messages: Count = 256  # read ahead of the turn, per stream
    # The runtime keeps the conversation: a /ws resume asks it (HasConversation).
    runtime_owns_context: bool = False

    # Voice calls (docs/voice.md): the agent's duplex runtime, configured beside its
    # text one. None: derived from `runtime` (`duplex_runtime_of`): a grpc
    # agent uses the same runtime, the demo agent the embedded one.
    duplex_runtime: DuplexRuntimeName | None = None
    duplex_script: str | None = None  # the scripted duplex runtime's script file


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Where to serve and store.
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8080
    data_dir: str = "./.portico"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    # The default agent (always named "default"); more agents under `agents`.
    runtime: RuntimeName = "demo"
    script: str | None = None
    plugin: str | None = None  # the default agent's handler when `runtime` is `python`
    agents: dict[str, AgentSettings] = msgspec.field(default_factory=dict)
    # The default agent's model when `runtime` is `openai` (`agents.default` for the rest).
    openai_base_url: str | None = None
    openai_model: str | None = None
    openai_api_key_env: str | None = None
    openai_system_prompt: str = ""
    demo_word_delay: Annotated[float, msgspec.Meta(ge=0)] = 0.03  # seconds between demo words
    # The default agent's runtime when `runtime` is `grpc` (`agents.default` for the rest).
    grpc_target: str | None = None
    grpc_tls: bool = False
    grpc_ca_file: str | None = None
    grpc_token_env: str | None = None

    # Archive backend: `sqlite` (file in data_dir), `memory` (lost on exit) or
    # `postgres` (database_url; several replicas may share it).
    store: StoreName = "sqlite"
    # Where the SQLite archive's writes run: `process` (a writer process of its own,
    # off the event loop's GIL; started again if it dies), `thread` (a thread of the
    # server), `inline` (on the event loop's thread: no hand-off; checkpoints and
    # writes that grow with the archive stay on a thread) or `auto`: `process` where
    # this server may use two CPUs or more, else `thread`. docs/performance.md has
    # the measurements.
    sqlite_writer: SqliteWriter = "auto"
    database_url: str = ""  # postgresql://user:password@host:5432/database
    database_pool_size: Count = 10  # connections each process opens to database_url
    # This process as the replica that runs its turns; empty: a fresh id per start.
    # A stable id lets a restarted replica interrupt the turns its earlier run left.
    replica_id: str = ""
    # Seconds a replica may go without renewing its lease before it counts as dead
    # and another replica interrupts its unfinished turns.
    replica_lease: Seconds = 30.0
    # A turn's end the archive refused (PostgreSQL reset, failing over) is written
    # again every turn_end_retry_interval seconds for turn_end_retry_window seconds.
    turn_end_retry_interval: Seconds = 0.5
    turn_end_retry_window: Seconds = 120.0
    # Bus between replicas (docs/replicas.md): `memory` (one process) or `redis`
    # (redis_url; turn output, RPC updates, control and `/v1/session` state reach
    # every replica).
    bus: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"  # redis://:password@host:6379/0
    redis_key_prefix: str = "portico:"  # every key and channel of this deployment starts so
    bus_stream_max_len: Count = 10_000  # entries kept per stream (approximate trim)
    bus_read_block: Seconds = 1.0  # longest a stream read blocks before re-checking
    # Where `/v1/session` keeps its numbered streams (docs/replicas.md, Session state):
    # `memory` (this process) or `redis` (redis_url: any replica resumes any session).
    session_state: Literal["memory", "redis"] = "memory"
    # Longest a replica waits for the one running a turn to answer forwarded control
    # (a stop, a tool result); past it the client gets SERVICE_UNAVAILABLE.
    bus_control_timeout: Seconds = 5.0
    bus_topic_ttl: Seconds = 86_400.0  # a turn-output stream's life after its last entry
    # A session's turn-lock token counter outlives the session's last turn this long; at
    # least 2 x replica_lease + turn_end_retry_window (no writer of the turn is left).
    turn_fence_ttl: Seconds = 86_400.0
    # A replica's control inbox outlives the replica this long: the replica renews it
    # every third of this while it reads it (so at least 3 x bus_read_block).
    bus_inbox_ttl: Seconds = 300.0
    # Longest a stopping replica waits to close each Redis client (bus, session state,
    # call directory): redis-py's close can hang on a server that stopped answering.
    redis_close_timeout: Seconds = 5.0

    # Authentication: `none` (one principal, `local`), `apikey` or `jwt` (docs/auth.md).
    auth: Literal["none", "apikey", "jwt"] = "none"
    api_keys: dict[str, str] = msgspec.field(default_factory=dict)  # token -> principal
    allow_unauthenticated: bool = False  # permit auth=none on a non-loopback bind
    # auth=jwt: access tokens signed by an OpenID provider (or any JWKS).
    jwt_issuer: str = ""  # the required `iss`; keys from its OIDC discovery document
    jwt_audience: str = ""  # the required `aud`; empty: `aud` is not checked
    jwt_jwks_url: str = ""  # the keys' URL; set: discovery is skipped
    jwt_algorithms: tuple[str, ...] = ("RS256", "ES256", "EdDSA")  # never `none` or HS*
    jwt_leeway: Annotated[float, msgspec.Meta(ge=0)] = 30.0  # seconds of clock skew
    jwt_principal_claim: str = "sub"
    jwt_session_claim: str = ""  # a resume needs the same value; empty: no binding
    jwt_jwks_refresh_interval: Seconds = 60.0  # an unknown `kid` refetches at most this often
    jwt_jwks_timeout: Seconds = 5.0  # one discovery or JWKS fetch
    # Verified tokens kept (LRU) so a reconnect skips the signature check; 0: no cache.
    jwt_cache_entries: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    # A connection closes 4401 this long before its token's `exp` (or at half the
    # token's remaining life when that is shorter), once no turn runs on it.
    credential_expiry_margin: Seconds = 30.0

    # Sessions.
    context_ttl: Seconds = 86400.0  # a session's context lives this long after its last activity

    # /ws keepalive and frame size.
    ping_interval: Seconds = 30.0
    pong_timeout: Seconds = 60.0
    max_payload_size: Bytes = 16 * 1024 * 1024  # largest frame accepted, bytes
    ws_compression: bool = False  # permessage-deflate costs CPU per frame

    # Client-side tools (issue: /ws complete).
    tool_ack_timeout: Seconds = 5.0
    client_tool_timeout: Seconds = 60.0

    # Media (issue: /ws complete).
    media: Literal["local", "s3", "none"] = "local"
    # media: s3 (docs/storage.md "Media on object storage"). Unset credentials: the
    # SDK's usual chain (AWS_* variables, shared files, instance roles).
    s3_endpoint_url: str | None = None  # None: the SDK's AWS endpoint for s3_region
    s3_bucket: str = "portico-media"
    s3_region: str = "us-east-1"
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    s3_timeout: Seconds = 10.0  # connect and read deadline of one object storage call
    # How long the presigned URL a `GET /media/download` redirects to stays valid.
    s3_download_url_ttl: Seconds = 300.0
    # The store's base URL as clients reach it (presigned URLs start with it), when
    # s3_endpoint_url is an address only the replicas reach. None: s3_endpoint_url.
    s3_public_url: str | None = None
    max_upload_bytes: Bytes = 100 * 1024 * 1024
    # What the base64 `data` of a maximal 16 MiB frame decodes to: as large as Omnia takes.
    max_inline_media_bytes: Bytes = 12 * 1024 * 1024
    media_ttl: Seconds = 86400.0
    upload_url_ttl: Seconds = 900.0  # an upload URL is usable this long after it is granted
    # The base URL clients reach this server at (behind a proxy); upload URLs start
    # with it. None: the scheme and Host of the request that asked for the upload.
    public_url: str | None = None
    media_fetch_timeout: Seconds = 30.0  # whole fetch of a `url` part for a runtime
    # Let `url` parts reach loopback, private and link-local addresses (off: no SSRF).
    media_fetch_private: bool = False
    media_sweep_interval: Seconds = 60.0  # how often expired media and upload URLs are deleted

    # Admission and shutdown (issue: /ws complete).
    max_connections: Count = 10000
    drain_timeout: Seconds = 30.0
    # Deadline of each backend's check behind /readyz (PostgreSQL query, Redis PING).
    readiness_timeout: Seconds = 2.0
    origins: tuple[str, ...] = ()  # empty: same-origin only; "*" allows any origin
    # Frames waiting for a connection that does not read; past this it is closed (4008
    # on /ws, where it bounds the backlog: one frame larger than it is still sent).
    max_send_queue_bytes: Bytes = 4 * 1024 * 1024
    # How long a closing handshake may take before the socket is dropped.
    close_timeout: Seconds = 5.0
    # Admission that strangers cannot exhaust (docs/security.md).
    # `/v1/rpc` before `connect`, `/v1/session` before `hello`: closed 4002 after this...
    handshake_timeout: Seconds = 10.0
    # ...and at most this many at once (and half of max_connections); a newer one
    # evicts the oldest (closed 1013).
    max_unauthenticated_connections: Count = 256
    max_connections_per_principal: Count = 100  # open WebSockets, every protocol
    max_pending_uploads_per_principal: Count = 100  # upload URLs granted, not yet used
    # An HTTP connection must send a whole request head within this long of connecting
    # (or of its previous response, when kept alive), else it is closed.
    http_header_timeout: Seconds = 15.0
    # An upload body must arrive at this many bytes per second, measured over each
    # `http_header_timeout` window, else the upload fails with 408.
    upload_min_rate_bytes: Bytes = 1024

    # Per-connection limits (issue: /ws complete).
    rate_limit_messages: Annotated[float, msgspec.Meta(gt=0)] = 50.0  # messages per second
    rate_limit_burst: Count = 100
    media_rate_bytes: Bytes = 2 * 1024 * 1024  # bytes per second
    media_rate_burst: Bytes = 16 * 1024 * 1024  # media bytes that may arrive at once

    # Voice calls (spec/realtime-audio.md, docs/voice.md).
    realtime_grace_window: Seconds = 15.0  # a dropped call stays parked this long for ?resume
    max_audio_sessions: Count = 1000  # live (or parked) calls per process
    max_audio_sessions_per_principal: Count = 4
    max_audio_bytes_per_second: Bytes = 256 * 1024  # inbound, per call (48 kHz stereo PCM16 fits)
    audio_burst_bytes: Bytes = 512 * 1024  # inbound audio that may arrive at once

    # /v1/session (issue: resumable sessions).
    resume_window: Seconds = 30.0
    # session_state=redis: a session's keys outlive its window's deadline this long, and
    # a held session's outlive its holder's last renewal resume_window + this (the
    # holder renews every third of it): a replica killed holding one leaves nothing for good.
    session_expiry_grace: Seconds = 60.0
    session_idle_timeout: Seconds = 45.0
    heartbeat_interval: Seconds = 15.0
    resend_buffer_messages: Count = 1000
    resend_buffer_bytes: Bytes = 8 * 1024 * 1024
    ack_delay: Seconds = 0.1  # acknowledge within this long of handling a message...
    ack_every: Count = 16  # ...or after this many unacknowledged messages

    # Agent memory (docs/memory.md), per key (principal, agent, memory facet).
    memory_max_entries: Count = 1000  # a save past this is refused until one is forgotten
    memory_max_entry_bytes: Bytes = 4096  # UTF-8 bytes of one entry
    memory_search_limit: Count = 20  # entries one search returns at most
    # Session traces: events one read returns at most (the oldest).
    trace_max_events: Count = 1000

    # /v1/rpc (issue: RPC).
    update_retention: Seconds = 604800.0
    update_prune_interval: Seconds = 3600.0  # how often updates past the retention are dropped

    def agent_names(self) -> list[str]:
        return sorted({DEFAULT_AGENT, *self.agents})

    def agent(self, name: str) -> AgentSettings | None:
        """The named agent; `default` comes from `runtime`/`script` unless configured."""
        if name in self.agents:
            return self.agents[name]
        if name == DEFAULT_AGENT:
            return AgentSettings(
                runtime=self.runtime,
                script=self.script,
                base_url=self.openai_base_url,
                model=self.openai_model,
                api_key_env=self.openai_api_key_env,
                system_prompt=self.openai_system_prompt,
                grpc_target=self.grpc_target,
                grpc_tls=self.grpc_tls,
                grpc_ca_file=self.grpc_ca_file,
                grpc_token_env=self.grpc_token_env,
                plugin=self.plugin,
            )
        return None

    def is_loopback_bind(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def check_startable(self, env: Mapping[str, str] | None = None) -> None:
        """Refuse settings that would start an unsafe or broken server."""
        if self.auth == "none" and not self.is_loopback_bind() and not self.allow_unauthenticated:
            raise ConfigError(
                f"refusing to serve on {self.host} without authentication; "
                "set auth=apikey or pass --allow-unauthenticated"
            )
        if self.auth == "apikey" and not self.api_keys:
            raise ConfigError("auth=apikey needs api_keys (PORTICO_API_KEYS=token=principal,...)")
        if self.auth == "jwt":
            self._check_jwt()
        if self.public_url and not self.public_url.startswith(("http://", "https://")):
            raise ConfigError("public_url must start with http:// or https://")
        self._check_keepalive()
        self._check_store()
        self._check_media()
        self._check_bus()
        for name in self.agent_names():
            agent = self.agent(name)
            if agent is not None and agent.runtime == "scripted" and not agent.script:
                raise ConfigError(f"agent {name!r}: the scripted runtime needs a script file")
            if agent is not None and agent.runtime == "python" and not agent.plugin:
                raise ConfigError(
                    f"agent {name!r}: the python runtime needs plugin: module:attr"
                    + (" (PORTICO_PLUGIN)" if name == DEFAULT_AGENT else "")
                )
            if agent is not None and agent.runtime in ("openai", "openai-realtime"):
                check_openai_agent(name, agent, os.environ if env is None else env)
            # Either half on grpc dials the same target with the same settings.
            if agent is not None and "grpc" in (agent.runtime, agent.duplex_runtime):
                check_grpc_agent(name, agent, os.environ if env is None else env)
            if agent is not None and agent.duplex_runtime == "scripted" and not agent.duplex_script:
                raise ConfigError(
                    f"agent {name!r}: the scripted duplex runtime needs duplex_script"
                )

    def _check_jwt(self) -> None:
        if not self.jwt_issuer and not self.jwt_jwks_url:
            raise ConfigError(
                "auth=jwt needs jwt_issuer or jwt_jwks_url (PORTICO_JWT_ISSUER=https://...)"
            )
        refused = [alg for alg in self.jwt_algorithms if not alg_allowed(alg)]
        if refused or not self.jwt_algorithms:
            raise ConfigError(
                f"jwt_algorithms: {', '.join(refused) or 'empty'} not allowed; "
                "use asymmetric algorithms such as RS256, ES256, EdDSA"
            )

    def _check_store(self) -> None:
        if self.store != "postgres":
            return
        if not self.database_url:
            raise ConfigError(
                "store=postgres needs database_url "
                "(PORTICO_DATABASE_URL=postgresql://user:password@host:5432/database)"
            )
        if urlsplit(self.database_url).scheme not in ("postgresql", "postgres"):
            raise ConfigError("database_url must start with postgresql:// or postgres://")
        if importlib.util.find_spec("asyncpg") is None:
            raise ConfigError("store=postgres needs asyncpg: pip install 'portico[postgres]'")

    def _check_media(self) -> None:
        if self.media != "s3":
            return
        if not self.s3_bucket:
            raise ConfigError("media=s3 needs s3_bucket (PORTICO_S3_BUCKET=portico-media)")
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ConfigError("s3_access_key_id and s3_secret_access_key go together")
        for name in ("s3_endpoint_url", "s3_public_url"):
            url = getattr(self, name)
            if url is not None and not url.startswith(("http://", "https://")):
                raise ConfigError(f"{name} must start with http:// or https://")
        if importlib.util.find_spec("aiobotocore") is None:
            raise ConfigError("media=s3 needs aiobotocore: pip install 'portico[s3]'")

    def _check_bus(self) -> None:
        if self.bus_inbox_ttl < 3 * self.bus_read_block:
            # Renewed between reads: a shorter one could lapse under a living replica.
            raise ConfigError("bus_inbox_ttl must be at least 3 x bus_read_block")
        fenced_writes = 2 * self.replica_lease + self.turn_end_retry_window
        if self.bus == "redis" and self.turn_fence_ttl < fenced_writes:
            # Shorter, the counter could restart while the last holder may still write.
            raise ConfigError(
                "turn_fence_ttl must be at least 2 x replica_lease + turn_end_retry_window"
            )
        for name, value in (("bus", self.bus), ("session_state", self.session_state)):
            if value != "redis":
                continue
            if urlsplit(self.redis_url).scheme not in ("redis", "rediss", "unix"):
                raise ConfigError(
                    f"{name}=redis needs redis_url (PORTICO_REDIS_URL=redis://host:6379/0)"
                )
            if importlib.util.find_spec("redis") is None:
                raise ConfigError(f"{name}=redis needs redis-py: pip install 'portico[redis]'")

    def _check_keepalive(self) -> None:
        """A peer that pings on time must never be closed as idle."""
        if self.ping_interval >= self.pong_timeout:
            raise ConfigError("ping_interval must be shorter than pong_timeout")
        if self.heartbeat_interval >= self.session_idle_timeout:
            # Clients ping every heartbeat_interval (ready.heartbeat_ms tells them).
            raise ConfigError("heartbeat_interval must be shorter than session_idle_timeout")

    def redacted(self) -> dict[str, Any]:
        """The settings as plain data with credentials masked, for `config show`."""
        data: dict[str, Any] = msgspec.to_builtins(self)
        data["api_keys"] = {
            f"<token {n}>": principal for n, principal in enumerate(self.api_keys.values(), 1)
        }
        data["database_url"] = mask_url_password(self.database_url)
        data["redis_url"] = mask_url_password(self.redis_url)
        if self.s3_secret_access_key is not None:
            data["s3_secret_access_key"] = "***"
        return data


def mask_url_password(url: str) -> str:
    """`url` with its password (in the user info or a `password` parameter) masked."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:***@{hostport}"
    query = parse_qsl(parts.query, keep_blank_values=True)
    masked = [(key, "***" if key == "password" else value) for key, value in query]
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(masked, safe="*")))


def check_openai_agent(name: str, agent: AgentSettings, env: Mapping[str, str]) -> None:
    """Refuse an `openai` agent the runtime could not run, naming the setting."""
    where = f"agent {name!r}"
    if not agent.base_url or not agent.model:
        hint = " (PORTICO_OPENAI_BASE_URL, PORTICO_OPENAI_MODEL)" if name == DEFAULT_AGENT else ""
        raise ConfigError(f"{where}: the openai runtime needs base_url and model{hint}")
    if not agent.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: base_url must start with http:// or https://")
    if agent.api_key_env and not env.get(agent.api_key_env):
        raise ConfigError(f"{where}: api_key_env names {agent.api_key_env}, which is not set")
    names = [tool.name for tool in agent.tools]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: tool names must be unique")
    for tool in agent.tools:
        _check_tool(f"{where} tool {tool.name!r}", tool, env)
    for server_name, server in agent.mcp_servers.items():
        _check_mcp_server(f"{where} MCP server {server_name!r}", server, env)


def _check_mcp_server(where: str, server: McpServerSettings, env: Mapping[str, str]) -> None:
    if (server.command is None) == (server.url is None):
        raise ConfigError(f"{where}: give exactly one of command (stdio) and url (HTTP)")
    if server.url is not None and not server.url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: url must start with http:// or https://")
    for variable in (*server.env_from.values(), *server.headers_env.values()):
        if not env.get(variable):
            raise ConfigError(f"{where}: names the variable {variable}, which is not set")
    if importlib.util.find_spec("mcp") is None:
        raise ConfigError(f"{where}: MCP servers need the mcp package: pip install 'portico[mcp]'")


def check_grpc_agent(name: str, agent: AgentSettings, env: Mapping[str, str]) -> None:
    """Refuse a `grpc` agent the runtime could not dial, naming the setting."""
    where = f"agent {name!r}"
    host, _, port = (agent.grpc_target or "").rpartition(":")
    if not host or not port.isdigit():
        hint = " (PORTICO_GRPC_TARGET)" if name == DEFAULT_AGENT else ""
        raise ConfigError(f"{where}: the grpc runtime needs grpc_target as host:port{hint}")
    if agent.grpc_ca_file and not Path(agent.grpc_ca_file).is_file():
        raise ConfigError(f"{where}: grpc_ca_file {agent.grpc_ca_file} is not a readable file")
    if agent.grpc_token_env and not env.get(agent.grpc_token_env):
        raise ConfigError(f"{where}: grpc_token_env names {agent.grpc_token_env}, which is not set")
    if importlib.util.find_spec("grpc") is None:
        raise ConfigError(f"{where}: the grpc runtime needs grpcio: pip install 'portico[grpc]'")


def _check_tool(where: str, tool: ToolSettings, env: Mapping[str, str]) -> None:
    if isinstance(tool, BuiltinToolSettings):
        return
    try:
        jsonschema.validators.validator_for(tool.parameters).check_schema(tool.parameters)
    except jsonschema.SchemaError as exc:
        raise ConfigError(f"{where}: parameters is not a valid JSON Schema: {exc.message}") from exc
    if not isinstance(tool, HttpToolSettings):
        return
    if not tool.url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: url must start with http:// or https://")
    for variable in tool.headers_env.values():
        if not env.get(variable):
            raise ConfigError(f"{where}: headers_env names {variable}, which is not set")


def parse_api_keys(text: str) -> dict[str, str]:
    """Parse ``token=principal,token=principal``."""
    keys: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        token, sep, principal = item.partition("=")
        if not sep or not token or not principal:
            raise ConfigError("expected token=principal[,token=principal...]")
        keys[token] = principal
    return keys


def alg_allowed(alg: str) -> bool:
    """Asymmetric JWS algorithms only: `none` forges anything, HS* needs a shared secret."""
    return alg in ASYMMETRIC_ALGORITHMS


ASYMMETRIC_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)


def _split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for field in msgspec.structs.fields(Settings):
        variable = ENV_PREFIX + field.name.upper()
        raw = env.get(variable)
        if raw is None or field.name in FILE_ONLY_SETTINGS:
            continue
        if field.name == "api_keys":
            values[field.name] = _parsed_api_keys(raw, variable)
        elif field.name in ("origins", "jwt_algorithms"):
            values[field.name] = _split_list(raw)
        else:
            values[field.name] = raw
    return values


def _parsed_api_keys(text: str, where: str) -> dict[str, str]:
    try:
        return parse_api_keys(text)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}") from exc


def _from_file(path: str) -> dict[str, Any]:
    loaded = read_yaml(path, "config file")
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings")
    if isinstance(loaded.get("api_keys"), str):
        loaded["api_keys"] = _parsed_api_keys(
            loaded["api_keys"], f"config file {path}, key api_keys"
        )
    return loaded


def load_settings(
    *,
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge defaults < file < environment < flags into one validated tree; an invalid
    value is refused naming its source (file and key, variable or flag)."""
    env = os.environ if env is None else env
    config_file = config_file or env.get(ENV_PREFIX + "CONFIG")
    merged: dict[str, Any] = _from_file(config_file) if config_file else {}
    origins = dict.fromkeys(merged, Origin("file", config_file or ""))
    from_env = _from_env(env)
    origins.update({name: Origin("env", ENV_PREFIX + name.upper()) for name in from_env})
    set_flags = {key: value for key, value in (flags or {}).items() if value is not None}
    origins.update({name: Origin("flag", "--" + name.replace("_", "-")) for name in set_flags})
    merged.update(from_env)
    merged.update(set_flags)
    try:
        # strict=False turns environment strings into the numbers and booleans declared.
        return msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        message = explain(exc, merged, Settings, origins, secret=SECRET_SETTINGS)
        raise ConfigError(message) from exc


def environment_warnings(env: Mapping[str, str]) -> list[str]:
    """A line per `PORTICO_*` variable that no setting reads (a typo, most often)."""
    settable = [
        field.name
        for field in msgspec.structs.fields(Settings)
        if field.name not in FILE_ONLY_SETTINGS
    ]
    known = {*(ENV_PREFIX + name.upper() for name in settable), *OTHER_VARIABLES}
    warnings = []
    for variable in sorted(name for name in env if name.startswith(ENV_PREFIX)):
        setting = variable.removeprefix(ENV_PREFIX).lower()
        if variable in known:
            continue
        if setting in FILE_ONLY_SETTINGS:
            warnings.append(f"{variable} is ignored: `{setting}` is read from the config file only")
            continue
        warning = f"{variable} is not a Portico setting and is ignored"
        match = nearest(setting, settable)
        warnings.append(
            warning + (f" (did you mean {ENV_PREFIX}{match.upper()}?)" if match else "")
        )
    return warnings
