"""Flood windows (``--flood-windows S``): the flooding tenant floods in every other window of S seconds, the first
one quiet, so that the other tenants' requests with and without the flood are measured on one server in one run,
side by side. Two runs compare two servers, whose throughput differs by several per cent on its own (RESULTS AZ:
one server's rounds 30% apart). A request counts in the window it started in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .responses import Observation
from .stats import summarize_ms

__all__ = ["KINDS", "Windows", "compare", "split"]

KINDS = ("quiet", "flood")


@dataclass(frozen=True)
class Windows:
    began: float  # the soak clock's time the traffic began
    seconds: float

    def _index(self, t: float) -> int:
        return int((t - self.began) // self.seconds)

    def flooding(self, t: float) -> bool:
        return self._index(t) % 2 == 1

    def next_flood(self, t: float) -> float:
        """When the flood window ``t`` is in, or the next one, begins."""
        k = self._index(t)
        return self.began + (k if k % 2 == 1 else k + 1) * self.seconds

    def seconds_of(self, elapsed: float) -> dict[str, float]:
        """How long each kind of window lasted in the ``elapsed`` seconds after ``began``."""
        full, rest = divmod(elapsed, self.seconds)
        n = int(full)
        spent = {"quiet": (n + 1) // 2 * self.seconds, "flood": n // 2 * self.seconds}
        spent[KINDS[n % 2]] += rest
        return spent


def split(ok: Mapping[str, Sequence[Observation]], windows: Windows, elapsed: float) -> dict[str, Any]:
    """Per kind of window: its seconds, the requests judged ok per second, and their total latency by class."""
    spent = windows.seconds_of(elapsed)
    out = {}
    for kind in KINDS:
        picked = {name: [o for o in group if windows.flooding(o.start) == (kind == "flood")]
                  for name, group in ok.items()}
        out[kind] = {"seconds": round(spent[kind], 2),
                     "ok_rps": round(sum(map(len, picked.values())) / spent[kind], 2) if spent[kind] else None,
                     "total_ms": {name: summarize_ms([o.end - o.start for o in group]) for name, group in picked.items()}}
    return out


def compare(by_tenant: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The other tenants with the flood against without it: each tenant's p99 and p50 ratios by class and its ok
    requests per second ratio (flood / quiet), and the worst of each across tenants."""
    ratios: dict[str, dict[str, float | None]] = {}
    for tenant, windows in by_tenant.items():
        quiet, flood = windows["quiet"], windows["flood"]
        row: dict[str, float | None] = {"ok_rps": _ratio(flood["ok_rps"], quiet["ok_rps"])}
        for name in quiet["total_ms"]:
            for p in ("p50", "p99"):
                row[f"{name}_{p}"] = _ratio(flood["total_ms"][name][p], quiet["total_ms"][name][p])
        ratios[tenant] = row
    worst: dict[str, float | None] = {}
    for key in next(iter(ratios.values()), {}):
        values = [r[key] for r in ratios.values() if r[key] is not None]
        worst[key] = (min if key == "ok_rps" else max)(values) if values else None
    return {"by_tenant": ratios, "worst": worst}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None
