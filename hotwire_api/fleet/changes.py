"""Registration and deletion through the fleet's registry (``POST`` and ``DELETE /steer/vectors`` on a replica).

Registration (any API server of any replica): the upload is checked against the model here (``blobs.check``: the
engine's own checks), its blob stored under its content hash, then one Lua script makes it the id's next version
(or answers 409) and appends the event; only then do this replica's engine cores get it, with that version. So
Redis never names a vector an engine would refuse, and an engine never holds a version Redis did not give. Should
the local engine fail after Redis accepted, the answer is still the registration (it is durable and numbered);
the follower applies it once the engine answers. Deletion likewise: Redis first, then this replica's engine cores
up to the deleted version.
"""

from __future__ import annotations

import logging
import time

from hotwire_api.audit import Author
from hotwire_api.catalog import rules_of
from hotwire_api.codec import VectorPayload
from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_api.fleet import blobs
from hotwire_api.fleet.standing import Standing
from hotwire_api.models import VectorMeta
from hotwire_core.admission import Rules
from hotwire_core.error_codes import ErrorCode

__all__ = ["Changes"]

logger = logging.getLogger(__name__)


class Changes:
    """This replica's registrations and deletions."""

    def __init__(self, replica: Standing):
        self.replica = replica
        self._rules: Rules | None = None

    async def model_rules(self, engine: HotwireEngine) -> Rules:
        if self._rules is None:
            self._rules = rules_of(await engine.catalog(-1))
        return self._rules

    async def register(
        self, engine: HotwireEngine, vector_id: str, payload: VectorPayload, replace: bool, by: Author = Author()
    ) -> tuple[bool, VectorMeta]:
        """Register through the registry (see the module docstring), in the audit stream as ``by``'s; returns
        (created, meta)."""
        r = self.replica
        model = (await self.model_rules(engine)).model
        if not model.steerable:
            raise HotwireError(503, ErrorCode.MODEL_NOT_STEERABLE, f"this model cannot be steered: {model.reason}")
        checked = blobs.check(payload, model.n_layers, model.hidden_size, model.dtype)
        await r.do(r.registry.put_blob(checked.sha256, blobs.encode(checked.payload)))
        status, version, previous = await r.do(
            r.registry.register(vector_id, checked.sha256, replace, floor=r.known_version(vector_id), by=by)
        )
        if status == 409:
            raise HotwireError(
                409, ErrorCode.EXISTS, f"vector {vector_id!r} is already registered (version {previous[0] if previous else '?'} "
                "in the fleet's registry); register it with replace=true (hotwire register --replace) to make a new "
                "version", "id",
            )
        try:
            _, meta = await engine.register(vector_id, checked.payload, True, version)
            r.note(vector_id, version)
        except HotwireError as exc:  # registered and numbered: the follower applies it once the engine answers
            logger.error("hotwire: %s@%d is registered in the fleet but this engine did not take it yet: %s",
                         vector_id, version, exc.message)
            p = checked.payload
            meta = VectorMeta(id=vector_id, version=version, sha256=checked.sha256, dtype=p.dtype, shape=list(p.shape),
                              layers=None if p.layers is None else list(p.layers), norms=checked.norms,
                              created_at=time.time())
        return status == 201, meta

    async def unregister(self, engine: HotwireEngine, vector_id: str, by: Author = Author()) -> int:
        """Delete through the registry, in the audit stream as ``by``'s; returns this replica's requests still
        using the vector."""
        r = self.replica
        deleted = await r.do(r.registry.delete(vector_id, by))
        if deleted is None:
            raise HotwireError(404, ErrorCode.UNKNOWN_VECTOR, f"unknown steering vector {vector_id!r}", "id")
        version, _ = deleted
        r.note(vector_id, version, deleted=True)
        try:
            return await engine.unregister(vector_id, version)
        except HotwireError as exc:
            logger.error("hotwire: %s@%d is deleted in the fleet but this engine did not drop it yet: %s",
                         vector_id, version, exc.message)
            return 0
