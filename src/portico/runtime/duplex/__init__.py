"""The duplex runtime port (live voice calls): `base.py` plus one module per runtime.

Each runtime module is imported only when an agent uses it: their libraries (grpcio,
the speech packages of the embedded agent) are optional extras."""

from __future__ import annotations

from portico.config import AgentSettings, DuplexRuntimeName


def duplex_runtime_of(agent: AgentSettings) -> DuplexRuntimeName | None:
    """The agent's duplex runtime: configured, else the one its text runtime implies.
    None: the agent takes no calls (audio frames are refused `MEDIA_NOT_ENABLED`)."""
    if agent.duplex_runtime is not None:
        return agent.duplex_runtime
    if agent.runtime == "grpc":
        return "grpc"
    if agent.runtime == "demo":
        return "embedded"
    return None
