"""One replica of a fleet: its jobs (``changes``: registration and deletion through the registry; ``follower``:
applying every replica's changes to this replica's engine cores; ``heartbeat``: its heartbeat and the fleet view)
over the state they share, started and stopped together, and the catch-up before its API server takes requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from hotwire_api.catalog import CATALOG
from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.fleet.changes import Changes
from hotwire_api.fleet.follower import Follower
from hotwire_api.fleet.heartbeat import Heartbeat
from hotwire_api.fleet.redis_registry import RedisRegistry
from hotwire_api.fleet.standing import EngineGetter, Standing

__all__ = ["CATCH_UP_S", "Replica"]

logger = logging.getLogger(__name__)

CATCH_UP_S = 120.0  # the longest an API server's startup waits for its replica to catch up with the registry


async def _refresh_catalog(engine: HotwireEngine) -> None:
    """After the follower changed the engine: this API server's next request sees it."""
    try:
        await CATALOG.refresh(engine, not_before=time.monotonic())
    except HotwireError:
        pass  # the background refresh catches up


class Replica(Standing):
    """This replica's side of the registry (``Standing`` names the arguments) and its jobs."""

    def __init__(
        self,
        registry: RedisRegistry,
        engine: EngineGetter,
        replica_id: str,
        url: str | None = None,
        follows: bool = True,
        on_change: Callable[[HotwireEngine], Awaitable[None]] = _refresh_catalog,
    ):
        super().__init__(registry, engine, replica_id, url, follows)
        self.changes = Changes(self)
        self.follower = Follower(self, on_change)
        self.heartbeat = Heartbeat(self)

    def start_tasks(self, heartbeat: bool = True) -> list[asyncio.Task[None]]:
        """Start the follower (and the heartbeat); :meth:`stop_tasks` ends them."""
        self.stopping = False
        self.wake = asyncio.Event()
        tasks = [asyncio.create_task(self.follower.follow())]
        if heartbeat:
            tasks.append(asyncio.create_task(self.heartbeat.run()))
        return tasks

    async def stop_tasks(self, tasks: list[asyncio.Task[None]]) -> None:
        """End the tasks :meth:`start_tasks` started: each at the end of the command it is in (the follower's
        read: up to ``block_ms``), then whatever is left is cancelled; one that outlives that too is named in a
        warning."""
        self.stopping = True
        self.wake.set()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.follower.block_ms / 1000 + self.registry.config.timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            _, left = await asyncio.wait(pending, timeout=1.0)
            if left:
                logger.warning("hotwire: %d fleet task(s) of replica %s did not stop (%s)", len(left),
                               self.replica_id, ", ".join(t.get_coro().__qualname__ for t in left))

    async def catch_up(self, timeout_s: float = CATCH_UP_S) -> None:
        """Before this API server takes requests (its app's startup; vLLM's ``/health`` answers only after it):
        the follower's first sync, or, in another API server of the replica, a wait until the engine holds every
        current version of the registry. So a replica that starts or restarts behind a load balancer never
        answers "unknown steering vector" for one the fleet has. A registry that does not answer is not waited
        for (the follower catches up once it does), nor one that takes longer than ``timeout_s``."""
        engine = self.engine()
        if engine is None:
            return
        started = time.monotonic()
        try:
            await asyncio.wait_for(self.follower.sync(engine) if self.follows else self._engine_holds_registry(engine),
                                   timeout_s)
            logger.info("hotwire: caught up with the vector registry in %.2f s", time.monotonic() - started)
        except (HotwireError, asyncio.TimeoutError) as exc:
            reason = exc.message if isinstance(exc, HotwireError) else f"not within {timeout_s:.0f} s"
            logger.warning("hotwire: taking requests before catching up with the vector registry (%s); the "
                           "vectors it holds follow", reason)

    async def _engine_holds_registry(self, engine: HotwireEngine) -> None:
        while True:
            remote = await self.do(self.registry.current())
            held = {m.id: m.version for m in await engine.vectors()}
            if all(held.get(vector_id, 0) >= version for vector_id, (version, _) in remote.items()):
                return
            await asyncio.sleep(0.05)
