"""The API server's copy of the engine's catalog: the server's rules and every vector's current version, so that
admission decides a steered request in this process (``hotwire_core.admission``), without an engine round trip.

Kept current three ways: at once after this process registers or deletes a vector, every
``HOTWIRE_CATALOG_REFRESH_MS`` (default 200) in the background (an engine answer of a few bytes while nothing
changed), and on demand when a request names an id the copy does not know (registered through another API
server). The engine answers with what changed after the copy's generation (a few vectors after a registration),
and whole only when its log of changes does not reach back that far. A copy that is behind is still truthful: the
request is pinned to the version the copy names, which the engine retains (``HOTWIRE_RETAIN_S``) after a replace or
delete, and the receipt names that version.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError
from hotwire_core import contract
from hotwire_core.admission import ModelInfo, Refusal, Rules
from hotwire_core.error_codes import ErrorCode
from hotwire_core.settings import parse_layers
from hotwire_core.vllm_glue.api_server import engine_client

__all__ = ["CATALOG", "Catalog", "CatalogVector", "rules_of"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class CatalogVector:
    """One current version, as the engine described it (``VectorMeta``); a ``hotwire_core.admission.VectorView``."""

    vector_id: str
    version: int
    sha256: str
    layers: tuple[int, ...] | None
    norms: dict[str, float]  # "*" for a [hidden] vector, else str(layer)

    @classmethod
    def from_meta(cls, meta: contract.VectorMeta) -> CatalogVector:
        layers = meta.get("layers")
        norms = {str(k): float(v) for k, v in (meta.get("norms") or {}).items()}
        return cls(str(meta["id"]), int(meta["version"]), str(meta["sha256"]),
                   None if layers is None else tuple(int(l) for l in layers), norms)

    def has_row(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def row_norm(self, layer: int) -> float:
        if self.layers is None:
            return self.norms.get("*", 0.0)
        return self.norms.get(str(layer), 0.0) if layer in self.layers else 0.0


def rules_of(answer: contract.CatalogResult) -> Rules:
    """The server's rules in a full ``hotwire_catalog`` answer."""
    model = answer["model"]
    layers = frozenset(parse_layers(model["layers"])) if model.get("layers") else frozenset()
    readable = frozenset(parse_layers(model["readout_layers"])) if model.get("readout_layers") else None
    info = ModelInfo(bool(model["steerable"]), str(model.get("reason") or ""), int(model["n_layers"]),
                     int(model["hidden_size"]), str(model["dtype"]), layers, bool(model.get("norm", True)),
                     int(model.get("capture_rows") or 0), int(model.get("readout_probes") or 0),
                     tuple(model.get("gates") or ()), readable)
    return Rules(info, int(model["max_stack"]), int(answer["capacity"]), int(answer["max_rows"]),
                 bool(answer.get("layers_setting")))


_STATES = itertools.count()  # one count for every catalog object: a state number never comes back


class Catalog:
    """This process's copy of the engine's catalog (see the module docstring)."""

    def __init__(self) -> None:
        self.state = next(_STATES)  # changes whenever rules or vectors may have: what decisions are cached under
        self.generation = -1
        self.rules: Rules | None = None
        self.vectors: dict[str, CatalogVector] = {}
        self.taken_at = -math.inf
        self._inflight: asyncio.Task[None] | None = None
        self._inflight_sent = -math.inf
        self._source: Any = None  # the engine client the copy is of

    def lookup(self, vector_id: str, version: int | None = None) -> CatalogVector | None:
        """The current version of ``vector_id`` if it is ``version`` (or ``version`` is None)."""
        vector = self.vectors.get(vector_id)
        return vector if vector is not None and version in (None, vector.version) else None

    def holds(self, vector_id: str) -> bool:
        """Whether the copy (made ready by the caller) holds ``vector_id``, at any version."""
        return vector_id in self.vectors

    async def refresh(self, engine: HotwireEngine, not_before: float = -math.inf) -> None:
        """Bring the copy up to date with an answer the engine gave at or after ``not_before``
        (``time.monotonic()``); concurrent callers share one round trip. Raises :class:`HotwireError` when the
        engine does not answer."""
        if engine.client is not self._source:  # another engine (a test's, a restarted one): start over
            self.__init__()
            self._source = engine.client
        if self._inflight is None or self._inflight.done() or self._inflight_sent < not_before:
            self._inflight = asyncio.ensure_future(self._fetch(engine))
            self._inflight_sent = time.monotonic()
        await asyncio.shield(self._inflight)

    async def ready(self, engine: HotwireEngine) -> Rules:
        """The server's rules, fetching the catalog first if this process has none yet."""
        if self.rules is None or engine.client is not self._source:
            await self.refresh(engine)
        assert self.rules is not None
        return self.rules

    async def decide(self, engine: HotwireEngine, arrived: float, decide: Callable[[Rules], T],
                     unknown: tuple[ErrorCode, ...]) -> T:
        """``decide`` against this copy, and once more after a refresh when it refuses with a code of ``unknown``:
        registered since the last refresh (through another API server)? Only an answer the engine gave after the
        request ``arrived`` can say no: a fetch already in flight may predate the registration."""
        rules = await self.ready(engine)
        try:
            return decide(rules)
        except Refusal as exc:
            if exc.code not in unknown:
                raise
        await self.refresh(engine, not_before=arrived)
        return decide(rules)

    async def _fetch(self, engine: HotwireEngine) -> None:
        answer = await engine.catalog(self.generation)
        if "since" in answer and answer["since"] != self.generation:  # another fetch moved the copy meanwhile:
            answer = await engine.catalog(-1)  # the delta has no base here, so ask for the whole catalog
        if not answer.get("unchanged"):
            self.rules = rules_of(answer)
            vectors = {v.vector_id: v for v in map(CatalogVector.from_meta, answer.get("vectors") or [])}
            if "since" in answer:  # what changed after the generation this copy held: the rest stays
                removed = set(answer.get("removed") or [])
                vectors = {**{i: v for i, v in self.vectors.items() if i not in removed}, **vectors}
            # Data parallelism: a registration reaches the first engine core before the others. Pin only what
            # every engine core has: the oldest current version (the first core retains it), no id one lacks.
            behind = False
            for other in await engine.other_catalogs():
                theirs = {str(m["id"]): m for m in other.get("vectors") or []}
                for vector_id, vector in list(vectors.items()):
                    meta = theirs.get(vector_id)
                    if meta is None or int(meta["version"]) != vector.version:
                        behind = True
                        if meta is None:
                            del vectors[vector_id]
                        elif int(meta["version"]) < vector.version:
                            vectors[vector_id] = CatalogVector.from_meta(meta)
            self.vectors = vectors
            self.state = next(_STATES)
            self.generation = -1 if behind else int(answer["generation"])  # behind: look again next time
        self.taken_at = time.monotonic()

    async def run(self, app: Any, interval_s: float) -> None:
        """Refresh from ``app``'s engine every ``interval_s`` until cancelled."""
        while True:
            if engine_client(app) is not None:
                try:
                    await self.refresh(HotwireEngine.of(app))
                except HotwireError as err:
                    logger.debug("hotwire catalog refresh failed: %s", err)
            await asyncio.sleep(interval_s)


CATALOG = Catalog()
