"""What the fleet sees of itself: each replica's heartbeat in the registry (its slots, pinned rows, refusals, the
vector versions it holds and the key schema it runs), the registry section of ``/steer/slots`` and the
``/steer/fleet`` view built from every live replica's heartbeat. A replica that sees a live one of another key
schema (a rolling upgrade across a change of it) says so in an error, once for each."""

from __future__ import annotations

import itertools
import logging
import os
import time
import traceback
from typing import Any

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.fleet.config import SCHEMA, scrubbed
from hotwire_api.fleet.redis_registry import Unavailable
from hotwire_api.fleet.standing import Standing
from hotwire_api.models import FleetVector, HeldVector, PinnedRow, ReplicaSlots, ReplicaState

__all__ = ["SCHEMA_CHECK_EVERY", "Heartbeat"]

logger = logging.getLogger(__name__)

SCHEMA_CHECK_EVERY = 30  # heartbeats between two looks at the other replicas' key schemas


class Heartbeat:
    """This replica's heartbeat and the fleet view."""

    def __init__(self, replica: Standing):
        self.replica = replica
        self.told: set[tuple[str, str]] = set()  # (replica, repr of its schema) already named in an error

    async def state(self, engine: HotwireEngine) -> dict[str, Any]:
        """This replica's heartbeat: slot statistics, pinned rows and the vector versions it holds."""
        r = self.replica
        stats = await engine.stats()
        vectors = await engine.vectors()
        return {
            "replica": r.replica_id, "url": r.url, "pid": os.getpid(), "started_at": r.started_at, "schema": SCHEMA,
            "sent_at": time.time(), **r.progress(),
            "slots": ReplicaSlots.of(stats).model_dump(),
            "refused": stats.refused,
            "pinned_rows": [PinnedRow.of(row).model_dump() for row in stats.rows if row.refcount > 0],
            "vectors": [HeldVector.of(m).model_dump() for m in vectors],
        }

    async def run(self) -> None:
        """Put this replica's state in the registry every ``heartbeat_s`` until stopped; it expires after three."""
        r = self.replica
        interval = r.registry.config.heartbeat_s
        for beat in itertools.count():
            if r.stopping:
                return
            engine = r.engine()
            if engine is not None:
                try:
                    await r.do(r.registry.heartbeat(r.replica_id, await self.state(engine), 3 * interval))
                    if beat % SCHEMA_CHECK_EVERY == 1:  # (the second beat: the others have had one interval)
                        await self.check_schemas()
                except Unavailable:
                    pass
                except HotwireError as exc:
                    logger.debug("hotwire: heartbeat skipped: %s", exc.message)
                except Exception:  # anything else must not end the heartbeats: the gate waits for live replicas
                    logger.error("hotwire: a heartbeat failed; the next in %.2f s\n%s", interval,
                                 scrubbed(traceback.format_exc(), r.registry.url))
            await r.pause(interval)

    async def check_schemas(self) -> None:
        """Name each live replica of another key schema in an error, once: two schemas on one Redis can give a
        version number out twice or bring a deleted vector back (a heartbeat that is not hotwire's is skipped)."""
        r = self.replica
        others = {(str(b.get("replica")), repr(b.get("schema"))) for b in await r.do(r.registry.replicas())}
        for name, schema in sorted(others):
            if schema != repr(SCHEMA) and name != r.replica_id and (name, schema) not in self.told:
                self.told.add((name, schema))
                logger.error("hotwire: replica %s runs another hotwire (its fleet key schema %s, this one's %d) on the "
                             "vector registry at %s: upgrade every replica of a fleet together (docs/fleet.md), as "
                             "mixed schemas can number a version twice or bring a deleted vector back", name,
                             "none" if schema == "None" else schema, SCHEMA, r.registry.display_url)

    async def status(self) -> dict[str, Any]:
        """What ``/steer/slots`` says of the registry. An API server without the follower reports the follower's
        progress from this replica's last heartbeat (a GET, which also tells whether Redis answers)."""
        r = self.replica
        progress = r.progress()
        if not r.follows:
            try:
                beat = await r.do(r.registry.replica_state(r.replica_id))
                progress = {k: beat.get(k, v) for k, v in progress.items()} if beat else progress
            except Unavailable:
                pass
        elif time.monotonic() - r.last_contact > 2 * r.registry.config.heartbeat_s:
            try:
                await r.do(r.registry.ping())
            except Unavailable:
                pass
        return {"kind": "redis", "url": r.registry.display_url, "reachable": bool(r.reachable),
                "error": r.error, "replica": r.replica_id, **progress}

    async def view(self) -> dict[str, Any]:
        """``GET /steer/fleet``: the registry, every live replica and the versions each one holds."""
        r = self.replica
        remote = await r.do(r.registry.current())
        now, replicas = time.time(), []
        for beat in await r.do(r.registry.replicas()):
            try:  # a heartbeat this hotwire cannot read (another's, or not hotwire's) is left out of the view
                beat["age_ms"] = round(1000 * max(0.0, now - float(beat.get("sent_at") or now)), 1)
                state = ReplicaState.model_validate({**beat, "in_sync": False})
            except (ValueError, TypeError):
                continue
            beat["in_sync"] = {v.id: v.version for v in state.vectors} == {vid: v for vid, (v, _) in remote.items()}
            replicas.append(beat)
        replicas.sort(key=lambda beat: beat["replica"])
        vectors = []
        for vector_id, (version, sha) in sorted(remote.items()):
            holders = [beat["replica"] for beat in replicas
                       if any(v["id"] == vector_id and v["version"] == version for v in beat.get("vectors") or [])]
            vectors.append(FleetVector(id=vector_id, version=version, sha256=sha, held_by=holders,
                                       missing_on=[beat["replica"] for beat in replicas
                                                   if beat["replica"] not in holders]).model_dump())
        return {"registry": await self.status(), "vectors": vectors, "replicas": replicas}
