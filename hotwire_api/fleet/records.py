"""What the registry's Redis commands answer, as values (``redis_registry``): the restart gate and an entry of the
event stream."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Event", "Gate", "text"]


@dataclass(frozen=True)
class Gate:
    """The restart gate (``lua.GATE``): ``open``; ``opened`` now by this look (``missing``: the live replicas it
    opened without, at the limit); ``run_id`` of the running Redis; ``closing``, the restart or wipe in progress
    ("" while open); ``mark``, the closing the asking replica last repaired for."""

    open: bool
    opened: bool
    run_id: str
    closing: str
    mark: str
    missing: tuple[str, ...]


@dataclass(frozen=True)
class Event:
    """One entry of the stream: ``op`` is ``register`` or ``delete``."""

    stream_id: str
    op: str
    vector_id: str
    version: int
    sha256: str

    @classmethod
    def parse(cls, stream_id: Any, fields: Mapping[Any, Any]) -> Event:
        f = {text(k): text(v) for k, v in fields.items()}
        return cls(text(stream_id), f["op"], f["id"], int(f["version"]), f["sha256"])


def text(value: Any) -> str:
    """A Redis reply (bytes or a number) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
