"""The ports a running server is made of, built once from the settings."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Protocol

from aiohttp import web

from portico.auth.apikey import ApiKeyAuth
from portico.auth.base import (
    Authenticator,
    Identity,
    bearer_token,
    offered_subprotocols,
    subprotocol_token,
)
from portico.auth.none import NoAuth
from portico.bus.updates import InProcessUpdates
from portico.config import DEFAULT_AGENT, AgentSettings, Settings
from portico.core.conversations import Conversations
from portico.core.engine import Engine
from portico.core.lifecycle import Lifecycle, Phase
from portico.core.reservations import SessionReservations
from portico.core.tools import ClientToolBroker
from portico.core.turns import EndRetry
from portico.domain.memory import MemoryLimits
from portico.domain.model import new_id
from portico.errors import IdentityProviderUnavailable, Unauthenticated
from portico.media.base import MediaStore
from portico.media.local import LocalMediaStore
from portico.media.service import MediaService
from portico.replication.build import build_link
from portico.runtime.base import Runtime
from portico.runtime.demo import DemoRuntime
from portico.runtime.echo import EchoRuntime
from portico.runtime.openai import OpenAIRuntime
from portico.runtime.python import PythonRuntime
from portico.runtime.scripted import ScriptedRuntime
from portico.server.backends import build_shared_state
from portico.server.capacity import (
    ConnectionSlots,
    PrincipalSlots,
    Strangers,
    principal_cap,
    stranger_budget,
)
from portico.server.deadlines import DeadlineWheel
from portico.server.duplex import build_calls
from portico.server.metrics import Metrics
from portico.store.base import Store
from portico.store.memory import MemoryStore
from portico.store.sqlite import SqliteStore

ARCHIVE_FILE = "archive.sqlite3"
MEDIA_DIR = "media"


class LiveConnection(Protocol):
    """An open WebSocket of any protocol, as shutdown sees it."""

    async def going_away(self) -> None:
        """Send what is queued, then close with 1001."""

    def busy(self) -> bool:
        """A turn (or a request) runs on it: a drain closes it once that ended."""


class Services:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = build_store(settings)
        self.auth = build_auth(settings)
        self.reservations = SessionReservations()
        self.media = build_media(settings, self.store, self.reservations)
        agents = {name: settings.agent(name) for name in settings.agent_names()}
        resolved = {name: agent for name, agent in agents.items() if agent is not None}
        self.metrics = Metrics()
        self.runtimes = {
            name: build_runtime(agent, settings, name=name) for name, agent in resolved.items()
        }
        self.tools = ClientToolBroker(
            store=self.store,
            ack_timeout=settings.tool_ack_timeout,
            answer_timeout=settings.client_tool_timeout,
            clock=time.time,
            telemetry=self.metrics,
        )
        replica_id = settings.replica_id or new_id("rep")
        # The bus and session-state ports (docs/replicas.md), as the settings choose.
        self.shared = build_shared_state(settings)
        self.session_states = self.shared.session_states
        # With bus=redis: turn output, control and the turn lock shared by the replicas.
        self.link = build_link(settings, self.store, replica_id, self.shared.bus)
        if self.link is not None:
            self.link.bind_tools(self.tools)
            self.tools.relay = self.link
        self.engine = Engine(
            store=self.store,
            tools=self.tools,
            telemetry=self.metrics,
            media=self.media,
            runtimes=self.runtimes,
            agents=resolved,
            context_ttl=settings.context_ttl,
            replica_id=replica_id,
            replica_lease=settings.replica_lease,
            reservations=self.reservations,
            memory_limits=MemoryLimits(
                max_entries=settings.memory_max_entries,
                max_entry_bytes=settings.memory_max_entry_bytes,
                search_limit=settings.memory_search_limit,
            ),
            link=self.link,
            end_retry=EndRetry(
                interval=settings.turn_end_retry_interval,
                window=settings.turn_end_retry_window,
            ),
        )
        self.calls = build_calls(
            settings,
            resolved,
            self.store,
            self.engine,
            self.metrics,
            directory=self.shared.call_directory,
            replica_id=replica_id,
            handover=self.link,
        )
        if self.link is not None:
            self.link.bind_calls(self.calls)
        self.updates = InProcessUpdates()
        if self.link is None:
            self.store.set_update_listener(self.updates.publish)
        else:  # the other replicas' updates join this one's, in offset order
            self.link.bind_updates(self.updates.publish)
            self.store.set_update_listener(self.link.local_update)
        self.conversations = Conversations(self.engine, self.tools, default_agent=DEFAULT_AGENT)
        # Starting, admitting, draining (a stop signal: no new upgrades or turns, running
        # turns may finish) or stopped: core/lifecycle.py, driven by server/drain.py.
        self.lifecycle: Lifecycle[LiveConnection] = Lifecycle(drain_timeout=settings.drain_timeout)
        # Added and removed by ServerSocket.serve around each connection's life. A dict
        # used as a set: a WeakSet's weakref and callback cost ~480 bytes per idle
        # connection, a set's table ~50 at 10,000, a compact dict's ~30.
        self.connections: dict[LiveConnection, None] = {}
        self.slots = ConnectionSlots(settings.max_connections)
        # The sockets' far deadlines (keepalive pings), on one loop timer per second.
        self.deadlines = DeadlineWheel()
        self.strangers = Strangers(stranger_budget(settings))
        self.principals = PrincipalSlots(principal_cap(settings))
        self._loop: asyncio.AbstractEventLoop | None = None  # `loop`, once asked

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the server runs on (an app runs on one loop for its life), asked of
        asyncio once: on Python 3.11 `asyncio.get_running_loop()` makes a getpid()
        syscall per call (its fork check), and the sockets ask several times per frame
        (a voice call's: docs/performance.md, "Voice calls")."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    @property
    def ready(self) -> bool:
        """Started and not draining (backends aside: server/readiness.py)."""
        return self.lifecycle.admitting

    @property
    def draining(self) -> bool:
        return self.lifecycle.phase in (Phase.DRAINING, Phase.STOPPED)

    async def identity_of(self, request: web.Request) -> Identity:
        """The caller's identity from `Authorization: Bearer` or, from a browser's
        WebSocket upgrade, a `portico.bearer.<token>` subprotocol entry; or HTTP 401."""
        credential = bearer_token(request.headers.get("Authorization")) or subprotocol_token(
            offered_subprotocols(request.headers.get("Sec-WebSocket-Protocol"))
        )
        try:
            return await self.auth.identify(credential)
        except IdentityProviderUnavailable as exc:
            raise web.HTTPServiceUnavailable(
                text=exc.message, headers={"Retry-After": "1"}
            ) from exc
        except Unauthenticated as exc:
            raise web.HTTPUnauthorized(
                text=exc.message, headers={"WWW-Authenticate": 'Bearer realm="portico"'}
            ) from exc


SERVICES = web.AppKey("services", Services)


def build_store(settings: Settings) -> Store:
    if settings.store == "memory":
        return MemoryStore()
    if settings.store == "postgres":
        # Imported here: asyncpg is an optional extra (`portico[postgres]`).
        from portico.store.postgres import PostgresStore

        return PostgresStore(settings.database_url, pool_size=settings.database_pool_size)
    return SqliteStore(Path(settings.data_dir) / ARCHIVE_FILE, writer=settings.sqlite_writer)


def build_media(
    settings: Settings, archive: Store, reservations: SessionReservations | None = None
) -> MediaService:
    store: MediaStore | None = None
    if settings.media == "s3":
        # Imported here: aiobotocore is an optional extra (`portico[s3]`).
        from portico.media.s3 import S3MediaStore

        store = S3MediaStore(
            bucket=settings.s3_bucket,
            endpoint_url=settings.s3_endpoint_url,
            public_url=settings.s3_public_url,
            region=settings.s3_region,
            access_key_id=settings.s3_access_key_id,
            secret_access_key=settings.s3_secret_access_key,
            timeout=settings.s3_timeout,
            holder=settings.replica_id or None,
        )
    elif settings.media == "local":
        store = LocalMediaStore(Path(settings.data_dir) / MEDIA_DIR)
    return MediaService(
        store,
        archive=archive,
        max_upload_bytes=settings.max_upload_bytes,
        max_inline_media_bytes=settings.max_inline_media_bytes,
        media_ttl=settings.media_ttl,
        upload_url_ttl=settings.upload_url_ttl,
        public_url=settings.public_url,
        fetch_timeout=settings.media_fetch_timeout,
        fetch_private=settings.media_fetch_private,
        max_pending_uploads=settings.max_pending_uploads_per_principal,
        reservations=reservations,
        download_url_ttl=settings.s3_download_url_ttl,
    )


def build_auth(settings: Settings) -> Authenticator:
    if settings.auth == "apikey":
        return ApiKeyAuth(settings.api_keys)
    if settings.auth == "jwt":
        return build_jwt_auth(settings)
    return NoAuth()


def build_jwt_auth(settings: Settings) -> Authenticator:
    # Imported here: PyJWT is an optional extra (`portico[jwt]`).
    from portico.auth.jwt import JwtAuth, KeySet

    keys = KeySet(
        issuer=settings.jwt_issuer,
        jwks_url=settings.jwt_jwks_url,
        refresh_interval=settings.jwt_jwks_refresh_interval,
        timeout=settings.jwt_jwks_timeout,
    )
    return JwtAuth(
        keys,
        issuer=settings.jwt_issuer,
        audience=settings.jwt_audience,
        algorithms=settings.jwt_algorithms,
        leeway=settings.jwt_leeway,
        principal_claim=settings.jwt_principal_claim,
        session_claim=settings.jwt_session_claim,
        cache_entries=settings.jwt_cache_entries,
    )


def build_runtime(
    agent: AgentSettings, settings: Settings, *, name: str = DEFAULT_AGENT
) -> Runtime:
    if agent.runtime == "scripted":
        assert agent.script is not None, "check_startable() requires a script"
        return ScriptedRuntime.from_file(agent.script)
    if agent.runtime == "python":
        assert agent.plugin is not None, "check_startable() requires a plugin"
        return PythonRuntime.from_plugin(agent.plugin)
    if agent.runtime == "echo":
        return EchoRuntime()
    if agent.runtime in ("openai", "openai-realtime"):
        # An openai-realtime agent's text turns go to chat completions at the same
        # base URL (docs/voice-runtimes.md); its calls to the Realtime API.
        # The key and the tools' header values are read from the environment here, so
        # they never sit in the settings (which `config show` prints).
        return OpenAIRuntime(agent, env=os.environ)
    if agent.runtime == "grpc":
        # Imported here: grpcio is an optional extra (`portico[grpc]`).
        from portico.runtime.grpc.runtime import build

        return build(name, agent)
    return DemoRuntime(word_delay=settings.demo_word_delay)
