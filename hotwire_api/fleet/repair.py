"""A Redis that restarted or lost hotwire's keys: every replica puts back what it knows, and changes wait for it.

Redis may come back with older data than it acknowledged: restarted from an RDB snapshot, a restored backup, an
append-only file whose last second (``appendfsync everysec``) an OS crash lost, or wiped. Acting on that data
would lose acknowledged changes and give a version number twice (``id@2`` naming other bytes). So the register
and delete scripts refuse while the running Redis process is not the one whose data the fleet confirmed (the
restart gate, ``lua``), and each replica's follower, at its once-a-second look at the gate (:meth:`Repair.check`),
puts back what it knows that Redis lacks (:meth:`Repair.put_back`): the current versions its engine holds that
Redis never numbered, the deletions it applied of versions Redis still has current, and for every id it knows
the numbering (``last_version``) raised to the highest version it knows, and the floor above which every id is
numbered raised to the highest version of the ids it forgot (``Standing.note``). Each of those is one script
(``lua.RECONCILE``, ``lua.RAISE_FLOOR``), atomic, and keeps whatever Redis knows of an id that is as new or
newer, so replicas may repair in any order and a late or repeated repair changes nothing that is right. The
replica then marks itself repaired; the gate opens once every live replica (one that heartbeats) has, after a
settle time (``FleetConfig.restart_settle_s``) that lets every live replica heartbeat first, or after
``FleetConfig.restart_limit_s`` whatever is missing (a warning names who). A register or delete that meets the
closed gate waits for it a few seconds (``RedisRegistry``), then answers 503 with ``Retry-After``.

So nothing a live replica's follower had applied is lost or numbered again. What no live replica knew (every
replica was down for it, or a change Redis lost before any follower read it, within milliseconds of its answer)
is lost, as are versions retired after the data Redis came back with (they stay usable where they are held).
So is a deletion older than the last ``FleetConfig.history_kept`` deletions every replica saw: a Redis restored
from a backup that old serves that id's version again (its number is never given to other bytes).
"""

from __future__ import annotations

import logging

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.fleet import blobs
from hotwire_api.fleet.standing import Standing

__all__ = ["Repair"]

logger = logging.getLogger(__name__)


class Repair:
    """The follower's side of a restart: ``run_id``, the Redis process it last looked at."""

    def __init__(self, replica: Standing):
        self.replica = replica
        self.run_id: str | None = None

    async def check(self, engine: HotwireEngine) -> bool:
        """Look at the gate; put back what this replica knows when Redis restarted since the last look, or when
        the gate waits for this replica (a restart or wipe it has not repaired for: a wipe keeps the run id), then
        mark it repaired. Returns whether it repaired (the follower then checks its stream position)."""
        r = self.replica
        gate = await r.do(r.registry.gate(r.replica_id))
        restarted = self.run_id is not None and gate.run_id != self.run_id
        if not restarted and (gate.open or gate.mark == gate.closing):
            self.run_id = gate.run_id
            return False
        if self.run_id is None:
            logger.info("hotwire: the vector registry at %s waits for its replicas to confirm its data (it is new, "
                        "restarted or lost hotwire's keys); changes resume once they have", r.registry.display_url)
        else:
            logger.error("hotwire: the vector registry at %s restarted or lost hotwire's keys: registrations and "
                         "deletions wait while the replicas put back what it may have lost; this replica keeps "
                         "serving the vectors it holds", r.registry.display_url)
        await self.put_back(engine)
        self.run_id = gate.run_id  # only now: a repair that failed (the engine or Redis did not answer) is redone
        if not gate.open and await r.do(r.registry.mark_repaired(r.replica_id, gate.closing)):
            await r.do(r.registry.gate(r.replica_id))  # opens it when this replica was the last one
        return True

    async def put_back(self, engine: HotwireEngine) -> None:
        """Put back into Redis what this replica knows and Redis lacks (see the module docstring). Redis is read
        first, so only what may be missing is exported from the engine and sent, and each script decides
        atomically; what is skipped stays right whatever other replicas put back meanwhile, as ``last_version``
        only grows and a version becomes current only above it."""
        r = self.replica
        held = {m.id: m for m in await engine.vectors()}
        remote = await r.do(r.registry.current())
        last, floor = await r.do(r.registry.last_versions())
        if floor < r.floor:
            await r.do(r.registry.raise_floor(r.floor))
        versions = deletions = 0
        ids = set(held) | r.known_ids()
        for vector_id in sorted(ids):
            known, deleted = r.known(vector_id)
            meta, numbered = held.get(vector_id), last.get(vector_id, 0)
            done = 0  # the version the reconcile below raised the numbering to
            if meta is not None and not (deleted and known >= meta.version):
                if numbered < meta.version:
                    versions += await self._put_version(engine, vector_id, meta.version)
                    done = meta.version
            elif deleted and (numbered < known or (numbered == known and vector_id in remote)):
                # also when Redis lacks it now: another replica may put back that version meanwhile
                deletions += await r.do(r.registry.reconcile(vector_id, "delete", known))
                done = known
            top = max(known, meta.version if meta is not None else 0)
            if done < top and numbered < top:
                await r.do(r.registry.reconcile(vector_id, "floor", top))
        if versions or deletions:
            r.seeded += versions + deletions
            r.reset_seen = True
            logger.warning("hotwire: put %d version(s) and %d deletion(s) this replica had applied back into the "
                           "vector registry at %s", versions, deletions, r.registry.display_url)
        else:
            logger.info("hotwire: the vector registry at %s lacks nothing this replica knows (%d ids)",
                        r.registry.display_url, len(ids))

    async def _put_version(self, engine: HotwireEngine, vector_id: str, version: int) -> int:
        """Put back one current version the engine holds: its bytes from the engine, its blob, the reconcile."""
        r = self.replica
        try:
            meta, payload = await engine.export(vector_id, version)
        except HotwireError as exc:
            if exc.status != 404:
                raise
            return 0  # deleted meanwhile
        await r.do(r.registry.put_blob(meta.sha256, blobs.encode(payload)))
        return int(await r.do(r.registry.reconcile(vector_id, "register", version, meta.sha256)))
