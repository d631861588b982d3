"""The fleet's registry as the ``/steer`` routes see it (``hotwire_api.vector_registry.VectorRegistry``): this
API server's :class:`Replica`, made when the app starts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from hotwire_api.audit import AuditEntry, AuditPage, Author
from hotwire_api.codec import VectorPayload
from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.fleet.config import FleetConfig, Keys, default_replica_name
from hotwire_api.fleet.redis_registry import RedisRegistry
from hotwire_api.fleet.replica import Replica
from hotwire_api.models import FleetView, RegistryStatus, VectorMeta
from hotwire_core.error_codes import ErrorCode
from hotwire_core.vllm_glue.api_server import engine_client, is_first_api_server, served_port_and_model

__all__ = ["FleetRegistry"]

logger = logging.getLogger(__name__)


def default_replica_id(app: Any) -> str:
    return default_replica_name(served_port_and_model(app)[0])


def _model_name(app: Any) -> str:
    return str(served_port_and_model(app)[1] or "default")


class FleetRegistry:
    """Redis (``HOTWIRE_REGISTRY``) numbers the versions for every replica; see ``hotwire_api.fleet``."""

    def __init__(self, config: FleetConfig):
        self.config = config
        self.replica: Replica | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, app: Any) -> None:
        """In the app's lifespan: connect (lazily: a Redis that is down now is retried), catch up and, in the first
        API server, start the follower and the heartbeat."""

        def engine() -> HotwireEngine | None:
            return HotwireEngine.of(app) if engine_client(app) is not None else None

        registry = RedisRegistry(self.config, Keys.for_model(_model_name(app)))
        self.replica = Replica(registry, engine, self.config.replica_id or default_replica_id(app),
                               self.config.replica_url, follows=is_first_api_server())
        logger.info("hotwire: vector registry %s (replica %s%s)", registry.display_url, self.replica.replica_id,
                    ", following its events" if self.replica.follows else "")
        await self.replica.catch_up()
        if self.replica.follows:
            self._tasks = self.replica.start_tasks()

    async def stop(self) -> None:
        if self.replica is not None:
            await self.replica.stop_tasks(self._tasks)
            await self.replica.registry.close()
            self.replica = None
        self._tasks = []

    def _started(self) -> Replica:
        if self.replica is None:
            raise HotwireError(503, ErrorCode.REGISTRY_UNAVAILABLE, "the fleet's registry is not connected: the API server "
                               "connects when its app starts; retry once it answers /health")
        return self.replica

    async def register(
        self, engine: HotwireEngine, vector_id: str, payload: VectorPayload, replace: bool, by: Author
    ) -> tuple[bool, VectorMeta]:
        replica = self._started()
        return await replica.changes.register(engine, vector_id, payload, replace,
                                              dataclasses.replace(by, replica=replica.replica_id))

    async def unregister(self, engine: HotwireEngine, vector_id: str, by: Author) -> int:
        replica = self._started()
        return await replica.changes.unregister(engine, vector_id, dataclasses.replace(by, replica=replica.replica_id))

    async def record(self, change: AuditEntry) -> None:
        replica = self._started()
        await replica.do(replica.registry.record(change.model_copy(update={"replica": replica.replica_id})))

    async def audit(self, limit: int) -> AuditPage:
        replica = self._started()
        return AuditPage(kept="redis", entries=await replica.do(replica.registry.audit(limit)))

    async def status(self) -> RegistryStatus:
        return RegistryStatus(**await self._started().heartbeat.status())

    def replica_name(self) -> str:
        return self._started().replica_id

    def fleet_store(self) -> RedisRegistry:
        """The fleet's monitors and tenants' registration counts live in its Redis."""
        return self._started().registry

    async def view(self, engine: HotwireEngine) -> FleetView:
        return FleetView.model_validate(await self._started().heartbeat.view())
