"""Registering and deleting vectors in one engine core, with the store's writes kept out of its loop.

The engine core answers RPCs in the thread that schedules, between two steps. A registration's store write (the
vector's file and ``versions.json``, four fsyncs, ``versions.json`` read and rewritten whole) took 2-14 ms there
(RESULTS, BA), and no step ran meanwhile. Where the engine core runs its own busy loop (``deferring``, set by
``vllm_glue``), such a registration is answered with a ``Future`` instead, which vLLM answers the caller with once
it is done: a thread of its own writes the store, and the registration takes effect on the engine core's thread
once the write is done (:meth:`VectorChanges.pump`, called between steps). Changes take effect one at a time, in
the order they came, so versions and deletions keep their order; a reader (listing, catalog, admission) sees every
change that was answered and none that was not, as before.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Union

from . import contract
from .error_codes import ErrorCode
from .errors import EngineError, internal_failure
from .registry import HostVector, RegistryError, VectorRegistry
from .slots import SlotCache
from .store import VectorStore
from .vectors import store_failed

__all__ = ["VectorChanges"]

logger = logging.getLogger(__name__)

Answer = Union[contract.RegisterResult, contract.UnregisterResult, contract.Failure]


@dataclass
class _Write:
    """A change waiting for the store: ``write`` off the engine core's thread, then ``finish(error)`` on it."""

    write: Callable[[], None]
    finish: Callable[[BaseException | None], Answer]


@dataclass
class _Change:
    begin: Callable[[], Answer | _Write]  # on the engine core's thread, once every change before it took effect
    answer: Future
    finish: Callable[[BaseException | None], Answer] | None = None
    writing: Future | None = None


class VectorChanges:
    """Registrations and deletions of one engine core's ``registry`` (and ``store``, when it has one)."""

    def __init__(self, registry: VectorRegistry, store: VectorStore | None, slots: SlotCache, retain_s: float):
        self.registry, self.store, self.slots, self.retain_s = registry, store, slots, retain_s
        self.deferring = False  # True where something calls pump between steps (vllm_glue: the busy loop)
        self._queue: deque[_Change] = deque()  # in arrival order; the first may be writing
        self._writer: ThreadPoolExecutor | None = None

    @property
    def pending(self) -> bool:
        """Whether a change is waiting for the store (the engine must keep stepping to finish it)."""
        return bool(self._queue)

    def register(self, vector_id: str, data: bytes, dtype: str, shape: list[int], layers: list[int] | None = None,
                 replace: bool = False, version: int | None = None, retired_at: float | None = None
                 ) -> Answer | Future:  # fmt: skip
        """Register a vector. ``version``: the number the first data-parallel engine core gave it (the others
        take it, so that every engine core agrees; a version that arrives after a newer one is only retained), or
        a fleet's registry (``hotwire_api.fleet``). A version this engine holds already (current or retained) is
        answered as it is: versions are immutable, and a fleet's replica may hear of one twice. ``retired_at``
        (with ``version``; wall-clock seconds): the fleet retired that version then, so it is held as a retired
        version for what is left of ``HOTWIRE_RETAIN_S`` (410 ``version_gone`` when nothing is left), as on the
        replicas that held it when it was replaced or deleted. A ``Future`` of the answer while the store writes."""
        return self._submit(lambda: self._register(vector_id, data, dtype, shape, layers, replace, version, retired_at))

    def unregister(self, vector_id: str, version: int | None = None) -> Answer | Future:
        """Delete a vector's current version. ``version``: the version the first data-parallel engine core
        deleted (a newer one here stays). A ``Future`` of the answer while a change before it waits for the store."""
        return self._submit(lambda: self._unregister(vector_id, version))

    def pump(self) -> None:
        """On the engine core's thread: let every change whose write is done take effect, in order, answering it,
        and begin the next."""
        while self._queue:
            change = self._queue[0]
            if change.writing is None:
                step = _guarded(change.begin)
                if isinstance(step, _Write):
                    try:
                        if self._writer is None:
                            self._writer = ThreadPoolExecutor(1, thread_name_prefix="hotwire-store")
                        change.finish, change.writing = step.finish, self._writer.submit(step.write)
                    except RuntimeError:  # no thread to write with (the process is ending, or out of threads)
                        step = _guarded(lambda: _write_here(step))
                if not isinstance(step, _Write):
                    self._queue.popleft()
                    change.answer.set_result(step)
                    continue
            if not change.writing.done():
                return
            self._queue.popleft()
            error = change.writing.exception()
            change.answer.set_result(_guarded(lambda: change.finish(error)))

    def _submit(self, begin: Callable[[], Answer | _Write]) -> Answer | Future:
        if not self.deferring:  # nothing would finish a change later (so nothing is queued): write here
            step = begin()
            return _write_here(step) if isinstance(step, _Write) else step
        change = _Change(begin, Future())
        self._queue.append(change)
        self.pump()
        return change.answer.result() if change.answer.done() else change.answer

    def _register(self, vector_id: str, data: bytes, dtype: str, shape: list[int], layers: list[int] | None,
                  replace: bool, version: int | None, retired_at: float | None) -> Answer | _Write:  # fmt: skip
        old = self.registry.current(vector_id)
        if version is not None:
            held = self.registry.lookup(vector_id, int(version))
            if held is not None:
                return contract.RegisterResult(ok=True, created=False, vector=held.meta())
        retired_mono = None
        if retired_at is not None:
            if version is None:
                return EngineError(400, ErrorCode.BAD_REQUEST, "retired_at needs the version it retired", "version").to_result()
            age = max(0.0, time.time() - float(retired_at))
            if age >= self.retain_s:
                return EngineError(
                    410, ErrorCode.VERSION_GONE, f"version {version} of {vector_id!r} was retired {age:.0f} s ago, past "
                    f"its retention (HOTWIRE_RETAIN_S={self.retain_s})", "version"
                ).to_result()
            retired_mono = time.monotonic() - age
        try:
            vector = self.registry.prepare(vector_id, bytes(data), dtype, list(shape), layers, bool(replace), version)
        except RegistryError as exc:
            return exc.to_result()
        current = retired_mono is None and self.registry.supersedes(vector)
        if self.store is None or not current:
            return self._add(vector, retired_mono, old, current)
        store = self.store

        def finish(error: BaseException | None) -> Answer:
            if isinstance(error, OSError):
                return store_failed(store, f"write {vector_id!r} to", error)
            if error is not None:
                return internal_failure("a vector change", error)
            return self._add(vector, retired_mono, old, current)

        return _Write(lambda: store.save(vector), finish)

    def _add(self, vector: HostVector, retired_mono: float | None, old: HostVector | None, current: bool) -> Answer:
        self.registry.add(vector, retired_mono)
        if current and old is not None and old.refs == 0:
            self.slots.drop(old.vector_id, old.version)
        logger.info("hotwire: registered %s@%d (%s)", vector.vector_id, vector.version, vector.sha256[:12])
        return contract.RegisterResult(ok=True, created=old is None, vector=vector.meta())

    def _unregister(self, vector_id: str, version: int | None) -> Answer:
        current = self.registry.current(vector_id)
        deletes = current is not None and (version is None or current.version <= version)
        if self.store is not None and deletes:  # (an unlink: nothing to sync)
            try:
                self.store.delete(vector_id)
            except OSError as exc:
                return store_failed(self.store, f"delete {vector_id!r} from", exc)
        try:
            vector = self.registry.unregister(vector_id, version)
        except RegistryError as exc:
            return exc.to_result()
        if vector is not None and vector.refs == 0:
            self.slots.drop(vector.vector_id, vector.version)
        deleted = vector.version if vector is not None else version
        return contract.UnregisterResult(ok=True, in_flight=self.registry.in_flight(vector_id), version=deleted)


def _write_here(step: _Write) -> Answer:
    """``step`` written in the caller's thread."""
    try:
        step.write()
    except OSError as exc:
        return step.finish(exc)
    return step.finish(None)


def _guarded(call: Callable[[], Any]) -> Any:
    """``call()``, or the 500 ``SteeringController.answer`` gives for what it raises (the caller waits for an
    answer: it must get one)."""
    try:
        return call()
    except Exception as exc:
        return internal_failure("a vector change", exc)
