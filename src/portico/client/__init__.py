"""Python clients of Portico's protocols."""

from portico.client import session
from portico.client.session import *  # noqa: F403 (the public names are session.__all__)

__all__ = list(session.__all__)
