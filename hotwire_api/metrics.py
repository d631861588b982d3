"""hotwire's Prometheus series on vLLM's ``/metrics``.

They come from the cached ``hotwire_stats`` snapshot (:mod:`hotwire_api.stats_cache`), so a scrape never waits
on the engine. ``hotwire_refusals_total`` adds the refusals the engine counts when it admits requests to those the admission
middleware issued (a request refused there never reaches the engine).

Two ways onto ``/metrics``, matching vLLM's two registries: with one API server, a collector on the default
registry reads the snapshot at scrape time (:class:`HotwireCollector`). With several (``--api-server-count``, or
data parallel), vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` and ``/metrics`` merges the per-process files of
``prometheus_client`` metrics, ignoring collectors; then every API server counts its admission refusals in a
``Counter`` (summed over processes) and the first one alone writes the engine-wide series
(:class:`MultiprocessSeries`), which would otherwise be counted once per process.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter as CounterMetric, Gauge as GaugeMetric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hotwire_api.models import SlotStats
from hotwire_api.stats_cache import STATS, StatsCache
from hotwire_core.vllm_glue.api_server import is_first_api_server



# (name, help) of the engine-wide series; the same names in both modes.
_GAUGES = {
    "capacity": ("hotwire_slots_capacity", "Rows in the steering bank."),
    "used": ("hotwire_slots_used", "Bank rows holding a vector row."),
    "pinned": ("hotwire_slots_pinned", "Bank rows pinned by running requests."),
    "vectors": ("hotwire_vectors_registered", "Registered steering vectors."),
}
_COUNTERS = {
    "evictions": ("hotwire_slot_evictions", "Bank rows evicted to make room for others."),
    "steered_requests": ("hotwire_steered_requests", "Requests admitted with steering."),
}
_REFUSALS = ("hotwire_refusals", "Steering requests refused, by reason.")
_REGISTRY = ("hotwire_registry_reachable", "1 while the fleet's vector registry (HOTWIRE_REGISTRY) answers, else 0.")


class MultiprocessSeries:
    """``prometheus_client`` metrics for vLLM's multiprocess ``/metrics`` (``PROMETHEUS_MULTIPROC_DIR``).

    ``engine_wide``: this process writes the snapshot's series (one API server must, and only one). Engine
    counters arrive as running totals and are written as increments, so they stay counters."""

    def __init__(self, engine_wide: bool):
        self._refusals = CounterMetric(*_REFUSALS, ["reason"])
        self._engine_wide = engine_wide
        if engine_wide:
            self._gauges = {k: GaugeMetric(*v, multiprocess_mode="mostrecent") for k, v in _GAUGES.items()}
            self._counters = {k: CounterMetric(*v) for k, v in _COUNTERS.items()}
        self._seen: dict[str, int] = {}  # running totals already written, by counter (refusals: "refused:<reason>")
        self._registry: GaugeMetric | None = None

    def registry(self, reachable: int) -> None:
        """Whether the fleet's registry answers (every API server that asked it: the most recent answer wins)."""
        if self._registry is None:
            self._registry = GaugeMetric(*_REGISTRY, multiprocess_mode="mostrecent")
        self._registry.set(reachable)

    def refusal(self, reason: str) -> None:
        self._refusals.labels(reason).inc()

    def snapshot(self, stats: SlotStats) -> None:
        if not self._engine_wide:
            return
        for key, gauge in self._gauges.items():
            gauge.set(getattr(stats, key))
        for key, counter in self._counters.items():
            counter.inc(self._advance(key, getattr(stats, key)))
        for reason, total in stats.refused.items():
            self._refusals.labels(reason).inc(self._advance(f"refused:{reason}", total))

    def _advance(self, key: str, total: int) -> int:
        step = max(0, total - self._seen.get(key, 0))
        self._seen[key] = max(total, self._seen.get(key, 0))
        return step


class HotwireCollector(Collector):
    """Turns the cached snapshot into ``hotwire_*`` series; never calls the engine."""

    def __init__(self, cache: StatsCache):
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        stats = self._cache.snapshot
        refused = Counter(self._cache.admission_refusals)
        refusals = CounterMetricFamily(*_REFUSALS, labels=["reason"])
        if stats is not None:
            refused.update(stats.refused)
            yield from self._bank(stats)
        for reason, count in sorted(refused.items()):
            refusals.add_metric([reason], count)
        yield refusals
        if self._cache.registry_reachable is not None:
            yield GaugeMetricFamily(*_REGISTRY, value=self._cache.registry_reachable)

    @staticmethod
    def _bank(stats: SlotStats) -> Iterator[Metric]:
        for key, (name, doc) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=getattr(stats, key))
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(stats, key))


_COLLECTOR = HotwireCollector(STATS)
_registered = False


def register_collector() -> None:
    """Put :data:`STATS` on the registry vLLM's ``/metrics`` serves in this process; idempotent."""
    global _registered
    if _registered:
        return
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        STATS.series = MultiprocessSeries(engine_wide=is_first_api_server())
    else:
        REGISTRY.register(_COLLECTOR)
    _registered = True
