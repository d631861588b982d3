"""Readouts taken from the workers in batches: the requests whose responses end while a take is on its way wait
for the next one, so a server under load (every request read, as with monitors) makes one round trip per batch,
not one per request. ``hotwire_take_readouts`` hands out each tag once and only the tags asked for, so one answer
serves every request of the batch (``readout_results.readout_of`` picks its tag)."""

from __future__ import annotations

import asyncio
from typing import Any

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError

__all__ = ["ReadoutTakes"]


class ReadoutTakes:
    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[list[dict[str, Any]]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def take(self, engine: HotwireEngine, tag: str) -> list[dict[str, Any]]:
        """Every worker's answer to a take that includes ``tag`` (:meth:`HotwireEngine.take_readouts`)."""
        future = asyncio.get_running_loop().create_future()
        self._waiting[tag] = future
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run(engine))
        return await future

    async def _run(self, engine: HotwireEngine) -> None:
        while self._waiting:
            await asyncio.sleep(0)  # responses ending in this turn of the loop join the batch
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
