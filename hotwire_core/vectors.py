"""The engine's vectors at start: the durable store (``HOTWIRE_STORE``) restored into the registry, then the
``HOTWIRE_VECTORS`` files preloaded; and the refusal of a store that cannot be written. See docs/architecture.md
(the store)."""

from __future__ import annotations

import logging
from pathlib import Path

from .contract import Failure
from .error_codes import ErrorCode
from .errors import EngineError
from .registry import HostVector, RegistryError, VectorRegistry
from .store import HistoryLost, StoredVector, VectorStore, load_preload_dir

__all__ = ["restore", "store_failed"]

logger = logging.getLogger(__name__)


def restore(registry: VectorRegistry, store: VectorStore | None, preload: str | None) -> None:
    """Register the store's vectors at their stored versions, then the ``preload`` folder's files."""
    stored: list[StoredVector] = store.load() if store is not None else []
    if store is not None:
        _restore_history(registry, store, stored)
    for s in stored:
        try:
            vector = registry.register(
                s.vector_id, s.data, s.dtype, s.shape, s.layers, replace=False, version=s.version, created_at=s.created_at
            )
        except RegistryError as exc:
            logger.error("hotwire: cannot restore vector %r: %s", s.vector_id, exc.message)
            continue
        if s.version is None:
            _store_at_start(store, vector)
    if preload:
        for s in load_preload_dir(Path(preload)):
            _preload(registry, store, s)
    if registry.vectors():
        logger.info("hotwire: restored %d steering vector(s)", len(registry.vectors()))


def _restore_history(registry: VectorRegistry, store: VectorStore, stored: list[StoredVector]) -> None:
    """Every version the store gave out, so none is given out again; a lost history starts versions above a floor
    (``VectorStore.recover_history``)."""
    in_files = {s.vector_id: s.version for s in stored if s.version is not None}
    try:
        versions = store.last_versions()
        behind = sorted(i for i, v in in_files.items() if v > versions.get(i, 0))
        if behind:  # written before each file: an older copy put back (a backup), say
            raise HistoryLost(f"{store.root / store.VERSIONS} is behind the vector files of {behind[:5]}")
    except HistoryLost as exc:
        floor = store.recover_history(in_files)
        logger.error("hotwire: %s: the versions of deleted vectors are lost, so every vector's next version is "
                     "above %d (no earlier version number can have reached it); the damaged file was set aside",
                     exc, floor)
        versions = store.last_versions()
    floor = versions.pop(store.FLOOR_KEY, 0)
    registry.history.restore(versions, floor)


def _preload(registry: VectorRegistry, store: VectorStore | None, s: StoredVector) -> None:
    """A ``HOTWIRE_VECTORS`` file, read at every start: it becomes a new version of its id unless the store
    holds that content already (so an edited file takes effect at the next start)."""
    current = registry.current(s.vector_id)
    try:
        vector = registry.prepare(s.vector_id, s.data, s.dtype, s.shape, s.layers, replace=True)
    except RegistryError as exc:
        logger.error("hotwire: cannot preload vector %r: %s", s.vector_id, exc.message)
        return
    if current is not None and current.sha256 == vector.sha256:
        return
    if current is not None:
        logger.info("hotwire: the preloaded %r differs from the stored %s@%d: registered as version %d",
                    s.vector_id, s.vector_id, current.version, vector.version)
    registry.add(vector)
    _store_at_start(store, vector)


def _store_at_start(store: VectorStore | None, vector: HostVector) -> None:
    """Store a vector restored or preloaded at start; a store that cannot be written costs durability only."""
    if store is None:
        return
    try:
        store.save(vector)
    except OSError as exc:
        logger.error("hotwire: cannot write %s@%d to the store at %s (%s); it is served but not stored",
                     vector.vector_id, vector.version, store.root, exc)


def store_failed(store: VectorStore, what: str, exc: OSError) -> Failure:
    """The refusal of a registration or deletion the store could not record (nothing changed)."""
    return EngineError(
        500, ErrorCode.STORE_FAILED,
        f"could not {what} the store at {store.root} ({type(exc).__name__}: {exc}); "
        "nothing changed: make the folder writable or free space (HOTWIRE_STORE), then retry",
    ).to_result()
