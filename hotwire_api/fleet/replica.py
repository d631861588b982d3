"""One replica of a fleet: registration and deletion through the registry, the follower that applies every
replica's changes to this replica's engine cores, the heartbeat, and the fleet view.

Registration (``POST /steer/vectors``, any API server of any replica): the upload is checked against the model
here (``blobs.check``: the engine's own checks), its blob stored under its content hash, then one Lua script
makes it the id's next version (or answers 409) and appends the event; only then do this replica's engine cores
get it, with that version. So Redis never names a vector an engine would refuse, and an engine never holds a
version Redis did not give. Should the local engine fail after Redis accepted, the answer is still the
registration (it is durable and numbered); the follower applies it once the engine answers.

The follower (the first API server of each replica: ``is_first_api_server``) tails the stream with a blocking
``XREAD`` from the last entry it applied and hands each event to the engine cores with its version; an event
for a version the engine holds changes nothing, and the registry orders versions (an older one arriving late
is only retained), so applying an event twice or late is harmless. A version the fleet retired (replaced or
deleted) that this replica never held is held as retired for the rest of its retention, so a request pinned to
it is served on every replica alike. It resyncs from the registry at start (before the API server takes
requests: ``catch_up``), and after a reconnect or a Redis restart when the stream no longer holds the entry at
its position (trimmed, or Redis came back with older data): it registers what it lacks and deletes what Redis
no longer has. A Redis that restarted or lost hotwire's keys first gets back what this replica knows
(``repair``). A registry that does not answer is retried with backoff; meanwhile the engine serves every vector
it holds.
Once a minute it also deletes the blobs no current version has used for ``HOTWIRE_REGISTRY_BLOB_GRACE_S``
(replaced, deleted, or the loser's of a 409; an event older than that whose blob is gone is skipped, as a later
event superseded it) and forgets the retired versions whose retention is over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from hotwire_api.catalog import CATALOG, rules_of
from hotwire_api.codec import VectorPayload
from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.fleet import blobs
from hotwire_api.fleet.config import FleetConfig, Keys, default_replica_name, scrubbed
from hotwire_api.fleet.redis_registry import Event, RedisRegistry, Unavailable
from hotwire_api.fleet.repair import Repair
from hotwire_api.models import VectorMeta
from hotwire_core.admission import Rules
from hotwire_core.vllm_glue.api_server import is_first_api_server

__all__ = ["FLEET", "Fleet", "Replica"]

logger = logging.getLogger(__name__)

EngineGetter = Callable[[], "HotwireEngine | None"]
CATCH_UP_S = 120.0  # the longest an API server's startup waits for its replica to catch up with the registry


async def _refresh_catalog(engine: HotwireEngine) -> None:
    """After the follower changed the engine: this API server's next request sees it."""
    try:
        await CATALOG.refresh(engine, not_before=time.monotonic())
    except HotwireError:
        pass  # the background refresh catches up


class Replica:
    """This replica's side of the registry. ``engine()``: the engine to apply changes to (None while it is not
    up); ``follower``: this process runs the follower and the heartbeat (one per replica)."""

    def __init__(
        self,
        registry: RedisRegistry,
        engine: EngineGetter,
        replica_id: str,
        url: str | None = None,
        follower: bool = True,
        on_change: Callable[[HotwireEngine], Awaitable[None]] = _refresh_catalog,
    ):
        self.registry = registry
        self._engine = engine
        self.replica_id = replica_id
        self.url = url
        self.follower = follower
        self._on_change = on_change
        self.position: str | None = None  # the last stream entry applied (None: resync first)
        self.reachable: bool | None = None  # None: not asked yet
        self.error: str | None = None
        self.reset_seen = False  # the registry came back without something this replica had applied
        self.seeded = 0  # versions and deletions this replica put back into a registry that lost them
        self.events_applied = 0
        self.resyncs = 0
        self.started_at = time.time()
        self._last_contact = -1e9
        # id -> (the newest version this process applied or saw deleted, whether that was a deletion)
        self.known: dict[str, tuple[int, bool]] = {}
        self.repair = Repair(self)
        self._rules: Rules | None = None
        self._reconnected = False
        self._gate_checked = -1e9
        self._collected = time.monotonic()  # the first collection a while after start
        self.collect_every_s = 60.0
        self.block_ms = 1000
        self.batch = 256  # events read at once
        # Set to end the follower after its current read and the heartbeat after its current write: redis-py 8.1
        # has been seen to swallow a cancellation that arrives during a command (a blocking XREAD; a SET), so the
        # tasks are stopped this way, cancelled only when they do not end (``stop_tasks``). ``_wake`` ends their
        # pauses at once.
        self.stopping = False
        self._wake = asyncio.Event()

    # -- reachability ------------------------------------------------------------------------------------------

    def _contact(self) -> None:
        if self.reachable is False:
            logger.warning("hotwire: the vector registry at %s answers again", self.registry.display_url)
            self._reconnected = True
        self.reachable, self.error, self._last_contact = True, None, time.monotonic()
        _gauge(1)

    def _lost(self, exc: Unavailable) -> None:
        if self.reachable is not False:
            logger.error("hotwire: %s", exc.message)
        self.reachable, self.error = False, exc.message
        _gauge(0)

    async def do(self, coro: Awaitable[Any]) -> Any:
        try:
            result = await coro
        except Unavailable as exc:
            self._lost(exc)
            raise
        self._contact()
        return result

    def _progress(self) -> dict[str, Any]:
        """The follower's progress, as ``/steer/slots`` and the heartbeat report it."""
        return {"position": self.position, "events_applied": self.events_applied, "resyncs": self.resyncs,
                "reset": self.reset_seen, "seeded": self.seeded}

    async def status(self) -> dict[str, Any]:
        """What ``/steer/slots`` says of the registry. An API server without the follower reports the follower's
        progress from this replica's last heartbeat (a GET, which also tells whether Redis answers)."""
        progress = self._progress()
        if not self.follower:
            try:
                beat = await self.do(self.registry.replica_state(self.replica_id))
                progress = {k: beat.get(k, v) for k, v in progress.items()} if beat else progress
            except Unavailable:
                pass
        elif time.monotonic() - self._last_contact > 2 * self.registry.config.heartbeat_s:
            try:
                await self.do(self.registry.ping())
            except Unavailable:
                pass
        return {"kind": "redis", "url": self.registry.display_url, "reachable": bool(self.reachable),
                "error": self.error, "replica": self.replica_id, **progress}

    # -- registration and deletion -----------------------------------------------------------------------------

    async def _model_rules(self, engine: HotwireEngine) -> Rules:
        if self._rules is None:
            self._rules = rules_of(await engine.catalog(-1))
        return self._rules

    async def register(
        self, engine: HotwireEngine, vector_id: str, payload: VectorPayload, replace: bool
    ) -> tuple[bool, VectorMeta]:
        """Register through the registry (see the module docstring); returns (created, meta)."""
        rules = await self._model_rules(engine)
        model = rules.model
        if not model.steerable:
            raise HotwireError(503, "model_not_steerable", f"this model cannot be steered: {model.reason}")
        checked = blobs.check(payload, model.n_layers, model.hidden_size, model.dtype)
        await self.do(self.registry.put_blob(checked.sha256, blobs.encode(checked.payload)))
        status, version, previous = await self.do(
            self.registry.register(vector_id, checked.sha256, replace, floor=self._known_version(vector_id))
        )
        if status == 409:
            raise HotwireError(
                409, "exists", f"vector {vector_id!r} is already registered (version {previous[0] if previous else '?'} "
                "in the fleet's registry); register it with replace=true (hotwire register --replace) to make a new "
                "version", "id",
            )
        try:
            _, meta = await engine.register(vector_id, checked.payload, True, version)
            self._note(vector_id, version)
        except HotwireError as exc:  # registered and numbered: the follower applies it once the engine answers
            logger.error("hotwire: %s@%d is registered in the fleet but this engine did not take it yet: %s",
                         vector_id, version, exc.message)
            p = checked.payload
            meta = VectorMeta(id=vector_id, version=version, sha256=checked.sha256, dtype=p.dtype, shape=list(p.shape),
                              layers=None if p.layers is None else list(p.layers), norms=checked.norms,
                              created_at=time.time())
        return status == 201, meta

    async def unregister(self, engine: HotwireEngine, vector_id: str) -> int:
        """Delete through the registry; returns this replica's requests still using the vector."""
        deleted = await self.do(self.registry.delete(vector_id))
        if deleted is None:
            raise HotwireError(404, "unknown_vector", f"unknown steering vector {vector_id!r}", "id")
        version, _ = deleted
        self._note(vector_id, version, deleted=True)
        try:
            return await engine.unregister(vector_id, version)
        except HotwireError as exc:
            logger.error("hotwire: %s@%d is deleted in the fleet but this engine did not drop it yet: %s",
                         vector_id, version, exc.message)
            return 0

    def _note(self, vector_id: str, version: int, deleted: bool = False) -> None:
        known = self.known.get(vector_id, (0, False))
        if version > known[0] or (version == known[0] and deleted):
            self.known[vector_id] = (version, deleted)

    def _known_version(self, vector_id: str) -> int:
        return self.known.get(vector_id, (0, False))[0]

    # -- the follower ------------------------------------------------------------------------------------------

    def start_tasks(self, heartbeat: bool = True) -> list[asyncio.Task[None]]:
        """Start the follower (and the heartbeat); :meth:`stop_tasks` ends them."""
        self.stopping = False
        self._wake = asyncio.Event()
        tasks = [asyncio.create_task(self.follow())]
        if heartbeat:
            tasks.append(asyncio.create_task(self.heartbeat()))
        return tasks

    async def stop_tasks(self, tasks: list[asyncio.Task[None]]) -> None:
        """End the tasks :meth:`start_tasks` started: each at the end of the command it is in (the follower's
        read: up to ``block_ms``), then whatever is left is cancelled; one that outlives that too is named in a
        warning."""
        self.stopping = True
        self._wake.set()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.block_ms / 1000 + self.registry.config.timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            _, left = await asyncio.wait(pending, timeout=1.0)
            if left:
                logger.warning("hotwire: %d fleet task(s) of replica %s did not stop (%s)", len(left),
                               self.replica_id, ", ".join(t.get_coro().__qualname__ for t in left))

    async def _pause(self, seconds: float) -> None:
        """Sleep, unless the tasks are being stopped."""
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def follow(self) -> None:
        """Apply the registry's events to the engine until stopped (see the module docstring)."""
        backoff = 0.05
        while not self.stopping:
            engine = self._engine()
            if engine is None:
                await self._pause(0.5)
                continue
            try:
                await self.sync(engine)
                events = await self.do(self.registry.read_events(self.position or "0-0", self.block_ms, self.batch))
                if await self._apply_all(engine, events):
                    await self._on_change(engine)
                await self._collect()
                backoff = 0.05
            except Unavailable:
                await self._pause(backoff)
                backoff = min(2 * backoff, 2.0)
            except HotwireError as exc:  # the engine did not answer: the same events again later
                logger.warning("hotwire: the fleet follower waits for the engine: %s", exc.message)
                await self._pause(0.5)
            except Exception:  # anything else must not end the follower: log it and go on from where it was
                logger.error("hotwire: the fleet follower failed; retrying in 1 s\n%s",
                             scrubbed(traceback.format_exc(), self.registry.url))
                await self._pause(1.0)

    async def catch_up(self, timeout_s: float = CATCH_UP_S) -> None:
        """Before this API server takes requests (its app's startup; vLLM's ``/health`` answers only after it):
        the follower's first sync, or, in another API server of the replica, a wait until the engine holds every
        current version of the registry. So a replica that starts or restarts behind a load balancer never
        answers "unknown steering vector" for one the fleet has. A registry that does not answer is not waited
        for (the follower catches up once it does), nor one that takes longer than ``timeout_s``."""
        engine = self._engine()
        if engine is None:
            return
        started = time.monotonic()
        try:
            await asyncio.wait_for(self.sync(engine) if self.follower else self._engine_holds_registry(engine),
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

    async def _collect(self) -> None:
        """Every ``collect_every_s``: delete the blobs no current version has used for the grace period
        (``HOTWIRE_REGISTRY_BLOB_GRACE_S``), and forget the retired versions whose retention is over. Every
        follower does it; the registry's scripts make that safe."""
        if time.monotonic() - self._collected < self.collect_every_s:
            return
        self._collected = time.monotonic()
        deleted = await self.do(self.registry.collect_blobs(self.registry.config.blob_grace_s))
        if deleted:
            logger.info("hotwire: collected %d blob(s) no current vector version uses from the registry", deleted)
        while await self.do(self.registry.forget_retired(time.time() - self.registry.config.retain_s)) >= 1000:
            pass  # a backlog: the script forgets 1000 at a time

    async def sync(self, engine: HotwireEngine) -> None:
        """Once a second, the restart gate (``repair``: a Redis that restarted or lost hotwire's keys gets back
        what this replica knows); then a resync when needed: at start, and after a reconnect or a repair when the
        stream no longer holds this replica's position (trimmed while it was away, or Redis came back with older
        data)."""
        if self.position is not None and not self._reconnected and time.monotonic() - self._gate_checked < 1.0:
            return
        repaired = await self.repair.check(engine)
        self._gate_checked = time.monotonic()
        if self.position is not None:
            reconnected, self._reconnected = self._reconnected, False
            if not (reconnected or repaired) or await self.do(self.registry.covers(self.position)):
                return  # caught up from the stream: no reload
            if repaired:
                self.reset_seen = True
                logger.error("hotwire: the vector registry at %s came back without events this replica had "
                             "applied (older data, or none): it resyncs", self.registry.display_url)
        await self.resync(engine)

    async def resync(self, engine: HotwireEngine) -> None:
        """Make the engine hold the registry's current versions and the versions retired within the retention:
        register what it lacks, and delete what the registry no longer has. The engine is read
        first, then the stream's position, then the registry, so nothing registered meanwhile is deleted and
        nothing is skipped (what the stream repeats changes nothing)."""
        local = {m.id: (m.version, m.sha256) for m in await engine.vectors()}
        position = await self.do(self.registry.last_event_id())
        remote = await self.do(self.registry.current())
        retired = await self.do(self.registry.retired_since(time.time() - self.registry.config.retain_s))
        changed = False
        for vector_id, (version, sha) in remote.items():
            held = local.get(vector_id)
            if held is not None and held[0] >= version:
                if held[0] > version or held[1] != sha:
                    logger.error("hotwire: this engine holds %s@%d (%s) but the registry's current version is "
                                 "%d (%s): it keeps its own", vector_id, held[0], held[1][:12], version, sha[:12])
                self._note(vector_id, held[0])
                continue
            changed |= await self._register_event(engine, vector_id, version, sha)
        for vector_id, (version, _) in local.items():
            if vector_id not in remote:
                await engine.unregister(vector_id, version)
                self._note(vector_id, version, deleted=True)
                changed = True
        held_retired = 0
        for (vector_id, version), (sha, at) in retired.items():
            if local.get(vector_id, (0, ""))[0] != version:
                await self._register_event(engine, vector_id, version, sha, retired_at=at)
                held_retired += 1
        self.position = position
        self.resyncs += 1
        logger.info("hotwire: synced with the vector registry at %s (%d vectors, %d retired versions within "
                    "their retention, stream at %s)", self.registry.display_url, len(remote), held_retired, position)
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
            self.position = event.stream_id
            self.events_applied += 1
        return changed

    async def _apply(self, engine: HotwireEngine, event: Event) -> bool:
        """One event; returns whether it changed the engine's current versions."""
        if event.op == "register":
            version, deleted = self.known.get(event.vector_id, (0, False))
            if event.version > version:
                return await self._register_event(engine, event.vector_id, event.version, event.sha256)
            if event.version < version or deleted:  # a newer version or its deletion came first (this replica's own)
                await self._register_retired(engine, event.vector_id, event.version)
            return False  # else applied already (this replica registered it)
        if event.op == "delete":
            self._note(event.vector_id, event.version, deleted=True)
            await engine.unregister(event.vector_id, event.version)
            return True
        logger.warning("hotwire: unknown registry event %r ignored", event.op)
        return False

    async def _register_retired(self, engine: HotwireEngine, vector_id: str, version: int) -> None:
        """Hold a version the fleet retired (replaced or deleted) for the rest of its retention, so a request
        pinned to it is served here as on the replicas that held it; nothing when it was never retired or its
        retention is over."""
        retired = await self.do(self.registry.retired_version(vector_id, version))
        if retired is not None and time.time() - retired[1] < self.registry.config.retain_s:
            await self._register_event(engine, vector_id, version, retired[0], retired_at=retired[1])

    async def _register_event(
        self, engine: HotwireEngine, vector_id: str, version: int, sha: str, retired_at: float | None = None
    ) -> bool:
        blob = await self.do(self.registry.get_blob(sha))
        if blob is None:
            live = await self.do(self.registry.current_version(vector_id))
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
            if exc.code == "engine_unavailable":
                raise
            if exc.code == "version_gone":  # a retired version whose retention ended meanwhile: nothing to hold
                logger.info("hotwire: %s@%d not held: %s", vector_id, version, exc.message)
            else:
                logger.error("hotwire: this engine refused %s@%d from the registry: %s", vector_id, version, exc.message)
            return False
        if meta.sha256 != sha:
            logger.error("hotwire: %s@%d decoded to %s, not the registry's %s", vector_id, version, meta.sha256[:12], sha[:12])
        if retired_at is not None:
            return False
        self._note(vector_id, version)
        return True

    # -- heartbeat and the fleet view --------------------------------------------------------------------------

    async def state(self, engine: HotwireEngine) -> dict[str, Any]:
        """This replica's heartbeat: slot statistics, pinned rows and the vector versions it holds."""
        stats = await engine.stats()
        vectors = await engine.vectors()
        return {
            "replica": self.replica_id, "url": self.url, "pid": os.getpid(), "started_at": self.started_at,
            "sent_at": time.time(), **self._progress(),
            "slots": {k: getattr(stats, k) for k in ("capacity", "used", "pinned", "free", "evictions",
                                                     "steered_requests", "deferred", "engines")},
            "refused": stats.refused,
            "pinned_rows": [{"id": r.id, "version": r.version, "layer": r.layer, "refcount": r.refcount,
                             "engine": r.engine} for r in stats.rows if r.refcount > 0],
            "vectors": [{"id": m.id, "version": m.version, "sha256": m.sha256, "in_flight": m.in_flight}
                        for m in vectors],
        }

    async def heartbeat(self) -> None:
        """Put this replica's state in the registry every ``heartbeat_s`` until stopped; it expires after three."""
        interval = self.registry.config.heartbeat_s
        while not self.stopping:
            engine = self._engine()
            if engine is not None:
                try:
                    await self.do(self.registry.heartbeat(self.replica_id, await self.state(engine), 3 * interval))
                except Unavailable:
                    pass
                except HotwireError as exc:
                    logger.debug("hotwire: heartbeat skipped: %s", exc.message)
            await self._pause(interval)

    async def view(self) -> dict[str, Any]:
        """``GET /steer/fleet``: the registry, every live replica and the versions each one holds."""
        remote = await self.do(self.registry.current())
        replicas = sorted(await self.do(self.registry.replicas()), key=lambda r: str(r.get("replica")))
        now = time.time()
        for r in replicas:
            r["age_ms"] = round(1000 * max(0.0, now - float(r.get("sent_at") or now)), 1)
            held = {v["id"]: v["version"] for v in r.get("vectors") or []}
            r["in_sync"] = held == {vid: v for vid, (v, _) in remote.items()}
        vectors = []
        for vector_id, (version, sha) in sorted(remote.items()):
            holders = [r["replica"] for r in replicas
                       if any(v["id"] == vector_id and v["version"] == version for v in r.get("vectors") or [])]
            vectors.append({"id": vector_id, "version": version, "sha256": sha, "held_by": holders,
                            "missing_on": [r["replica"] for r in replicas if r["replica"] not in holders]})
        return {"registry": await self.status(), "vectors": vectors, "replicas": replicas}


def _gauge(value: int) -> None:
    from hotwire_api.metrics import STATS

    STATS.registry_reachable = value
    if STATS.series is not None:
        STATS.series.registry(value)


def default_replica_id(app: Any) -> str:
    args = getattr(getattr(app, "state", None), "args", None)
    return default_replica_name(getattr(args, "port", None))


def _model_name(app: Any) -> str:
    args = getattr(getattr(app, "state", None), "args", None)
    return str(getattr(args, "model", None) or "default")


class Fleet:
    """This process's registry setting and, once the app runs, its :class:`Replica` (None: the embedded
    registry)."""

    def __init__(self) -> None:
        self.config: FleetConfig | None = None
        self.replica: Replica | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def configure(self, url: str | None) -> None:
        self.config = FleetConfig.from_env(url) if url else None

    async def start(self, app: Any) -> None:
        """In the app's lifespan: connect (lazily: a Redis that is down now is retried) and, in the first API
        server, start the follower and the heartbeat."""
        if self.config is None:
            return

        def engine() -> HotwireEngine | None:
            return HotwireEngine.of(app) if getattr(app.state, "engine_client", None) is not None else None

        registry = RedisRegistry(self.config, Keys.for_model(_model_name(app)))
        self.replica = Replica(registry, engine, self.config.replica_id or default_replica_id(app),
                               os.environ.get("HOTWIRE_REPLICA_URL") or None, follower=is_first_api_server())
        logger.info("hotwire: vector registry %s (replica %s%s)", registry.display_url, self.replica.replica_id,
                    ", following its events" if self.replica.follower else "")
        await self.replica.catch_up()
        if self.replica.follower:
            self._tasks = self.replica.start_tasks()

    async def stop(self) -> None:
        if self.replica is not None:
            await self.replica.stop_tasks(self._tasks)
        self._tasks = []
        if self.replica is not None:
            await self.replica.registry.close()
            self.replica = None


FLEET = Fleet()
