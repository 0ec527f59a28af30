"""A real OpenID provider for the tests: `oidc-provider` (npm, OpenID certified) under node.

`tests/support/oidc/provider.mjs` configures it; `npm ci --prefix tests/support/oidc`
installs it (`.ci/run` does). Without node or the package the tests that need it are
skipped locally and fail in CI, like the browser tests.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import IO

import pytest

from support.jwks import AUDIENCE

HERE = Path(__file__).resolve().parent / "oidc"
SCRIPT = HERE / "provider.mjs"
START_TIMEOUT = 20.0
CLIENT = ("portico-test", "portico-test-secret")


def require_provider() -> None:
    missing = []
    if shutil.which("node") is None:
        missing.append("node")
    if not (HERE / "node_modules" / "oidc-provider").is_dir():
        missing.append("oidc-provider (npm ci --prefix tests/support/oidc)")
    if missing:
        message = "the OpenID provider tests need " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs them (.ci/run): never skip there
        pytest.skip(message)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class OidcProvider:
    """One provider process at a fixed port; `restart` gives it a new key set."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.log_path = log_dir / "oidc-provider.log"
        self.process: subprocess.Popen[str] | None = None
        self.kid = ""

    @property
    def issuer(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, alg: str = "RS256") -> OidcProvider:
        env = {**os.environ, "PORT": str(self.port), "ALG": alg, "AUDIENCE": AUDIENCE}
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(
                ["node", str(SCRIPT)],
                cwd=HERE,
                env=env,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self.kid = self._ready_line(self.process.stdout)
        return self

    def _ready_line(self, stdout: IO[str] | None) -> str:
        assert stdout is not None
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            line = stdout.readline()
            if line.startswith("ready "):
                return line.split()[1]
            if not line and self.process is not None and self.process.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"oidc-provider did not start; see {self.log_path}")

    def restart(self, alg: str) -> None:
        """Key rotation: the same issuer with a new key set (new `kid`)."""
        self.stop()
        self.start(alg)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def token(self) -> str:
        """A JWT access token by the client_credentials grant."""
        body = urllib.parse.urlencode(
            {"grant_type": "client_credentials", "scope": "chat", "resource": "urn:portico"}
        ).encode()
        basic = base64.b64encode(":".join(CLIENT).encode()).decode()
        request = urllib.request.Request(
            self.issuer + "/token", data=body, headers={"Authorization": f"Basic {basic}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            token: str = json.load(response)["access_token"]
        return token
