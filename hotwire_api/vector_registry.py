"""The vector registry the ``/steer`` routes change and report: one interface, chosen once when hotwire is attached
to an app (:func:`registry_for`). ``LocalRegistry``: the engine cores' own registry (and vector store), through
:class:`HotwireEngine`. ``FleetRegistry`` (``HOTWIRE_REGISTRY``): one Redis for a fleet of replicas, which numbers
the versions for all of them (``hotwire_api.fleet``, docs/fleet.md)."""

from __future__ import annotations

from typing import Any, Protocol

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

__all__ = ["LocalRegistry", "VectorRegistry", "registry_for"]


class VectorRegistry(Protocol):
    """Started and stopped with the app (its lifespan); registration and deletion raise ``HotwireError``."""

    async def start(self, app: Any) -> None: ...

    async def stop(self) -> None: ...

    async def register(
        self, engine: HotwireEngine, vector_id: str, payload: VectorPayload, replace: bool
    ) -> tuple[bool, VectorMeta]:
        """Register (``replace``: a new version of an existing id); returns (created, meta)."""
        ...

    async def unregister(self, engine: HotwireEngine, vector_id: str) -> int:
        """Delete; returns the requests still using the vector (they keep it until done)."""
        ...

    async def status(self) -> RegistryStatus:
        """The ``registry`` section of ``/steer/slots``."""
        ...

    async def view(self, engine: HotwireEngine) -> FleetView:
        """``GET /steer/fleet``: every replica on the registry and the versions each holds."""
        ...


class LocalRegistry:
    """Each engine's own registry: nothing to start; the fleet view is this server alone (``replica: "local"``)."""

    async def start(self, app: Any) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def register(
        self, engine: HotwireEngine, vector_id: str, payload: VectorPayload, replace: bool
    ) -> tuple[bool, VectorMeta]:
        return await engine.register(vector_id, payload, replace)

    async def unregister(self, engine: HotwireEngine, vector_id: str) -> int:
        return await engine.unregister(vector_id)

    async def status(self) -> RegistryStatus:
        return RegistryStatus(kind="local")

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
