"""The vector registry the ``/steer`` routes change and report: one interface, chosen once when hotwire is attached
to an app (:func:`registry_for`). ``LocalRegistry``: the engine cores' own registry (and vector store), through
:class:`HotwireEngine`. ``FleetRegistry`` (``HOTWIRE_REGISTRY``): one Redis for a fleet of replicas, which numbers
the versions for all of them (``hotwire_api.fleet``, docs/fleet.md)."""

from __future__ import annotations

from typing import Any, Protocol

from hotwire_api.audit import AuditEntry, AuditFile, AuditMemory, AuditPage, Author, entry
from hotwire_api.codec import VectorPayload
from hotwire_api.engine import HotwireEngine
from hotwire_api.fleet.config import FleetConfig
from hotwire_api.fleet.fleet_registry import FleetRegistry
from hotwire_api.stats_cache import STATS
from hotwire_api.models import (
    FleetVector,
    FleetView,
    HeldVector,
    PinnedRow,
    RegistryStatus,
    ReplicaSlots,
    ReplicaState,
    VectorMeta,
)
from hotwire_api.settings import Settings
from hotwire_core.settings import Settings as CoreSettings
from hotwire_core.vllm_glue.api_server import served_port_and_model

__all__ = ["LocalRegistry", "VectorRegistry", "registry_for"]


class VectorRegistry(Protocol):
    """Started and stopped with the app (its lifespan); registration and deletion raise ``HotwireError``."""

    async def start(self, app: Any) -> None: ...

    async def stop(self) -> None: ...

    async def register(
        self, engine: HotwireEngine, vector_id: str, payload: VectorPayload, replace: bool, by: Author
    ) -> tuple[bool, VectorMeta]:
        """Register (``replace``: a new version of an existing id), recorded in the audit trail as ``by``'s;
        returns (created, meta)."""
        ...

    async def unregister(self, engine: HotwireEngine, vector_id: str, by: Author) -> int:
        """Delete, recorded as ``by``'s; returns the requests still using the vector (they keep it until done)."""
        ...

    async def record(self, change: AuditEntry) -> None:
        """Add a change made elsewhere (a key's) to the audit trail."""
        ...

    async def audit(self, limit: int) -> AuditPage:
        """``GET /steer/audit``: the newest ``limit`` changes."""
        ...

    async def status(self) -> RegistryStatus:
        """The ``registry`` section of ``/steer/slots``."""
        ...

    async def view(self, engine: HotwireEngine) -> FleetView:
        """``GET /steer/fleet``: every replica on the registry and the versions each holds."""
        ...

    def replica_name(self) -> str:
        """This replica's name in the audit trail and the fleet view."""
        ...

    def fleet_store(self) -> Any:
        """Where what every replica shares beside the vectors lives (the monitors, ``hotwire_api.monitors``; the
        tenants' registrations per minute, ``hotwire_api.quotas``): the fleet's Redis registry; None: this host
        keeps its own."""
        ...


class LocalRegistry:
    """Each engine's own registry; the fleet view is this server alone (``replica: "local"``). The audit trail is
    ``audit.jsonl`` in the served model's store folder (``HOTWIRE_STORE``), found at start; in memory with the
    store off."""

    def __init__(self) -> None:
        self.trail: AuditFile | AuditMemory = AuditMemory()

    async def start(self, app: Any) -> None:
        model = served_port_and_model(app)[1]
        folder = CoreSettings.from_env().store_dir(model) if model else None
        self.trail = AuditFile(folder / "audit.jsonl") if folder is not None else AuditMemory()

    async def stop(self) -> None:
        pass

    async def register(
        self, engine: HotwireEngine, vector_id: str, payload: VectorPayload, replace: bool, by: Author
    ) -> tuple[bool, VectorMeta]:
        created, meta = await engine.register(vector_id, payload, replace)
        self.trail.record(entry(by.who, "register" if created else "replace", vector_id, meta.version, meta.sha256,
                                by.via))
        return created, meta

    async def unregister(self, engine: HotwireEngine, vector_id: str, by: Author) -> int:
        known = {meta.id: meta for meta in await engine.vectors()}.get(vector_id)
        in_flight = await engine.unregister(vector_id)
        self.trail.record(entry(by.who, "delete", vector_id, known.version if known else None,
                                known.sha256 if known else None))
        return in_flight

    async def record(self, change: AuditEntry) -> None:
        self.trail.record(change)

    async def audit(self, limit: int) -> AuditPage:
        return AuditPage(kept=self.trail.kept, entries=self.trail.read(limit))

    async def status(self) -> RegistryStatus:
        return RegistryStatus(kind="local")

    def fleet_store(self) -> None:
        return None

    def replica_name(self) -> str:
        return "local"

    async def view(self, engine: HotwireEngine) -> FleetView:
        stats, _ = await STATS.get(engine, 0)
        vectors = await engine.vectors()
        me = ReplicaState(replica="local", slots=ReplicaSlots.of(stats), refused=stats.refused, in_sync=True,
                          vectors=[HeldVector.of(m) for m in vectors], age_ms=0.0,
                          pinned_rows=[PinnedRow.of(row) for row in stats.rows if row.refcount > 0])
        return FleetView(registry=RegistryStatus(kind="local"), replicas=[me],
                         vectors=[FleetVector(id=m.id, version=m.version, sha256=m.sha256, held_by=["local"],
                                              missing_on=[]) for m in vectors])


def registry_for(settings: Settings) -> VectorRegistry:
    """``HOTWIRE_REGISTRY`` set: the fleet's; else the local one."""
    if settings.registry_url:
        return FleetRegistry(FleetConfig.from_env(settings.registry_url))
    return LocalRegistry()
