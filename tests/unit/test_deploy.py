"""The reference deployment (deploy/) is checked by what runs here without a container
engine: Kubernetes' own schemas (kubernetes-validate, strict), `docker-compose config`,
`haproxy -c`, and Portico's settings loader, which must accept every variable the
manifests set (a renamed setting would otherwise break deployments silently)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from portico.config import environment_warnings, load_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_kubernetes_manifests_match_the_api_schemas_strictly(path: Path) -> None:
    for document in _documents(path):
        kubernetes_validate.validate(document, "1.30.0", strict=True)


def test_a_misspelt_kubernetes_field_is_caught() -> None:
    (statefulset,) = [
        doc
        for doc in _documents(DEPLOY / "kubernetes" / "portico.yaml")
        if doc["kind"] == "StatefulSet"
    ]
    statefulset["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 40
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, "1.30.0", strict=True)


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is missing: .ci/run installs it (apt-get install {name})"
    return path


def test_the_compose_file_is_valid() -> None:
    result = subprocess.run(
        [_tool("docker-compose"), "-f", str(COMPOSE), "config", "-q"],
        env={"PORTICO_JWT_ISSUER": "https://id.example.com/", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_the_balancer_configuration_is_valid() -> None:
    result = subprocess.run(
        [_tool("haproxy"), "-c", "-f", str(DEPLOY / "compose" / "haproxy.cfg")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr


def _compose_replica_environments() -> list[dict[str, str]]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return [
        {key: str(value) for key, value in service["environment"].items()}
        for name, service in services.items()
        if name.startswith("portico-")
    ]


def _kubernetes_environment() -> dict[str, str]:
    env: dict[str, str] = {}
    for path in MANIFESTS:
        for doc in _documents(path):
            if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "portico":
                env.update(doc["data"])
            if doc["kind"] == "Secret" and doc["metadata"]["name"] == "portico":
                env.update(doc["stringData"])
    env["PORTICO_REPLICA_ID"] = "portico-0"  # from the pod's name (fieldRef)
    return env


# Each replica's environment in compose, and the Kubernetes ConfigMap with its Secret.
each_deployment = pytest.mark.parametrize(
    "env",
    [*_compose_replica_environments(), _kubernetes_environment()],
    ids=["compose-1", "compose-2", "compose-3", "kubernetes"],
)


@each_deployment
def test_every_variable_the_deployments_set_is_a_setting(env: dict[str, str]) -> None:
    env = {**env, "PORTICO_JWT_ISSUER": "https://id.example.com/"}
    assert environment_warnings(env) == []
    settings = load_settings(env=env)
    assert (settings.store, settings.bus, settings.media) == ("postgres", "redis", "s3")
    assert (settings.auth, settings.host) == ("jwt", "0.0.0.0")


@each_deployment
def test_the_deployments_configuration_passes_the_startup_checks(env: dict[str, str]) -> None:
    env = {**env, "PORTICO_JWT_ISSUER": "https://id.example.com/"}
    load_settings(env=env).check_startable(env)
