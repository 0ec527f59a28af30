"""Why a runtime's peer could not be reached, in words an operator can act on.

A runtime tells its client only that the provider is unavailable (the endpoint and
the cause are the operator's business); the server's log line says which endpoint
and why. Any runtime that talks to a peer over the network calls `connection_cause`
with the exception it caught: it reads the chain of causes (an HTTP library's own
error wraps the socket's) and names the first it recognises. The words never
include the exception's text, which may carry a URL with credentials.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

_CHAIN_LIMIT = 10  # causes followed; a cycle or a deep chain ends the walk


def connection_cause(exc: BaseException) -> str:
    """`connection refused`, `DNS lookup failed (...)`, `TLS handshake failed (...)`,
    `TLS certificate not trusted (...)`, `connection reset`, `timed out`, the operating
    system's reason, or the exception's type when nothing in the chain is known."""
    chain = list(_chain(exc))
    for link in chain:
        cause = _known(link)
        if cause is not None:
            return cause
    for link in chain:
        # The text of the error number, not the exception's (an HTTP library's may
        # hold the URL).
        if isinstance(link, OSError) and isinstance(link.errno, int) and link.errno > 0:
            return os.strerror(link.errno).lower()
    return type(exc).__name__


# Substrings of a peer library's error text that only describes the failure in words
# (gRPC's status details), and the cause a log line names.
_DESCRIBED_CAUSES = (
    ("connection refused", "connection refused"),
    ("dns", "name resolution failed"),
    ("resolve", "name resolution failed"),
    ("ssl", "TLS handshake failed"),
    ("tls", "TLS handshake failed"),
    ("handshake", "TLS handshake failed"),
    ("certificate", "TLS handshake failed"),
    ("reset", "connection reset"),
    ("socket closed", "connection closed"),
    ("goaway", "connection closed"),
    ("deadline", "timed out"),
)


def described_cause(details: str) -> str | None:
    """The cause named by an error text such as gRPC's status details (which carry no
    exception chain), or None; the text itself is never returned."""
    lowered = details.lower()
    for needle, cause in _DESCRIBED_CAUSES:
        if needle in lowered:
            return cause
    return None


def http_status_cause(status: int, reason: str | None = None) -> str:
    """`HTTP 503 Service Unavailable`: the status a peer answered with."""
    return f"HTTP {status} {reason}" if reason else f"HTTP {status}"


def safe_endpoint(url: str) -> str:
    """`url` without its user info, query and fragment: fit for a log line."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _known(exc: BaseException) -> str | None:
    # aiohttp's TLS errors subclass ssl.SSLError without its attributes: they are passed
    # over for the ssl module's own error they wrap.
    reason = getattr(exc, "reason", None)
    if isinstance(exc, ssl.SSLCertVerificationError) and reason:
        return f"TLS certificate not trusted ({exc.verify_message or reason})"
    if isinstance(exc, ssl.SSLError) and reason:
        return f"TLS handshake failed ({_words(str(reason))})"
    if isinstance(exc, socket.gaierror):
        return f"DNS lookup failed ({(exc.strerror or 'unknown').lower()})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it wraps: aiohttp's `os_error` and `certificate_error`, then
    `__cause__` or `__context__`."""
    seen: set[int] = set()
    pending = [exc]
    while pending and len(seen) < _CHAIN_LIMIT:
        link = pending.pop(0)
        if id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        for attribute in ("certificate_error", "os_error"):
            wrapped = getattr(link, attribute, None)
            if isinstance(wrapped, BaseException):
                pending.append(wrapped)
        if link.__cause__ is not None:
            pending.append(link.__cause__)
        elif link.__context__ is not None:
            pending.append(link.__context__)


def _words(reason: str) -> str:
    """OpenSSL's `WRONG_VERSION_NUMBER` as `wrong version number`."""
    return reason.replace("_", " ").lower()
