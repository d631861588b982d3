"""A replica's standing with the fleet's registry, shared by its jobs (``changes``, ``follower``, ``heartbeat``,
``repair``): whether the registry answers, the newest version of each id this replica applied or saw deleted, and
how far its follower got."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hotwire_api.engine import HotwireEngine
from hotwire_api.fleet.redis_registry import RedisRegistry, Unavailable
from hotwire_core.version_history import fold_oldest, note_newest

__all__ = ["EngineGetter", "Standing"]

logger = logging.getLogger(__name__)

EngineGetter = Callable[[], "HotwireEngine | None"]


class Standing:
    """``engine()``: the engine to apply changes to (None while it is not up); ``follows``: this process runs the
    follower and the heartbeat (one per replica)."""

    def __init__(
        self, registry: RedisRegistry, engine: EngineGetter, replica_id: str, url: str | None = None, follows: bool = True
    ):
        self.registry = registry
        self.engine = engine
        self.replica_id = replica_id
        self.url = url
        self.follows = follows
        self.position: str | None = None  # the last stream entry applied (None: resync first)
        self.reachable: bool | None = None  # None: not asked yet
        self.error: str | None = None
        self.reconnected = False  # the registry answers again after it did not: the follower checks its position
        self.last_contact = -1e9
        self.reset_seen = False  # the registry came back without something this replica had applied
        self.seeded = 0  # versions and deletions this replica put back into a registry that lost them
        self.events_applied = 0
        self.resyncs = 0
        self.started_at = time.time()
        # The versions this process knows (``note``): id -> the newest version it applied, for ids whose newest was
        # not deleted; id -> the version deleted, for the last ``history_kept`` deleted ones, oldest first; older
        # deletions only raise ``floor`` (the fleet's numbering goes on above it: ``Changes.register``, ``repair``).
        self.applied: dict[str, int] = {}
        self.deleted: dict[str, int] = {}
        self.floor = 0
        # Set to end the follower after its current read and the heartbeat after its current write: redis-py 8.1
        # can swallow a cancellation that arrives during a command (a blocking XREAD; a SET), so the
        # tasks are stopped this way, cancelled only when they do not end (``Replica.stop_tasks``). ``wake`` ends
        # their pauses at once.
        self.stopping = False
        self.wake = asyncio.Event()

    # -- reachability ------------------------------------------------------------------------------------------

    def _contact(self) -> None:
        if self.reachable is False:
            logger.warning("hotwire: the vector registry at %s answers again", self.registry.display_url)
            self.reconnected = True
        self.reachable, self.error, self.last_contact = True, None, time.monotonic()
        _gauge(1)

    def _lost(self, exc: Unavailable) -> None:
        if self.reachable is not False:
            logger.error("hotwire: %s", exc.message)
        self.reachable, self.error = False, exc.message
        _gauge(0)

    async def do(self, coro: Awaitable[Any]) -> Any:
        """Run one registry command, noting whether the registry answered."""
        try:
            result = await coro
        except Unavailable as exc:
            self._lost(exc)
            raise
        self._contact()
        return result

    # -- the versions this replica knows -----------------------------------------------------------------------

    def note(self, vector_id: str, version: int, deleted: bool = False) -> None:
        """``vector_id`` had ``version`` (applied, or ``deleted``): remembered if newer than what is known, a
        deletion winning at the same version."""
        known, was_deleted = self.known(vector_id)
        if version < known or (version == known and (was_deleted or not deleted)):
            return
        self.applied.pop(vector_id, None)
        self.deleted.pop(vector_id, None)
        if not deleted:
            self.applied[vector_id] = version
            return
        note_newest(self.deleted, vector_id, version)
        excess = len(self.deleted) - self.registry.config.history_kept
        self.floor = max(self.floor, fold_oldest(self.deleted, excess, lambda _: False))

    def known(self, vector_id: str) -> tuple[int, bool]:
        """(the newest version of ``vector_id`` this process applied or saw deleted, whether that was a deletion);
        (0, False) for one it never knew or forgot."""
        if vector_id in self.deleted:
            return self.deleted[vector_id], True
        return self.applied.get(vector_id, 0), False

    def known_ids(self) -> set[str]:
        return set(self.applied) | set(self.deleted)

    def known_version(self, vector_id: str) -> int:
        """What a registration of ``vector_id`` numbers above: its newest known version, or the floor."""
        return max(self.known(vector_id)[0], self.floor)

    # -- progress and pauses -----------------------------------------------------------------------------------

    def progress(self) -> dict[str, Any]:
        """The follower's progress, as ``/steer/slots`` and the heartbeat report it."""
        return {"position": self.position, "events_applied": self.events_applied, "resyncs": self.resyncs,
                "reset": self.reset_seen, "seeded": self.seeded}

    async def pause(self, seconds: float) -> None:
        """Sleep, unless the tasks are being stopped."""
        try:
            await asyncio.wait_for(self.wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass


def _gauge(value: int) -> None:
    from hotwire_api.stats_cache import STATS

    STATS.registry_reachable = value
    if STATS.series is not None:
        STATS.series.registry(value)
