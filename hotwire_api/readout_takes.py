"""Readouts taken from the workers in batches: the requests whose responses end while a take is on its way wait
for the next one, so a server under load (every request read, as with monitors) makes one round trip per batch,
not one per request. ``hotwire_take_readouts`` hands out each tag once and only the tags asked for, so one answer
serves every request of the batch (``readout_results.readout_of`` picks its tag).

A take is a ``collective_rpc``: the engine core serves it between two steps and waits for the workers' answer
meanwhile, so takes start at most once every :data:`MIN_INTERVAL_S` (a take after a quiet spell goes at once):
under load the responses ending in that time share one take instead of each pausing the engine again. Nor does a
worker wait for the device: under load the last values of a request that just ended come with the forward the
engine core runs meanwhile, so a take asks without waiting, a worker whose values are not all there answers
``pending`` (handing out nothing), and the take asks those workers again every :data:`RETRY_S`, waiting only after
:data:`WAIT_AFTER_S` (whatever an engine that stopped stepping holds)."""

from __future__ import annotations

import asyncio
from typing import Any

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_core.error_codes import ErrorCode

__all__ = ["MIN_INTERVAL_S", "RETRY_S", "ReadoutTakes", "WAIT_AFTER_S"]

MIN_INTERVAL_S = 0.01
RETRY_S = 0.002
WAIT_AFTER_S = 0.05


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
                answers = await _take_all(engine, list(batch))
            except HotwireError as exc:
                for future in batch.values():
                    if not future.done():
                        future.set_exception(exc)
                continue
            for future in batch.values():
                if not future.done():  # (a request whose client left has cancelled its wait)
                    future.set_result(answers)


async def _take_all(engine: HotwireEngine, tags: list[str]) -> list[dict[str, Any]]:
    """Every worker's answer to a take of ``tags``: asked without waiting, again where it was ``pending`` (a worker
    that answered keeps its answer: it has handed its values out), and waiting from :data:`WAIT_AFTER_S` on."""
    loop = asyncio.get_running_loop()
    began, final = loop.time(), None
    while True:
        answers = await engine.take_readouts(tags, wait=loop.time() - began >= WAIT_AFTER_S)
        final = final or [None] * len(answers)
        if len(answers) != len(final):
            raise HotwireError(502, ErrorCode.BAD_ENGINE_RESULT, f"a readout take was answered by {len(final)} "
                               f"workers, then by {len(answers)}")
        final = [kept or (None if answer.get("pending") else answer) for kept, answer in zip(final, answers)]
        if all(final):
            return final
        await asyncio.sleep(RETRY_S)
