"""hotwire's Prometheus series on vLLM's ``/metrics`` (the default ``prometheus_client`` registry).

A collector reads a cached ``hotwire_stats`` snapshot; :meth:`StatsCache.run` refreshes it every
``REFRESH_INTERVAL_S`` and the ``/steer`` routes refresh it after each call, so a scrape never waits on the engine.
``GET /steer/slots?max_age_ms=N`` serves the same snapshot to pollers (:meth:`StatsCache.get`).
``hotwire_refusals_total`` adds the refusals the engine counts when it admits requests to those this process's
admission middleware issued (a request refused there never reaches the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.models import SlotStats

REFRESH_INTERVAL_S = 2.0
logger = logging.getLogger(__name__)


class StatsCache:
    """The latest ``hotwire_stats`` result (None until the first successful refresh), when it was taken, and
    the refusals that admission issued in this process, by reason."""

    def __init__(self) -> None:
        self.snapshot: SlotStats | None = None
        self.taken_at = -math.inf  # time.monotonic() of the snapshot
        self.admission_refusals: dict[str, int] = {}
        self._inflight: asyncio.Task[SlotStats] | None = None
        self._inflight_sent = -math.inf  # time.monotonic() when the fetch in flight was sent

    def count_refusal(self, reason: str) -> None:
        """Count a refusal issued by admission. Copy-on-write: scrapes may read from another thread."""
        self.admission_refusals = {**self.admission_refusals, reason: self.admission_refusals.get(reason, 0) + 1}

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
            if getattr(app.state, "engine_client", None) is not None:
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
        refusals = CounterMetricFamily("hotwire_refusals", "Steering requests refused, by reason.", labels=["reason"])
        if stats is not None:
            refused.update(stats.refused)
            yield from self._bank(stats)
        for reason, count in sorted(refused.items()):
            refusals.add_metric([reason], count)
        yield refusals

    @staticmethod
    def _bank(stats: SlotStats) -> Iterator[Metric]:
        yield GaugeMetricFamily("hotwire_slots_capacity", "Rows in the steering bank.", value=stats.capacity)
        yield GaugeMetricFamily("hotwire_slots_used", "Bank rows holding a vector row.", value=stats.used)
        yield GaugeMetricFamily("hotwire_slots_pinned", "Bank rows pinned by running requests.", value=stats.pinned)
        yield CounterMetricFamily(
            "hotwire_slot_evictions", "Bank rows evicted to make room for others.", value=stats.evictions
        )
        yield GaugeMetricFamily("hotwire_vectors_registered", "Registered steering vectors.", value=stats.vectors)
        yield CounterMetricFamily(
            "hotwire_steered_requests", "Requests admitted with steering.", value=stats.steered_requests
        )


STATS = StatsCache()


@contextlib.asynccontextmanager
async def refreshing(app: Any) -> AsyncIterator[None]:
    """Lifespan: keep :data:`STATS` fresh while ``app`` runs."""
    task = asyncio.create_task(STATS.run(app))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


_COLLECTOR = HotwireCollector(STATS)
_registered = False


def register_collector() -> None:
    """Expose :data:`STATS` on the default registry (the one vLLM's ``/metrics`` serves); idempotent."""
    global _registered
    if not _registered:
        REGISTRY.register(_COLLECTOR)
        _registered = True
