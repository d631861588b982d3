"""The latest ``hotwire_stats`` snapshot of this API server's engine, shared by ``/metrics``, ``GET /steer/slots``
and admission: :meth:`StatsCache.run` refreshes it every ``REFRESH_INTERVAL_S``, the ``/steer`` routes after each
call, and ``GET /steer/slots?max_age_ms=N`` serves it to pollers (:meth:`StatsCache.get`)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, Protocol

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.models import SlotStats
from hotwire_core.vllm_glue.api_server import engine_client

REFRESH_INTERVAL_S = 2.0
logger = logging.getLogger(__name__)


class SeriesSink(Protocol):
    """Where snapshots and refusals go in vLLM's multiprocess metrics mode (``metrics.MultiprocessSeries``)."""

    def refusal(self, reason: str) -> None: ...

    def snapshot(self, stats: SlotStats) -> None: ...


class StatsCache:
    """The latest ``hotwire_stats`` result (None until the first successful refresh), when it was taken, and
    the refusals that admission issued in this process, by reason."""

    def __init__(self) -> None:
        self.snapshot: SlotStats | None = None
        self.taken_at = -math.inf  # time.monotonic() of the snapshot
        self.admission_refusals: dict[str, int] = {}
        self._inflight: asyncio.Task[SlotStats] | None = None
        self._inflight_sent = -math.inf  # time.monotonic() when the fetch in flight was sent
        self.series: SeriesSink | None = None  # set in vLLM's multiprocess metrics mode
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


STATS = StatsCache()
