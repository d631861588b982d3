"""Environment settings, read once per process."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from . import __version__


def _int_env(name: str, default: int, lo: int, hi: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} must be in [{lo}, {hi}]")
    return value


@dataclass(frozen=True)
class Settings:
    slots: int  # HOTWIRE_SLOTS: bank rows that can hold vectors
    max_stack: int  # HOTWIRE_MAX_STACK: entries per token and layer (same-layer stacking)
    impl: str  # HOTWIRE_IMPL: "op" (opaque custom op) or "inductor" (torch ops fused by Inductor)
    store: str | None  # HOTWIRE_STORE: store root, "off", or None (unset)
    preload: str | None  # HOTWIRE_VECTORS: directory of vectors loaded at start
    norm: bool = False  # HOTWIRE_NORM: allow norm-relative entries at tensor parallel 1 (see runtime.SteerHook)
    idle_graphs: bool = True  # HOTWIRE_IDLE_GRAPHS: capture hotwire-free CUDA graphs for unsteered steps (ops.Gate)

    @classmethod
    def from_env(cls) -> "Settings":
        impl = os.environ.get("HOTWIRE_IMPL", "op")
        if impl not in ("op", "inductor"):
            raise ValueError(f"HOTWIRE_IMPL={impl!r} must be 'op' or 'inductor'")
        return cls(
            slots=_int_env("HOTWIRE_SLOTS", 256, 1, 1 << 16),
            max_stack=_int_env("HOTWIRE_MAX_STACK", 4, 1, 16),
            impl=impl,
            norm=_int_env("HOTWIRE_NORM", 0, 0, 1) == 1,
            idle_graphs=_int_env("HOTWIRE_IDLE_GRAPHS", 1, 0, 1) == 1,
            store=os.environ.get("HOTWIRE_STORE") or None,
            preload=os.environ.get("HOTWIRE_VECTORS") or None,
        )

    def compile_fingerprint(self) -> str:
        """Everything that changes the compiled graph: mixed into vLLM's compile-cache key."""
        return f"hotwire={__version__};slots={self.slots};stack={self.max_stack};impl={self.impl};norm={self.norm}"

    def store_dir(self, model: str) -> Path | None:
        """One folder per served model under the store root, or None when the store is off."""
        if self.store is None or self.store.lower() == "off":
            return None
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model.strip("/"))[-48:]
        digest = hashlib.sha256(model.encode()).hexdigest()[:8]
        return Path(self.store).expanduser() / f"{slug}-{digest}"


def default_store_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hotwire", "store")
