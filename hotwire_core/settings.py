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


_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def flag_env(name: str, default: bool) -> bool:
    """A yes/no setting: 1/true/yes/on or 0/false/no/off in any case; unset or empty means ``default``. Anything
    else is an error, not a silent "off"."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _YES or raw in _NO:
        return raw in _YES
    raise ValueError(f"{name}={os.environ[name]!r} must be 1 or 0 (true/false, yes/no and on/off work too)")


MAX_LAYER = 1 << 16  # far above any model's depth; bounds HOTWIRE_LAYERS ranges before they are expanded


def parse_layers(text: str) -> frozenset[int]:
    """``"8-20,24"`` -> {8, ..., 20, 24}: comma-separated layer indices and inclusive ranges."""
    layers: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            raise ValueError(f"HOTWIRE_LAYERS={text!r}: {part.strip()!r} is not a layer index or a range like 8-20") from None
        if lo < 0 or hi < lo or hi >= MAX_LAYER:
            raise ValueError(f"HOTWIRE_LAYERS={text!r}: {part.strip()!r} is not a range of layers in [0, {MAX_LAYER})")
        layers.update(range(lo, hi + 1))
    return frozenset(layers)


def middle_layer(hooked: str | None, n_layers: int) -> int:
    """The hooked layer nearest the model's middle (the one self-tests and demos steer). ``hooked``: the
    server's ``model.layers`` (e.g. ``"14-21"``); None or empty means every layer."""
    layers = parse_layers(hooked) if hooked else range(n_layers)
    return min(layers, key=lambda layer: (abs(layer - n_layers // 2), layer))


def format_layers(layers: frozenset[int] | set[int]) -> str:
    """The inverse of :func:`parse_layers`: {0, 1, 2, 5} -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def retain_s_from_env() -> int:
    """HOTWIRE_RETAIN_S: seconds a replaced or deleted version stays usable by requests pinned to it (default 60);
    a fleet's replicas read it too (``hotwire_api.fleet``)."""
    return _int_env("HOTWIRE_RETAIN_S", 60, 0, 86_400)


@dataclass(frozen=True)
class Settings:
    slots: int  # HOTWIRE_SLOTS: bank rows that can hold vectors
    max_stack: int  # HOTWIRE_MAX_STACK: entries per token and layer (same-layer stacking)
    impl: str  # HOTWIRE_IMPL: "op" (opaque custom op) or "inductor" (torch ops fused by Inductor)
    store: str | None  # HOTWIRE_STORE: store root, "off", or None (unset)
    preload: str | None  # HOTWIRE_VECTORS: directory of vectors loaded at start
    norm: bool = False  # HOTWIRE_NORM: allow norm-relative entries at tensor parallel 1 (see steer_hook.SteerHook)
    idle_graphs: bool = True  # HOTWIRE_IDLE_GRAPHS: capture hotwire-free CUDA graphs for unsteered steps (ops.Gate)
    layers: frozenset[int] | None = None  # HOTWIRE_LAYERS: the only layers hooked (None: all); fewer, cheaper steps
    pdl: bool = True  # HOTWIRE_PDL: programmatic dependent launch of the op's kernel where the GPU has it (ops.PDL)
    # HOTWIRE_RETAIN_S: seconds a replaced or deleted version stays usable by requests pinned to it (registry)
    retain_s: int = 60
    max_rows: int | None = None  # HOTWIRE_MAX_ROWS: bank rows one request may pin (None: see rows_per_request)
    max_wait_s: int = 30  # HOTWIRE_MAX_WAIT_S: seconds a request may wait for bank rows before it is refused
    # HOTWIRE_CAPTURE: compile the capture op in (activation capture for vector extraction; it reads the residual
    # stream, so like HOTWIRE_NORM it is opt-in: see runtime.SteerHook); HOTWIRE_CAPTURE_ROWS: captures at once
    capture: bool = False
    capture_rows: int = 32

    @classmethod
    def from_env(cls) -> "Settings":
        impl = os.environ.get("HOTWIRE_IMPL", "op")
        if impl not in ("op", "inductor"):
            raise ValueError(f"HOTWIRE_IMPL={impl!r} must be 'op' or 'inductor'")
        slots = _int_env("HOTWIRE_SLOTS", 256, 1, 1 << 16)
        max_rows = _int_env("HOTWIRE_MAX_ROWS", 0, 1, 1 << 16) or None  # unset: rows_per_request decides
        if max_rows is not None and max_rows > slots:
            raise ValueError(f"HOTWIRE_MAX_ROWS={max_rows} is more than the bank holds (HOTWIRE_SLOTS={slots}): "
                             f"set it to at most {slots}, or raise HOTWIRE_SLOTS")
        return cls(
            slots=slots,
            max_stack=_int_env("HOTWIRE_MAX_STACK", 4, 1, 16),
            impl=impl,
            norm=flag_env("HOTWIRE_NORM", False),
            idle_graphs=flag_env("HOTWIRE_IDLE_GRAPHS", True),
            layers=parse_layers(os.environ["HOTWIRE_LAYERS"]) if os.environ.get("HOTWIRE_LAYERS") else None,
            pdl=flag_env("HOTWIRE_PDL", True),
            retain_s=retain_s_from_env(),
            max_rows=max_rows,
            max_wait_s=_int_env("HOTWIRE_MAX_WAIT_S", 30, 0, 86_400),
            capture=flag_env("HOTWIRE_CAPTURE", False),
            capture_rows=_int_env("HOTWIRE_CAPTURE_ROWS", 32, 1, 4096),
            store=os.environ.get("HOTWIRE_STORE") or None,
            preload=os.environ.get("HOTWIRE_VECTORS") or None,
        )

    def rows_per_request(self, steerable_layers: int) -> int:
        """The bank rows one request may pin: ``HOTWIRE_MAX_ROWS``, by default a quarter of the bank (so one
        request cannot keep the others waiting), but never fewer than one row per steerable layer (one vector at
        every layer always fits a bank that can hold it)."""
        if self.max_rows is not None:
            return self.max_rows
        return min(self.slots, max(self.slots // 4, steerable_layers, 1))

    def compile_fingerprint(self) -> str:
        """Everything that changes the compiled graph: mixed into vLLM's compile-cache key."""
        layers = "" if self.layers is None else f";layers={format_layers(self.layers)}"
        capture = f";capture={self.capture_rows}" if self.capture else ""
        return (f"hotwire={__version__};slots={self.slots};stack={self.max_stack};impl={self.impl};norm={self.norm}"
                f"{layers}{capture}")

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
