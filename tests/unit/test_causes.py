"""`runtime.causes`: the words a log line gives for why a peer could not be reached."""

from __future__ import annotations

import errno
import socket
import ssl

import aiohttp
import pytest

from portico.runtime.causes import connection_cause, http_status_cause, safe_endpoint


def wrapped(inner: BaseException) -> Exception:
    """`inner` as an HTTP library raises it: inside its own error, as the cause."""
    outer = RuntimeError("Cannot connect to host secret-host:443 with https://u:p@h/?key=k")
    outer.__cause__ = inner
    return outer


def certificate_error() -> ssl.SSLCertVerificationError:
    error = ssl.SSLCertVerificationError(1, "certificate verify failed")
    error.reason = "CERTIFICATE_VERIFY_FAILED"
    error.verify_message = "self-signed certificate"
    return error


def handshake_error() -> ssl.SSLError:
    error = ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number")
    error.reason = "WRONG_VERSION_NUMBER"
    return error


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed"), "connection refused"),
        (
            socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
            "DNS lookup failed (name or service not known)",
        ),
        (handshake_error(), "TLS handshake failed (wrong version number)"),
        (certificate_error(), "TLS certificate not trusted (self-signed certificate)"),
        (ConnectionResetError(errno.ECONNRESET, "reset"), "connection reset"),
        (TimeoutError(), "timed out"),
        (OSError(errno.EHOSTUNREACH, "text with a url"), "no route to host"),
    ],
)
def test_the_cause_is_found_anywhere_in_the_chain(error: BaseException, cause: str) -> None:
    assert connection_cause(error) == cause
    assert connection_cause(wrapped(error)) == cause


def test_aiohttps_own_tls_error_is_passed_over_for_the_one_it_wraps() -> None:
    """aiohttp's TLS error is an ssl.SSLError without a reason; the socket's has one."""
    inner = handshake_error()
    key = aiohttp.client_reqrep.ConnectionKey("h", 443, True, True, None, None, None)
    outer = aiohttp.ClientConnectorSSLError(key, inner)
    outer.__cause__ = inner
    assert connection_cause(outer) == "TLS handshake failed (wrong version number)"


def test_an_unknown_failure_is_named_by_its_type_never_its_text() -> None:
    error = ValueError("https://user:sk-secret@provider.example/v1")
    assert connection_cause(error) == "ValueError"
    assert connection_cause(wrapped(ValueError("sk-secret"))) == "RuntimeError"


def test_a_cycle_in_the_chain_ends() -> None:
    first, second = RuntimeError("a"), RuntimeError("b")
    first.__context__, second.__context__ = second, first
    assert connection_cause(first) == "RuntimeError"


def test_http_status_cause() -> None:
    assert http_status_cause(503, "Service Unavailable") == "HTTP 503 Service Unavailable"
    assert http_status_cause(599) == "HTTP 599"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "https://api.example.com/v1/chat/completions",
            "https://api.example.com/v1/chat/completions",
        ),
        (
            "https://user:sk-secret@api.example.com:8443/v1?api-key=sk-secret#x",
            "https://api.example.com:8443/v1",
        ),
        ("http://[::1]:9000/v1", "http://[::1]:9000/v1"),
    ],
)
def test_safe_endpoint_drops_credentials_and_query(url: str, shown: str) -> None:
    assert safe_endpoint(url) == shown
