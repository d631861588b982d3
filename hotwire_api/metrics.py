"""hotwire's Prometheus series on vLLM's ``/metrics``.

They come from a cached ``hotwire_stats`` snapshot; :meth:`StatsCache.run` refreshes it every
``REFRESH_INTERVAL_S`` and the ``/steer`` routes refresh it after each call, so a scrape never waits on the engine.
``GET /steer/slots?max_age_ms=N`` serves the same snapshot to pollers (:meth:`StatsCache.get`).
``hotwire_refusals_total`` adds the refusals the engine counts when it admits requests to those the admission
middleware issued (a request refused there never reaches the engine).

Two ways onto ``/metrics``, matching vLLM's two registries: with one API server, a collector on the default
registry reads the snapshot at scrape time (:class:`HotwireCollector`). With several (``--api-server-count``, or
data parallel), vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` and ``/metrics`` merges the per-process files of
``prometheus_client`` metrics, ignoring collectors; then every API server counts its admission refusals in a
``Counter`` (summed over processes) and the first one alone writes the engine-wide series
(:class:`MultiprocessSeries`), which would otherwise be counted once per process.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter as CounterMetric, Gauge as GaugeMetric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.models import SlotStats
from hotwire_core.vllm_glue.api_server import engine_client, is_first_api_server

REFRESH_INTERVAL_S = 2.0
logger = logging.getLogger(__name__)


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


class StatsCache:
    """The latest ``hotwire_stats`` result (None until the first successful refresh), when it was taken, and
    the refusals that admission issued in this process, by reason."""

    def __init__(self) -> None:
        self.snapshot: SlotStats | None = None
        self.taken_at = -math.inf  # time.monotonic() of the snapshot
        self.admission_refusals: dict[str, int] = {}
        self._inflight: asyncio.Task[SlotStats] | None = None
        self._inflight_sent = -math.inf  # time.monotonic() when the fetch in flight was sent
        self.series: MultiprocessSeries | None = None  # set in vLLM's multiprocess metrics mode
        self.registry_reachable: int | None = None  # with a fleet registry: 1 while it answers (hotwire_api.fleet)

    def count_refusal(self, reason: str) -> None:
        """Count a refusal issued by admission. Copy-on-write: scrapes may read from another thread."""
        self.admission_refusals = {**self.admission_refusals, reason: self.admission_refusals.get(reason, 0) + 1}
        if self.series is not None:
            self.series.refusal(reason)

    def age_s(self) -> float:
        return time.monotonic() - self.taken_at

    def _fetch(self, engine: HotwireEngine, not_before: float = -math.inf) -> asyncio.Task[SlotStats]:
        """A fetch sent at or after ``not_before`` (time.monotonic()): the one in flight when it qualifies, so
        concurrent callers share one engine round trip, else a new one. A caller that must see its own earlier
        writes passes the time it arrived: a fetch sent before that may have been answered before them."""
        if self._inflight is None or self._inflight.done() or self._inflight_sent < not_before:
            async def fetch() -> SlotStats:
                stats = await engine.stats()
                self.snapshot, self.taken_at = stats, time.monotonic()
                if self.series is not None:
                    self.series.snapshot(stats)
                return stats

            self._inflight, self._inflight_sent = asyncio.ensure_future(fetch()), time.monotonic()
        return self._inflight

    async def refresh(self, engine: HotwireEngine) -> None:
        """Fetch a new snapshot; a failure keeps the old one."""
        try:
            # Shielded: a cancelled caller must not cancel the fetch that other callers share.
            await asyncio.shield(self._fetch(engine))
        except HotwireError as err:
            logger.debug("hotwire stats refresh failed: %s", err)

    async def get(self, engine: HotwireEngine, max_age_s: float) -> tuple[SlotStats, float]:
        """A snapshot at most ``max_age_s`` old and its age. A cached one past half that age is returned as is
        while a refresh runs in the background, so steady pollers never wait on the engine (which answers only
        between two model steps); ``max_age_s=0`` always asks the engine, after anything this caller did."""
        arrived = time.monotonic()
        age = arrived - self.taken_at
        if self.snapshot is not None and age <= max_age_s and max_age_s > 0:
            if age > max_age_s / 2:
                self._fetch(engine).add_done_callback(_ignore_failure)
            return self.snapshot, age
        stats = await asyncio.shield(self._fetch(engine, not_before=arrived - max_age_s))
        return stats, self.age_s()

    async def run(self, app: Any, interval: float = REFRESH_INTERVAL_S) -> None:
        """Refresh from ``app``'s engine every ``interval`` seconds until cancelled."""
        while True:
            if engine_client(app) is not None:
                await self.refresh(HotwireEngine.of(app))
            await asyncio.sleep(interval)


def _ignore_failure(task: asyncio.Task) -> None:
    """A background refresh that failed keeps the old snapshot; retrieve the error so asyncio does not log it."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("hotwire stats refresh failed: %s", task.exception())


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


STATS = StatsCache()


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
