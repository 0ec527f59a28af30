"""What `portico serve` checks before it opens the archive: the address can be listened
on and the data dir can be written. Each refusal is a `StartupError`, one line naming
the address or the folder and the flag that changes it (the CLI exits 2).

The address is checked first, by binding it once and letting go, so that a second
server started by mistake refuses before it touches the archive (or, with a stable
`replica_id`, interrupts the first one's turns). The real bind can still fail in
between; `listen_failure` explains that failure the same way.
"""

from __future__ import annotations

import errno
import socket
import tempfile
from pathlib import Path

from portico.config import Settings
from portico.errors import StartupError

PRIVILEGED_PORTS = 1024


def check_startup(settings: Settings) -> None:
    check_address(settings.host, settings.port)
    if settings.store == "sqlite" or settings.media == "local":
        check_data_dir(Path(settings.data_dir))


def check_address(host: str, port: int) -> None:
    """Refuse an address this process cannot listen on, as the server's bind would."""
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        raise listen_failure(exc, host, port) from exc
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            # The options asyncio's create_server sets, so the probe binds exactly when
            # the server would (a port in TIME_WAIT is free, one with a listener is not).
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise listen_failure(exc, host, port) from exc


def listen_failure(exc: OSError, host: str, port: int) -> StartupError:
    """The one line an operator reads when `host:port` cannot be listened on."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    where = f"cannot listen on {address}"
    if isinstance(exc, socket.gaierror):
        return StartupError(f"{where}: the host name {host!r} does not resolve; check --host")
    if exc.errno == errno.EADDRINUSE:
        return StartupError(
            f"{where}: the address is already in use (another server has the port); "
            "stop it or pick another port with --port"
        )
    if exc.errno == errno.EACCES:
        if 0 < port < PRIVILEGED_PORTS:
            return StartupError(
                f"{where}: permission denied (ports below {PRIVILEGED_PORTS} need privileges); "
                "pick another port with --port"
            )
        return StartupError(f"{where}: permission denied; check --host and --port")
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(f"{where}: {host} is not an address of this machine; check --host")
    return StartupError(f"{where}: {_reason(exc)}; check --host and --port")


def check_data_dir(path: Path) -> None:
    """Create the data dir if needed and make sure a file can be written in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = "it is not a directory" if isinstance(exc, FileExistsError) else _reason(exc)
        raise StartupError(
            f"cannot use the data dir {path}: {reason}; pick another with --data-dir"
        ) from exc


def _reason(exc: OSError) -> str:
    return (exc.strerror or str(exc)).lower()
