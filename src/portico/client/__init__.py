"""Python clients of Portico's protocols."""

from portico.client import rpc, session
from portico.client.rpc import *  # noqa: F403 (the public names are rpc.__all__)
from portico.client.session import *  # noqa: F403 (the public names are session.__all__)

__all__ = [*session.__all__, *rpc.__all__]
