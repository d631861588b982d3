"""The audit trail: every change to the vectors (register, replace, delete, by upload or extraction) and to the
keys, with who made it, append-only. Where it is kept depends on the vector registry (``vector_registry``): with
the local store, one JSON line per change in ``audit.jsonl`` beside the stored vectors (or, with the store off, the
last :data:`MEMORY_ENTRIES` in this API server's memory); in a fleet, a Redis stream that the register and delete
scripts append to in the same atomic step as the change (``fleet.lua``). ``GET /steer/audit`` reads it, newest
first (admins only)."""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pydantic

__all__ = ["MEMORY_ENTRIES", "VECTOR_ACTIONS", "AuditEntry", "AuditFile", "AuditMemory", "AuditPage", "Author", "entry"]

logger = logging.getLogger(__name__)

MEMORY_ENTRIES = 10_000

VECTOR_ACTIONS = ("register", "replace", "delete")
Action = Literal["register", "replace", "delete", "key_added", "key_rotated", "key_revoked", "key_role_changed",
                 "key_tenant_changed", "monitor_added", "monitor_replaced", "monitor_deleted"]


@dataclass(frozen=True)
class Author:
    """Who makes a vector change, and how: the caller's key name (:attr:`AuditEntry.who`), ``upload`` or
    ``extract``, and the replica whose API server takes it."""

    who: str = "anonymous"
    via: str = "upload"
    replica: str = "local"


class AuditEntry(pydantic.BaseModel):
    at: float = pydantic.Field(description="when, in seconds since the epoch (UTC)")
    who: str = pydantic.Field(description="the name of the key that made the change (`HOTWIRE_API_KEY`; `api-key` "
                              "with one key and no keys file; `anonymous` with auth off; `keys file` for key changes)")
    action: Action
    id: str = pydantic.Field(description="the vector's id, the key's name or the monitor's id")
    version: int | None = None
    sha256: str | None = pydantic.Field(None, description="the vector's content hash")
    via: Literal["upload", "extract"] | None = pydantic.Field(None, description="how a vector came: uploaded or "
                                                              "extracted on the server")
    replica: str = pydantic.Field("local", description="the replica that made the change")


class AuditPage(pydantic.BaseModel):
    kept: str = pydantic.Field(description="where the trail is kept: `file <path>`, `memory` (the last "
                               f"{MEMORY_ENTRIES:,} changes of this API server: the store is off) or `redis`")
    entries: list[AuditEntry] = pydantic.Field(description="newest first")


def entry(who: str, action: Action, item: str, version: int | None = None, sha256: str | None = None,
          via: str | None = None, replica: str = "local") -> AuditEntry:
    return AuditEntry(at=round(time.time(), 6), who=who, action=action, id=item, version=version, sha256=sha256,
                      via=via, replica=replica)


class AuditFile:
    """``audit.jsonl``: each change one line, appended with ``O_APPEND`` (lines of several API servers do not
    interleave) and synced before the change is answered."""

    def __init__(self, path: Path):
        self.path = path

    @property
    def kept(self) -> str:
        return f"file {self.path}"

    def record(self, change: AuditEntry) -> None:
        line = (change.model_dump_json(exclude_none=True) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, limit: int) -> list[AuditEntry]:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in reversed(lines):
            if len(out) == limit:
                break
            try:
                out.append(AuditEntry.model_validate(json.loads(line)))
            except (ValueError, pydantic.ValidationError):  # a line torn by a crash mid-write: skipped, said
                logger.warning("hotwire: %s holds a line that is not an audit entry: %.200r", self.path, line)
        return out


class AuditMemory:
    """The last :data:`MEMORY_ENTRIES` changes, in this process only: for a server whose store is off."""

    kept = "memory"

    def __init__(self) -> None:
        self._entries: collections.deque[AuditEntry] = collections.deque(maxlen=MEMORY_ENTRIES)

    def record(self, change: AuditEntry) -> None:
        self._entries.append(change)

    def read(self, limit: int) -> list[AuditEntry]:
        return list(reversed(self._entries))[:limit]
