"""One streamed chat-completions request: retries, deadlines, and failures as the spec's codes.

`Provider.stream(body)` sends the request and waits for the first server-sent
event, retrying what the Omnia error table says to retry (429, 502, 503, 504,
connection failures) while nothing has been streamed yet; then it hands over an
`EventStream` of decoded chunks. Every wait is bounded by a deadline applied to
that one await, never across a `yield`: a timeout must not fire while the
engine, not the provider, holds the turn's task.

Failure messages name the model and the provider type, never the provider's
response, which can carry credentials. Each failure also carries, for the server's
log alone, the endpoint (without credentials or query) and its cause (connection
refused, DNS, TLS, the HTTP status: `runtime.causes`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec

from portico.config import AgentSettings
from portico.runtime.causes import connection_cause, http_status_cause, safe_endpoint
from portico.runtime.sse import SseDecoder, SseError

log = logging.getLogger("portico.provider")

RATE_LIMITED = "PROVIDER_RATE_LIMITED"
UNAVAILABLE = "PROVIDER_UNAVAILABLE"
STALLED = "PROVIDER_STALLED"
TIMEOUT = "PROVIDER_TIMEOUT"
AUTH_FAILED = "PROVIDER_AUTH_FAILED"
RETRIED_STATUSES = frozenset({502, 503, 504})
DONE = "[DONE]"

Chunk = dict[str, Any]
_decode_chunk = msgspec.json.Decoder(dict[str, Any])


class ProviderError(Exception):
    """A request failed; `code` is the Omnia error code the turn ends with and `message`
    what the client reads. `endpoint` and `cause` are for the server's log only."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retryable: bool = False,
        retry_after: float | None = None,
        endpoint: str = "",
        cause: str = "",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.retry_after = retry_after
        self.endpoint = endpoint
        self.cause = cause

    def log_fields(self) -> str:
        """`code=... endpoint=... cause="..."` for a log line."""
        return f'code={self.code} endpoint={self.endpoint} cause="{self.cause}"'


def key_headers(settings: AgentSettings, api_key: str | None) -> dict[str, str]:
    """The header carrying the key: `Authorization: Bearer <key>`, or the key as is in
    any other `api_key_header`; none without a key."""
    if not api_key:
        return {}
    bearer = settings.api_key_header.lower() == "authorization"
    return {settings.api_key_header: f"Bearer {api_key}" if bearer else api_key}


class Provider:
    def __init__(
        self,
        settings: AgentSettings,
        *,
        api_key: str | None,
        http: Callable[[], aiohttp.ClientSession],
    ) -> None:
        assert settings.base_url, "check_startable() requires it"
        self.settings = settings
        self._http = http
        self._url = settings.base_url.rstrip("/") + "/chat/completions"
        self._headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        self._headers |= key_headers(settings, api_key)
        self.label = f"model {settings.model} ({settings.provider})"
        self.endpoint = safe_endpoint(self._url)

    def error(
        self,
        code: str,
        what: str,
        *,
        retryable: bool = False,
        retry_after: float | None = None,
        cause: str | None = None,
    ) -> ProviderError:
        """A failure the client reads as `what`; the log reads `cause` (default: `what`)."""
        return ProviderError(
            code,
            f"{self.label}: {what}",
            retryable=retryable,
            retry_after=retry_after,
            endpoint=self.endpoint,
            cause=what if cause is None else cause,
        )

    @asynccontextmanager
    async def stream(self, body: dict[str, Any]) -> AsyncIterator[EventStream]:
        """The response's events, once the first one has arrived (after any retries)."""
        response, events = await self._open(msgspec.json.encode(body))
        try:
            yield events
        finally:
            response.release()  # closes the connection when the stream was left unfinished

    async def _open(self, payload: bytes) -> tuple[aiohttp.ClientResponse, EventStream]:
        attempt = 1
        while True:
            try:
                return await self._attempt(payload)
            except ProviderError as error:
                if not error.retryable or attempt > self.settings.retries:
                    if error.retryable and attempt > 1:
                        message = f"{error} after {attempt} attempts"
                        raise ProviderError(
                            error.code, message, endpoint=error.endpoint, cause=error.cause
                        ) from error
                    raise
                settings = self.settings
                delay = retry_delay(
                    attempt, error.retry_after, settings.retry_backoff, settings.retry_backoff_max
                )
                log.info(
                    "provider retry %s %s attempt=%d delay_ms=%.0f",
                    self.label,
                    error.log_fields(),
                    attempt,
                    delay * 1000,
                )
                await asyncio.sleep(delay)
                attempt += 1

    async def _attempt(self, payload: bytes) -> tuple[aiohttp.ClientResponse, EventStream]:
        first, request_end = self._deadlines()
        response = await self._post(payload, first)
        try:
            self._check(response)
            events = EventStream(self, response, request_end=request_end)
            await events.start(first)
        except BaseException:
            response.release()
            raise
        return response, events

    def _deadlines(self) -> tuple[_Deadline, _Deadline]:
        """The first event's deadline and the whole request's, from now."""
        now = asyncio.get_running_loop().time()
        first_token, whole = self.settings.first_token_timeout, self.settings.request_timeout
        request_end = _Deadline(
            now + whole, self.error(TIMEOUT, f"did not finish within {whole:g} s")
        )
        first = _Deadline(
            now + first_token, self.error(TIMEOUT, f"sent nothing within {first_token:g} s")
        )
        return min(first, request_end, key=lambda deadline: deadline.at), request_end

    async def _post(self, payload: bytes, deadline: _Deadline) -> aiohttp.ClientResponse:
        try:
            async with asyncio.timeout_at(deadline.at):
                return await self._http().post(self._url, data=payload, headers=self._headers)
        except TimeoutError as exc:
            raise deadline.expired() from exc
        except (aiohttp.ClientError, OSError) as exc:
            cause = connection_cause(exc)
            raise self.error(
                UNAVAILABLE, "could not be reached", retryable=True, cause=cause
            ) from exc

    def _check(self, response: aiohttp.ClientResponse) -> None:
        status = response.status
        if status == 200:
            if "json" in response.content_type:
                raise self.error(UNAVAILABLE, "answered with JSON, not an event stream")
            return
        http = http_status_cause(status, response.reason)  # the log's cause
        if status in (401, 403):
            what = f"the credentials were refused (HTTP {status})"
            raise self.error(AUTH_FAILED, what, cause=http)
        if status == 429:
            retry_after = _seconds(response.headers.get("Retry-After"))
            raise self.error(
                RATE_LIMITED,
                "rate limited (HTTP 429)",
                retryable=True,
                retry_after=retry_after,
                cause=http,
            )
        if status in RETRIED_STATUSES:
            what = f"unavailable (HTTP {status})"
            raise self.error(UNAVAILABLE, what, retryable=True, cause=http)
        if status >= 500:
            # Not retried: a 500 usually means this request itself failed.
            raise self.error(UNAVAILABLE, f"failed (HTTP {status})", cause=http)
        # Not an Omnia code: the client sees INTERNAL_ERROR, the log says why.
        what = f"refused the request (HTTP {status})"
        raise self.error("PROVIDER_REQUEST_REFUSED", what, cause=http)


class _Deadline:
    """When a wait ends, and the failure it ends with."""

    def __init__(self, at: float, error: ProviderError) -> None:
        self.at = at
        self._error = error

    def expired(self) -> ProviderError:
        return self._error


class EventStream:
    """The chunks of one response, each read within the idle and the request deadline."""

    def __init__(
        self, provider: Provider, response: aiohttp.ClientResponse, *, request_end: _Deadline
    ) -> None:
        self._provider = provider
        self._response = response
        self._decoder = SseDecoder(max_event_bytes=provider.settings.max_stream_event_bytes)
        self._idle = provider.settings.stream_idle_timeout
        self._request_end = request_end
        self._pending: deque[str] = deque()
        self._eof = False
        self._started = False
        self.finished = False  # a choice reported its finish_reason

    async def start(self, first: _Deadline) -> None:
        """Wait for the first event; a stream that ends before it is a connection failure."""
        data = await self._next(first)
        if data is None:
            raise self._provider.error(UNAVAILABLE, "closed the stream at once", retryable=True)
        self._pending.appendleft(data)
        self._started = True

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Chunk:
        data = await self._next(self._idle_deadline())
        if data is None and not self.finished:
            raise self._provider.error(STALLED, "the stream ended before the reply did")
        if data is None or data == DONE:
            raise StopAsyncIteration
        try:
            chunk = _decode_chunk.decode(data)
        except msgspec.DecodeError as exc:
            raise self._provider.error(UNAVAILABLE, "sent a malformed event") from exc
        if "error" in chunk:
            raise self._provider.error(UNAVAILABLE, "reported an error in the stream")
        if any(choice.get("finish_reason") for choice in chunk.get("choices") or ()):
            self.finished = True
        return chunk

    def _idle_deadline(self) -> _Deadline:
        if self._pending:
            return self._request_end  # no read will happen
        idle_end = asyncio.get_running_loop().time() + self._idle
        if idle_end >= self._request_end.at:
            return self._request_end
        stalled = f"the stream stalled (nothing for {self._idle:g} s)"
        return _Deadline(idle_end, self._provider.error(STALLED, stalled))

    async def _next(self, deadline: _Deadline) -> str | None:
        while not self._pending:
            if self._eof:
                return None
            data = await self._read(deadline)
            try:
                if data:
                    self._pending.extend(self._decoder.feed(data))
                else:
                    self._eof = True
                    self._pending.extend(self._decoder.close())
            except SseError as exc:
                raise self._provider.error(UNAVAILABLE, str(exc)) from exc
        return self._pending.popleft()

    async def _read(self, deadline: _Deadline) -> bytes:
        try:
            async with asyncio.timeout_at(deadline.at):
                return await self._response.content.readany()
        except TimeoutError as exc:
            raise deadline.expired() from exc
        except (aiohttp.ClientError, OSError) as exc:
            cause = connection_cause(exc)
            if self._started:
                raise self._provider.error(STALLED, "the stream broke off", cause=cause) from exc
            raise self._provider.error(
                UNAVAILABLE, "dropped the connection", retryable=True, cause=cause
            ) from exc


def retry_delay(
    attempt: int,
    retry_after: float | None,
    backoff: float,
    maximum: float,
    jitter: Callable[[], float] = lambda: random.uniform(0.5, 1.0),
) -> float:
    """Seconds before retry `attempt` (1, 2, ...): doubling from `backoff`, jittered so that
    turns refused together do not return together, at least a `Retry-After`, at most
    `maximum` (a turn does not wait minutes on a provider's say-so)."""
    growth: float = 2.0 ** (attempt - 1)
    return min(max(backoff * growth * jitter(), retry_after or 0.0), maximum)


def _seconds(value: str | None) -> float | None:
    """A `Retry-After` in seconds; the HTTP-date form is ignored (the backoff applies)."""
    try:
        return max(float(value), 0.0) if value else None
    except ValueError:
        return None
