"""The engine's environment settings (parsed by ``hotwire_core.env``), read once per process."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .env import Choice, Flag, Int, Layers, Text, load, parse_layers, setting
from .tenant_limits import TENANT_LIMITS, TenantLimits

__all__ = ["RETAIN_S", "Settings", "default_store_root", "format_layers", "middle_layer", "parse_layers"]


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


RETAIN_S = Int("HOTWIRE_RETAIN_S", default=60, lo=0, hi=86_400,
               doc="seconds a replaced or deleted version stays usable by requests pinned to it (the registry; a "
                   "fleet's replicas read it too, hotwire_api.fleet)")


@dataclass(frozen=True)
class Settings:
    """The engine's settings, read in the engine core and in each worker (``vllm_glue.patching.settings``)."""

    slots: int = setting(Int("HOTWIRE_SLOTS", default=256, lo=1, hi=1 << 16, doc="bank rows that can hold vectors"))
    max_stack: int = setting(Int("HOTWIRE_MAX_STACK", default=4, lo=1, hi=16,
                                 doc="entries per token and layer (same-layer stacking)"))
    impl: str = setting(Choice("HOTWIRE_IMPL", default="op", options=("op", "inductor"),
                               doc='"op" (opaque custom op) or "inductor" (torch ops fused by Inductor)'))
    store: str | None = setting(Text("HOTWIRE_STORE", doc='the store root, "off", or unset (the default root)'))
    preload: str | None = setting(Text("HOTWIRE_VECTORS", doc="a directory of vectors loaded at start"))
    norm: bool = setting(Flag("HOTWIRE_NORM", default=False,
                              doc="allow norm-relative entries at tensor parallel 1 (see steer_hook.SteerHook)"))
    idle_graphs: bool = setting(Flag("HOTWIRE_IDLE_GRAPHS", default=True,
                                     doc="capture a CUDA graph set per mix of hotwire ops, hotwire-free for "
                                         "unsteered steps (ops.graph_variants)"))
    layers: frozenset[int] | None = setting(Layers("HOTWIRE_LAYERS",
                                                   doc="the only layers hooked (unset: all); fewer, cheaper steps"))
    pdl: bool = setting(Flag("HOTWIRE_PDL", default=True,
                             doc="programmatic dependent launch of hotwire's kernels where the GPU has it (ops.PDL)"))
    retain_s: int = setting(RETAIN_S)
    max_rows: int | None = setting(Int("HOTWIRE_MAX_ROWS", lo=1, hi=1 << 16,
                                       doc="bank rows one request may pin (unset: see rows_per_request)"))
    tenant_rows: int | None = setting(Int("HOTWIRE_TENANT_ROWS", lo=1, hi=1 << 16,
                                          doc="bank rows one tenant's vectors may pin at once (unset: see "
                                              "rows_per_tenant)"))
    tenant_limits: Mapping[str, TenantLimits] | None = setting(TENANT_LIMITS)
    max_wait_s: int = setting(Int("HOTWIRE_MAX_WAIT_S", default=30, lo=0, hi=86_400,
                                  doc="seconds a request may wait for bank rows before it is refused"))
    capture: bool = setting(Flag("HOTWIRE_CAPTURE", default=False,
                                 doc="compile the capture op in (vector extraction); it reads the residual stream "
                                     "(see stream_read), so it is opt-in"))
    capture_rows: int = setting(Int("HOTWIRE_CAPTURE_ROWS", default=32, lo=1, hi=4096,
                                    doc="captures (extraction examples) running at once per engine core"))
    readout: bool = setting(Flag("HOTWIRE_READOUT", default=False,
                                 doc="compile the readout op in (probe projections per token); it reads the "
                                     "residual stream (see stream_read), so it is opt-in"))
    readout_probes: int = setting(Int("HOTWIRE_READOUT_PROBES", default=4, lo=1, hi=32,
                                      doc="probes one request may read (the readout buffers' width)"))
    readout_layers: frozenset[int] | None = setting(Layers(
        "HOTWIRE_READOUT_LAYERS", doc="the hooked layers the readout op runs at (unset: all); each costs a launch in "
                                      "every step that reads, so fewer make reading cheaper"))

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Settings":
        settings = load(cls, env)
        if settings.max_rows is not None and settings.max_rows > settings.slots:
            raise ValueError(f"HOTWIRE_MAX_ROWS={settings.max_rows} is more than the bank holds (HOTWIRE_SLOTS="
                             f"{settings.slots}): set it to at most {settings.slots}, or raise HOTWIRE_SLOTS")
        return settings

    def rows_per_request(self, steerable_layers: int) -> int:
        """The bank rows one request may pin: ``HOTWIRE_MAX_ROWS``, by default a quarter of the bank (so one
        request cannot keep the others waiting), but never fewer than one row per steerable layer (one vector at
        every layer always fits a bank that can hold it)."""
        if self.max_rows is not None:
            return self.max_rows
        return min(self.slots, max(self.slots // 4, steerable_layers, 1))

    def rows_per_tenant(self, steerable_layers: int, tenant: str | None = None) -> int:
        """The bank rows one tenant's vectors may pin at once: its own ``rows`` in ``HOTWIRE_TENANT_LIMITS``, else
        ``HOTWIRE_TENANT_ROWS``, by default half the bank, so that a tenant flooding distinct vectors leaves the
        other half to the rest; never fewer than one request may pin (a request that fits the bank fits its
        tenant's share)."""
        rows = getattr((self.tenant_limits or {}).get(tenant), "rows", None) if tenant else None
        if rows is None:
            rows = self.tenant_rows if self.tenant_rows is not None else self.slots // 2
        return min(self.slots, max(rows, self.rows_per_request(steerable_layers)))

    def tenant_shares(self, steerable_layers: int) -> dict[str, int]:
        """The named tenants' own shares of the bank (:meth:`rows_per_tenant`), where they set one."""
        return {tenant: self.rows_per_tenant(steerable_layers, tenant)
                for tenant, own in (self.tenant_limits or {}).items() if own.rows is not None}

    def compile_fingerprint(self) -> str:
        """Everything that changes the compiled graph: mixed into vLLM's compile-cache key."""
        layers = "" if self.layers is None else f";layers={format_layers(self.layers)}"
        capture = f";capture={self.capture_rows}" if self.capture else ""
        readout = f";readout={self.readout_probes}" if self.readout else ""
        if self.readout and self.readout_layers is not None:
            readout += f"@{format_layers(self.readout_layers)}"
        return (f"hotwire={__version__};slots={self.slots};stack={self.max_stack};impl={self.impl};norm={self.norm}"
                f"{layers}{capture}{readout}")

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
