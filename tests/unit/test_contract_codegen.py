"""The checked-in runtime-contract modules are exactly what runtime.proto generates,
and the proto keeps Omnia's package, service and field numbers."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from portico.contract import runtime_pb2

SRC = Path(__file__).resolve().parents[2] / "src"
CONTRACT = SRC / "portico" / "contract"
GENERATED = ("runtime_pb2.py", "runtime_pb2.pyi", "runtime_pb2_grpc.py", "runtime_pb2_grpc.pyi")
# The generator stamps its own version into the output (the checked-in files carry the
# lowest grpcio-tools pyproject.toml allows); a newer patch release of the tools must not
# make the files "stale", so the stamps are compared as placeholders.
STAMPS = (
    re.compile(r"^(GRPC_GENERATED_VERSION = )'[^']*'", re.M),
    re.compile(r"^(# Protobuf Python Version: ).*$", re.M),
    re.compile(r"^(_runtime_version\.ValidateProtobufRuntimeVersion\(\n)(?:.*\n){5}", re.M),
)


def unstamped(text: str) -> str:
    for stamp in STAMPS:
        text = stamp.sub(r"\1<version>", text)
    return text


def test_checked_in_modules_match_the_proto(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "portico" / "contract").mkdir(parents=True)
    shutil.copytree(CONTRACT, tmp_path / "in" / "portico" / "contract")
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{tmp_path / 'in'}",
            f"--python_out={out}",
            f"--mypy_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_grpc_out={out}",
            str(tmp_path / "in" / "portico" / "contract" / "runtime.proto"),
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=60,
    )
    for name in GENERATED:
        generated = (out / "portico" / "contract" / name).read_text()
        checked_in = (CONTRACT / name).read_text()
        assert unstamped(generated) == unstamped(checked_in), f"{name} is stale: regenerate it"


def test_wire_names_are_omnias() -> None:
    service = runtime_pb2.DESCRIPTOR.services_by_name["RuntimeService"]
    assert service.full_name == "omnia.runtime.v1.RuntimeService"
    assert sorted(m.name for m in service.methods) == [
        "Converse",
        "HasConversation",
        "Health",
        "Invoke",
    ]
    server = runtime_pb2.ServerMessage.DESCRIPTOR
    assert {f.name: f.number for f in server.fields} == {
        "chunk": 1,
        "tool_call": 2,
        "tool_result": 3,
        "done": 4,
        "error": 5,
        "media_chunk": 6,
        "interruption": 7,
        "runtime_hello": 8,
    }
    client = runtime_pb2.ClientMessage.DESCRIPTOR
    assert {f.name: f.number for f in client.fields} == {
        "session_id": 1,
        "content": 2,
        "metadata": 3,
        "parts": 4,
        "client_tool_result": 5,
        "consent_grants": 6,
        "duplex_start": 7,
        "audio_input": 8,
    }
