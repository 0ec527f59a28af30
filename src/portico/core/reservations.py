"""Session ids handed out before their session is archived, and whose they are.

`/ws` mints a session id at connect and writes the session on its first message;
until then the id is reserved for the connection's principal, so no other
principal can claim it first (with a message or an upload request) and leave the
owner with `SESSION_EXPIRED` on its own connection. Reservations live in this
process: another replica cannot learn an unwritten id (80 random bits) except
from its owner.
"""

from __future__ import annotations


class SessionReservations:
    def __init__(self) -> None:
        self._owners: dict[str, str] = {}

    def reserve(self, session_id: str, principal: str) -> None:
        self._owners[session_id] = principal

    def release(self, session_id: str) -> None:
        self._owners.pop(session_id, None)

    def foreign(self, session_id: str, principal: str) -> bool:
        """True when the id is reserved for someone other than `principal`."""
        owner = self._owners.get(session_id)
        return owner is not None and owner != principal
