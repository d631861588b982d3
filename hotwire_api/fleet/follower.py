"""The follower: applies every replica's changes to this replica's engine cores.

It runs in the first API server of each replica (``is_first_api_server``), tails the stream with a blocking
``XREAD`` from the last entry it applied and hands each event to the engine cores with its version; an event for a
version the engine holds changes nothing, and the registry orders versions (an older one arriving late is only
retained), so applying an event twice or late is harmless. A version the fleet retired (replaced or deleted) that
this replica never held is held as retired for the rest of its retention, so a request pinned to it is served on
every replica alike. It resyncs from the registry at start (before the API server takes requests:
``Replica.catch_up``), and after a reconnect or a Redis restart when the stream no longer holds the entry at its
position (trimmed, or Redis came back with older data): it registers what it lacks and deletes what Redis no
longer has. A Redis that restarted or lost hotwire's keys first gets back what this replica knows (``repair``). A
registry that does not answer is retried with backoff; meanwhile the engine serves every vector it holds.
Once a minute it also deletes the blobs no current version has used for ``HOTWIRE_REGISTRY_BLOB_GRACE_S``
(replaced, deleted, or the loser's of a 409; an event older than that whose blob is gone is skipped, as a later
event superseded it) and forgets the retired versions whose retention is over.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Awaitable, Callable

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.fleet import blobs
from hotwire_api.fleet.config import scrubbed
from hotwire_api.fleet.redis_registry import Event, Unavailable
from hotwire_api.fleet.repair import Repair
from hotwire_api.fleet.standing import Standing
from hotwire_core.error_codes import ErrorCode

__all__ = ["Follower"]

logger = logging.getLogger(__name__)


class Follower:
    """``on_change(engine)``: called after the engine's current versions changed (the API server refreshes its
    catalog copy)."""

    def __init__(self, replica: Standing, on_change: Callable[[HotwireEngine], Awaitable[None]]):
        self.replica = replica
        self._on_change = on_change
        self.repair = Repair(replica)
        self._gate_checked = -1e9
        # The stream position at the end of the last sync: events read after it may come from a Redis that lost it
        # (a replica's put-back after a wipe), so a repair judges the loss by this one.
        self._synced_at: str | None = None
        self._collected = time.monotonic()  # the first collection a while after start
        self._tracked = False  # whether the first collection counted an earlier hotwire's deleted ids (track_deleted)
        self.collect_every_s = 60.0
        self.block_ms = 1000
        self.batch = 256  # events read at once

    async def follow(self) -> None:
        """Apply the registry's events to the engine until stopped (see the module docstring)."""
        r = self.replica
        backoff = 0.05
        while not r.stopping:
            engine = r.engine()
            if engine is None:
                await r.pause(0.5)
                continue
            try:
                await self.sync(engine)
                events = await r.do(r.registry.read_events(r.position or "0-0", self.block_ms, self.batch))
                if await self._apply_all(engine, events):
                    await self._on_change(engine)
                await self.collect()
                backoff = 0.05
            except Unavailable:
                await r.pause(backoff)
                backoff = min(2 * backoff, 2.0)
            except HotwireError as exc:  # the engine did not answer: the same events again later
                logger.warning("hotwire: the fleet follower waits for the engine: %s", exc.message)
                await r.pause(0.5)
            except Exception:  # anything else must not end the follower: log it and go on from where it was
                logger.error("hotwire: the fleet follower failed; retrying in 1 s\n%s",
                             scrubbed(traceback.format_exc(), r.registry.url))
                await r.pause(1.0)

    async def collect(self) -> None:
        """Every ``collect_every_s``: delete the blobs no current version has used for the grace period
        (``HOTWIRE_REGISTRY_BLOB_GRACE_S``), and forget the retired versions whose retention is over; the first
        time, also count the deleted ids an earlier hotwire left in the numbering (``track_deleted``). Every
        follower does it; the registry's scripts make that safe."""
        if time.monotonic() - self._collected < self.collect_every_s:
            return
        self._collected = time.monotonic()
        r = self.replica
        if not self._tracked:
            added = await r.do(r.registry.track_deleted())
            self._tracked = added is not None  # (None: the restart gate was closed; the next collection again)
            if added:
                logger.info("hotwire: the vector registry's numbering now tracks %d deleted id(s) it kept from "
                            "before, forgetting the oldest past %d", added, r.registry.config.history_kept)
        deleted = await r.do(r.registry.collect_blobs(r.registry.config.blob_grace_s))
        if deleted:
            logger.info("hotwire: collected %d blob(s) no current vector version uses from the registry", deleted)
        while await r.do(r.registry.forget_retired(time.time() - r.registry.config.retain_s)) >= 1000:
            pass  # a backlog: the script forgets 1000 at a time

    async def sync(self, engine: HotwireEngine) -> None:
        """Once a second, the restart gate (``repair``: a Redis that restarted or lost hotwire's keys gets back
        what this replica knows); then a resync when needed: at start, and after a reconnect or a repair when the
        stream no longer holds this replica's position (trimmed while it was away, or Redis came back with older
        data)."""
        r = self.replica
        if r.position is not None and not r.reconnected and time.monotonic() - self._gate_checked < 1.0:
            return
        repaired = await self.repair.check(engine)
        self._gate_checked = time.monotonic()
        if r.position is not None:
            reconnected, r.reconnected = r.reconnected, False
            judged = self._synced_at if repaired and self._synced_at not in (None, "0-0") else r.position
            if not (reconnected or repaired) or await r.do(r.registry.covers(judged)):
                self._synced_at = r.position
                return  # caught up from the stream: no reload
            if repaired:
                r.reset_seen = True
                logger.error("hotwire: the vector registry at %s came back without events this replica had "
                             "applied (older data, or none): it resyncs", r.registry.display_url)
        await self.resync(engine)
        self._synced_at = r.position

    async def resync(self, engine: HotwireEngine) -> None:
        """Make the engine hold the registry's current versions and the versions retired within the retention:
        register what it lacks, and delete what the registry no longer has. The engine is read
        first, then the stream's position, then the registry, so nothing registered meanwhile is deleted and
        nothing is skipped (what the stream repeats changes nothing)."""
        r = self.replica
        local = {m.id: (m.version, m.sha256) for m in await engine.vectors()}
        position = await r.do(r.registry.last_event_id())
        remote = await r.do(r.registry.current())
        retired = await r.do(r.registry.retired_since(time.time() - r.registry.config.retain_s))
        changed = False
        for vector_id, (version, sha) in remote.items():
            held = local.get(vector_id)
            if held is not None and held[0] >= version:
                if held[0] > version or held[1] != sha:
                    logger.error("hotwire: this engine holds %s@%d (%s) but the registry's current version is "
                                 "%d (%s): it keeps its own", vector_id, held[0], held[1][:12], version, sha[:12])
                r.note(vector_id, held[0])
                continue
            changed |= await self._register_event(engine, vector_id, version, sha)
        for vector_id, (version, _) in local.items():
            if vector_id not in remote:
                await engine.unregister(vector_id, version)
                r.note(vector_id, version, deleted=True)
                changed = True
        held_retired = 0
        for (vector_id, version), (sha, at) in retired.items():
            if local.get(vector_id, (0, ""))[0] != version:
                await self._register_event(engine, vector_id, version, sha, retired_at=at)
                held_retired += 1
        r.position = position
        r.resyncs += 1
        logger.info("hotwire: synced with the vector registry at %s (%d vectors, %d retired versions within "
                    "their retention, stream at %s)", r.registry.display_url, len(remote), held_retired, position)
        if changed:
            await self._on_change(engine)

    async def _apply_all(self, engine: HotwireEngine, events: list[Event]) -> bool:
        """Apply events in order; returns whether the engine's current versions changed. A registration that a
        later event of the same batch supersedes is held as a retired version from the moment the fleet retired
        it (or not at all when its retention is over): after a long gap, versions long gone are not fetched."""
        last = {event.vector_id: i for i, event in enumerate(events)}
        changed = False
        for i, event in enumerate(events):
            if event.op == "register" and last[event.vector_id] != i:
                await self._register_retired(engine, event.vector_id, event.version)
            else:
                changed |= await self._apply(engine, event)
            self.replica.position = event.stream_id
            self.replica.events_applied += 1
        return changed

    async def _apply(self, engine: HotwireEngine, event: Event) -> bool:
        """One event; returns whether it changed the engine's current versions."""
        if event.op == "register":
            version, deleted = self.replica.known(event.vector_id)
            if event.version > version:
                return await self._register_event(engine, event.vector_id, event.version, event.sha256)
            if event.version < version or deleted:  # a newer version or its deletion came first (this replica's own)
                await self._register_retired(engine, event.vector_id, event.version)
            return False  # else applied already (this replica registered it)
        if event.op == "delete":
            self.replica.note(event.vector_id, event.version, deleted=True)
            await engine.unregister(event.vector_id, event.version)
            return True
        logger.warning("hotwire: unknown registry event %r ignored", event.op)
        return False

    async def _register_retired(self, engine: HotwireEngine, vector_id: str, version: int) -> None:
        """Hold a version the fleet retired (replaced or deleted) for the rest of its retention, so a request
        pinned to it is served here as on the replicas that held it; nothing when it was never retired or its
        retention is over."""
        r = self.replica
        retired = await r.do(r.registry.retired_version(vector_id, version))
        if retired is not None and time.time() - retired[1] < r.registry.config.retain_s:
            await self._register_event(engine, vector_id, version, retired[0], retired_at=retired[1])

    async def _register_event(
        self, engine: HotwireEngine, vector_id: str, version: int, sha: str, retired_at: float | None = None
    ) -> bool:
        r = self.replica
        blob = await r.do(r.registry.get_blob(sha))
        if blob is None:
            live = await r.do(r.registry.current_version(vector_id))
            if live is None or live[0] > version:  # superseded long ago: its blob was collected; a later event follows
                logger.info("hotwire: %s@%d is no longer current and its blob was collected: skipped", vector_id, version)
            else:
                logger.error("hotwire: the registry has no blob for %s@%d (%s): skipped", vector_id, version, sha[:12])
            return False
        try:
            payload = blobs.decode(blob)
        except ValueError as exc:
            logger.error("hotwire: the registry's blob for %s@%d is unreadable (%s): skipped", vector_id, version, exc)
            return False
        try:
            _, meta = await engine.register(vector_id, payload, True, version, retired_at)
        except HotwireError as exc:
            if exc.code == ErrorCode.ENGINE_UNAVAILABLE:
                raise
            if exc.code == ErrorCode.VERSION_GONE:  # a retired version whose retention ended meanwhile: nothing to hold
                logger.info("hotwire: %s@%d not held: %s", vector_id, version, exc.message)
            else:
                logger.error("hotwire: this engine refused %s@%d from the registry: %s", vector_id, version, exc.message)
            return False
        if meta.sha256 != sha:
            logger.error("hotwire: %s@%d decoded to %s, not the registry's %s", vector_id, version, meta.sha256[:12], sha[:12])
        if retired_at is not None:
            return False
        r.note(vector_id, version)
        return True
