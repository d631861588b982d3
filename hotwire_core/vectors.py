"""The engine's vectors at start: the durable store (``HOTWIRE_STORE``) restored into the registry, then the
``HOTWIRE_VECTORS`` files preloaded; and the refusal of a store that cannot be written. See docs/architecture.md
(the store)."""

from __future__ import annotations

import logging
from pathlib import Path

from .contract import Failure
from .errors import EngineError
from .registry import HostVector, RegistryError, VectorRegistry
from .store import StoredVector, VectorStore, load_preload_dir

__all__ = ["restore", "store_failed"]

logger = logging.getLogger(__name__)


def restore(registry: VectorRegistry, store: VectorStore | None, preload: str | None) -> None:
    """Register the store's vectors at their stored versions, then the ``preload`` folder's files."""
    stored: list[StoredVector] = store.load() if store is not None else []
    if store is not None:
        # Stores written before versions.json existed know their live versions only from the vector files.
        store.note_versions({s.vector_id: s.version for s in stored if s.version is not None})
        for vector_id, version in store.last_versions().items():
            registry.note_version(vector_id, version)
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
        500, "store_failed",
        f"could not {what} the store at {store.root} ({type(exc).__name__}: {exc}); "
        "nothing changed: make the folder writable or free space (HOTWIRE_STORE), then retry",
    ).to_result()
