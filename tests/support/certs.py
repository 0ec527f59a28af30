"""Test certificates made with openssl: a private CA and a server certificate it signs."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a certificate it signs for 127.0.0.1: (ca, cert, key)."""
    ca_key, ca, key, csr, cert, ext = (
        folder / name for name in ("ca.key", "ca.pem", "key.pem", "req.csr", "cert.pem", "ext")
    )
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str | Path) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        ca_key,
        "-out",
        ca,
        "-days",
        "1",
        "-subj",
        "/CN=Portico test CA",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        key,
        "-out",
        csr,
        "-subj",
        "/CN=127.0.0.1",
    )
    openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-out",
        cert,
        "-days",
        "1",
        "-extfile",
        ext,
    )
    return ca, cert, key
