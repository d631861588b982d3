"""Readouts taken from the workers in batches: the requests whose responses end while a take is on its way wait
for the next one, so a server under load (every request read, as with monitors) makes one round trip per batch,
not one per request. ``hotwire_take_readouts`` hands out each tag once and only the tags asked for, so one answer
serves every request of the batch (``readout_results.readout_of`` picks its tag).

A take is a ``collective_rpc``: the engine core serves it between two steps and waits for the workers' answer
meanwhile, so takes start at most once every :data:`MIN_INTERVAL_S` (a take after a quiet spell goes at once):
under load the responses ending in that time share one take instead of each pausing the engine again."""

from __future__ import annotations

import asyncio
from typing import Any

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError

__all__ = ["MIN_INTERVAL_S", "ReadoutTakes"]

MIN_INTERVAL_S = 0.01


class ReadoutTakes:
    def __init__(self, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.min_interval_s = min_interval_s
        self._waiting: dict[str, asyncio.Future[list[dict[str, Any]]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_start = float("-inf")  # the loop's time when the last take started

    async def take(self, engine: HotwireEngine, tag: str) -> list[dict[str, Any]]:
        """Every worker's answer to a take that includes ``tag`` (:meth:`HotwireEngine.take_readouts`)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[tag] = future
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run(engine))
        return await future

    async def _run(self, engine: HotwireEngine) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            # responses ending in this turn of the loop, or before the interval since the last take is up, join
            await asyncio.sleep(max(0.0, self._last_start + self.min_interval_s - loop.time()))
            self._last_start = loop.time()
            batch, self._waiting = self._waiting, {}
            try:
                answers = await engine.take_readouts(list(batch))
            except HotwireError as exc:
                for future in batch.values():
                    if not future.done():
                        future.set_exception(exc)
                continue
            for future in batch.values():
                if not future.done():  # (a request whose client left has cancelled its wait)
                    future.set_result(answers)
