"""hotwire_api.stats_cache.StatsCache: shared fetches, freshness after one's own writes, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from hotwire_api.stats_cache import StatsCache
from hotwire_api.models import SlotStats


def _stats(vectors: int) -> SlotStats:
    return SlotStats.model_validate({
        "capacity": 8, "used": 0, "pinned": 0, "free": 8, "evictions": 0, "refused": {}, "steered_requests": 0,
        "vectors": vectors, "rows": [],
        "model": {"steerable": True, "reason": "", "n_layers": 4, "hidden_size": 8, "max_stack": 4, "norm": False},
    })


class SlowEngine:
    """``stats()`` answers ``vectors`` as it was when the call was sent, after ``release`` is set."""

    def __init__(self) -> None:
        self.vectors = 0
        self.calls = 0
        self.release = asyncio.Event()

    async def stats(self) -> SlotStats:
        self.calls += 1
        seen = self.vectors
        await self.release.wait()
        return _stats(seen)


def test_cancelled_waiter_does_not_cancel_the_shared_fetch():
    async def main():
        cache, engine = StatsCache(), SlowEngine()
        a = asyncio.create_task(cache.get(engine, 10.0))
        await asyncio.sleep(0)
        b = asyncio.create_task(cache.get(engine, 10.0))  # no snapshot yet: joins a's fetch
        await asyncio.sleep(0)
        a.cancel()
        await asyncio.sleep(0)
        engine.release.set()
        stats, _ = await b
        assert stats.vectors == 0 and engine.calls == 1
        with pytest.raises(asyncio.CancelledError):
            await a

    asyncio.run(main())


def test_fresh_read_does_not_join_a_fetch_sent_before_it_arrived():
    async def main():
        cache, engine = StatsCache(), SlowEngine()
        background = asyncio.create_task(cache.refresh(engine))  # sent before the caller's write
        await asyncio.sleep(0.01)
        engine.vectors = 1  # the caller's write lands in the engine
        reader = asyncio.create_task(cache.get(engine, 0))
        await asyncio.sleep(0.01)
        engine.release.set()
        stats, age = await reader
        await background
        assert stats.vectors == 1 and engine.calls == 2 and age < 1

    asyncio.run(main())


def test_cached_answer_within_max_age_does_not_call_the_engine():
    async def main():
        cache, engine = StatsCache(), SlowEngine()
        engine.release.set()
        await cache.refresh(engine)
        stats, age = await cache.get(engine, 10.0)
        assert engine.calls == 1 and stats.vectors == 0 and 0 <= age < 5

    asyncio.run(main())
