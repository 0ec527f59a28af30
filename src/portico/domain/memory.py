"""Agent memory: entries an agent's model saves, searches and forgets, kept in the
archive under one key (principal, agent, memory facet) so that no two facets, agents
or principals see each other's memories (spec/identity.md, Memory facets)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from portico.domain.model import new_id
from portico.errors import InvalidMessage, MemoryFull

# 1 to 128 ASCII letters, digits and `. _ : / -`, starting with a letter or digit.
FACET_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/\-]{0,127}")
NO_FACET = ""  # the key's facet when a connection names none and its agent fixes none


class MemoryKey(msgspec.Struct, frozen=True, kw_only=True):
    principal: str
    agent: str
    facet: str = NO_FACET


class MemoryEntry(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    principal: str
    agent: str
    facet: str
    content: str
    created_at: float

    @property
    def key(self) -> MemoryKey:
        return MemoryKey(principal=self.principal, agent=self.agent, facet=self.facet)


def valid_facet(value: str) -> bool:
    return FACET_PATTERN.fullmatch(value) is not None


def ascii_lower(text: str) -> str:
    """Lower-case ASCII letters only: what SQLite's lower() and PostgreSQL's lower()
    under the "C" collation do, so every backend's search matches the same entries."""
    return text.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def check_content(content: str, *, max_bytes: int) -> None:
    """Refuse an entry the archive would not keep (empty, or over `max_bytes` of UTF-8)."""
    if not content.strip():
        raise InvalidMessage("a memory needs some content")
    if len(content.encode()) > max_bytes:
        raise InvalidMessage(f"a memory is at most {max_bytes} bytes")


class MemoryLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_entries: int = 1000  # per key
    max_entry_bytes: int = 4096  # UTF-8 bytes of one entry
    search_limit: int = 20  # entries one search returns at most


class MemoryArchive(Protocol):
    """The part of the Store port agent memory uses."""

    async def save_memory(self, entry: MemoryEntry, *, max_entries: int) -> bool: ...

    async def search_memory(
        self, key: MemoryKey, query: str, *, limit: int
    ) -> list[MemoryEntry]: ...

    async def forget_memory(self, key: MemoryKey, memory_id: str) -> bool: ...


class AgentMemory:
    """One turn's memory: the archive's entries under one key, and nothing else.

    What a runtime offers the model as tools and a `portico.agent` handler reads as
    `turn.memory`; the key comes from the session's owner, its agent and the
    connection's facet, never from the model or the handler."""

    def __init__(
        self,
        archive: MemoryArchive,
        key: MemoryKey,
        limits: MemoryLimits,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.key = key
        self._archive = archive
        self._limits = limits
        self._clock = clock

    async def save(self, content: str) -> MemoryEntry:
        """Keep `content`; `InvalidMessage` when empty or too large, `MemoryFull`."""
        check_content(content, max_bytes=self._limits.max_entry_bytes)
        key = self.key
        entry = MemoryEntry(
            id=new_id("mem"),
            principal=key.principal,
            agent=key.agent,
            facet=key.facet,
            content=content,
            created_at=self._clock(),
        )
        if not await self._archive.save_memory(entry, max_entries=self._limits.max_entries):
            raise MemoryFull(f"memory is full ({self._limits.max_entries} entries); forget one")
        return entry

    async def search(self, query: str = "", *, limit: int | None = None) -> list[MemoryEntry]:
        """Entries containing `query` (empty: all), newest first."""
        cap = self._limits.search_limit
        return await self._archive.search_memory(
            self.key, query, limit=cap if limit is None else max(1, min(limit, cap))
        )

    async def forget(self, memory_id: str) -> bool:
        """Delete one entry; False when this key holds none with that id."""
        return await self._archive.forget_memory(self.key, memory_id)
