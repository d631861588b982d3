"""Host registry of steering vectors: every registered vector, keyed by id, with a version per content.

A version is immutable. Re-registering an id makes a new version; the old one is *retired*: requests that do
not name a version get the new one, while requests admitted under the old one keep it until they finish. A
retired version stays usable by requests that name it (``"version": N``: the HTTP admission pins every
request's versions so) for ``retain_s`` seconds after it was retired, and for as long as a request holds it;
then it is dropped. That covers a request that passed the HTTP check before a replace or delete and reaches the
engine after it.

Versions are ordered: a version older than the id's current one (or than its last deletion) that arrives late
(data-parallel engine cores hear of registrations in different orders) is retired at once, never made current,
so every engine core ends with the same current version.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .contract import VectorMeta
from .error_codes import ErrorCode
from .errors import EngineError
from .spec import VECTOR_ID_RE, short_repr, tenant_of
from .vector_bits import ITEMSIZE, as_bits, as_float32, non_finite
from .version_history import VersionHistory

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class RegistryError(EngineError):
    """A registration or lookup that cannot be honoured."""


@dataclass(eq=False)  # identity semantics: one object per version
class HostVector:
    """One version of a vector. ``layers is None`` means a single row usable at any layer."""

    vector_id: str
    version: int
    sha256: str
    dtype: str
    shape: tuple[int, ...]
    layers: tuple[int, ...] | None
    rows: torch.Tensor  # [R, hidden] in the registered dtype
    row_norms: tuple[float, ...]  # L2 norm of each row, computed once at registration
    created_at: float = field(default_factory=time.time)
    refs: int = 0
    retired: bool = False
    retired_at: float = 0.0  # time.monotonic() when retired

    def _index(self, layer: int) -> int | None:
        if self.layers is None:
            return 0
        try:
            return self.layers.index(layer)
        except ValueError:
            return None

    def row(self, layer: int) -> torch.Tensor | None:
        """The row applied at ``layer``, or None if this vector has no row for it."""
        i = self._index(layer)
        return None if i is None else self.rows[i]

    def has_row(self, layer: int) -> bool:
        return self._index(layer) is not None

    def row_norm(self, layer: int) -> float:
        """The norm of the row applied at ``layer`` (0.0 if there is none)."""
        i = self._index(layer)
        return 0.0 if i is None else self.row_norms[i]

    def norms(self) -> dict[str, float]:
        keys = ["*"] if self.layers is None else [str(layer) for layer in self.layers]
        return dict(zip(keys, self.row_norms))

    def meta(self) -> VectorMeta:
        return VectorMeta(
            id=self.vector_id,
            version=self.version,
            sha256=self.sha256,
            dtype=self.dtype,
            shape=list(self.shape),
            layers=None if self.layers is None else list(self.layers),
            norms=self.norms(),
            in_flight=self.refs,
            created_at=self.created_at,
            tenant=tenant_of(self.vector_id) or None,
        )


# Host-side checks run in numpy (``vector_bits``): it works in the calling thread. Small torch CPU ops wake
# torch's intra-op thread pool, which on a busy host stalled the engine core for up to 60 ms per registration.


def decode_vector(
    data: bytes,
    dtype: str,
    shape: list[int],
    layers: list[int] | None,
    n_layers: int,
    hidden_size: int,
    model_dtype: str = "float32",
) -> tuple[torch.Tensor, tuple[int, ...] | None, tuple[float, ...]]:
    """Check raw bytes against the served model; return ``(rows [R, hidden], layers or None, row norms)``.
    ``model_dtype`` is the dtype the bank holds rows in: a value it cannot hold would be inf there."""
    if dtype not in DTYPES:
        raise RegistryError(400, ErrorCode.BAD_DTYPE, f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}", "dtype")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d > 0 for d in shape):
        raise RegistryError(400, ErrorCode.BAD_SHAPE, f"shape must be a list of positive ints, got {shape!r}", "shape")
    if len(shape) not in (1, 2) or shape[-1] != hidden_size:
        raise RegistryError(
            400,
            ErrorCode.BAD_SHAPE,
            f"shape {list(shape)} does not fit this model: use [{hidden_size}] (any layer), "
            f"[{n_layers}, {hidden_size}] (a row per layer) or [len(layers), {hidden_size}] with 'layers'",
            "shape",
        )
    expected = math.prod(shape) * ITEMSIZE[dtype]
    if len(data) != expected:
        raise RegistryError(400, ErrorCode.BAD_DATA, f"data has {len(data)} bytes; shape {list(shape)} of {dtype} needs {expected}", "data")
    values = as_bits(data, dtype).reshape(-1, hidden_size)
    if non_finite(values, dtype).size:
        raise RegistryError(400, ErrorCode.NOT_FINITE, "vector contains NaN or infinite values", "data")

    if len(shape) == 1:
        if layers:
            raise RegistryError(400, ErrorCode.BAD_LAYERS, "'layers' needs a 2-D array with one row per listed layer", "layers")
        layers_t = None
    elif layers is None:
        if shape[0] != n_layers:
            raise RegistryError(
                400, ErrorCode.BAD_SHAPE, f"a 2-D vector without 'layers' needs {n_layers} rows (one per layer), got {shape[0]}", "shape"
            )
        layers_t = tuple(range(n_layers))
    else:
        if len(layers) != shape[0]:
            raise RegistryError(400, ErrorCode.BAD_LAYERS, f"'layers' names {len(layers)} layers but the array has {shape[0]} rows", "layers")
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
                raise RegistryError(400, ErrorCode.LAYER_OUT_OF_RANGE, f"layer {layer!r} is outside [0, {n_layers})", "layers")
        if len(set(layers)) != len(layers):
            raise RegistryError(400, ErrorCode.BAD_LAYERS, "'layers' lists a layer twice", "layers")
        values = values[np.argsort(layers, kind="stable")]
        layers_t = tuple(sorted(layers))
    values = values.copy()  # own the bytes (and make them writable for torch)
    wide = as_float32(values, dtype).astype(np.float64)
    largest = _largest_value(model_dtype)
    peak = float(np.abs(wide).max())
    if peak > largest:
        raise RegistryError(
            400, ErrorCode.OUT_OF_RANGE,
            f"the vector holds {peak:.6g}, beyond the largest value of this model's {model_dtype} ({largest:.6g}): "
            "divide the vector by a constant and multiply the spec's scale by it",
            "data",
        )
    norms = tuple(float(n) for n in np.sqrt(np.einsum("ij,ij->i", wide, wide)))
    return torch.from_numpy(values).view(DTYPES[dtype]), layers_t, norms


def content_sha256(rows: torch.Tensor, dtype: str, layers: tuple[int, ...] | None) -> str:
    h = hashlib.sha256()
    h.update(f"{dtype}|{list(rows.shape)}|{layers}|".encode())
    h.update(rows.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def _largest_value(model_dtype: str) -> float:
    """The largest finite value of the model's dtype (unbounded for a dtype torch does not know)."""
    dtype = getattr(torch, model_dtype, None) if model_dtype else None
    return torch.finfo(dtype).max if isinstance(dtype, torch.dtype) and dtype.is_floating_point else math.inf


CHANGES_KEPT = 4096  # changes a catalog can be brought up to date by; a caller further behind gets it whole


class VectorRegistry:
    """All vectors of one engine. Not thread-safe: the engine core calls it from its busy loop only.
    ``generation`` counts changes of the current versions (what ``hotwire_catalog`` hands the API servers)."""

    def __init__(self, n_layers: int, hidden_size: int, model_dtype: str = "float32", retain_s: float = 60.0):
        self.n_layers, self.hidden_size, self.model_dtype = n_layers, hidden_size, model_dtype
        self.retain_s = retain_s
        self.generation = 0
        self._changes: deque[tuple[int, str]] = deque(maxlen=CHANGES_KEPT)  # (generation, id) of the last changes
        self._current: dict[str, HostVector] = {}
        self._retired: dict[tuple[str, int], HostVector] = {}
        self._held_retired: Counter[str] = Counter()  # id -> references requests hold on its retired versions
        self.history = VersionHistory()

    def register(self, *args: Any, **kwargs: Any) -> HostVector:
        """Add a vector (or a new version of one): :meth:`prepare` (same arguments), then :meth:`add`."""
        vector = self.prepare(*args, **kwargs)
        self.add(vector)
        return vector

    def prepare(
        self,
        vector_id: str,
        data: bytes,
        dtype: str,
        shape: list[int],
        layers: list[int] | None,
        replace: bool,
        version: int | None = None,
        created_at: float | None = None,
    ) -> HostVector:
        """The vector (or new version) ``register`` would add, checked and decoded, without adding it: the caller
        may still fail to store it. ``version`` is given when restoring, or by the engine core that numbers
        versions for all (data parallelism); ``created_at`` only when restoring."""
        if not isinstance(vector_id, str) or not VECTOR_ID_RE.fullmatch(vector_id):
            raise RegistryError(400, ErrorCode.BAD_ID, f"id must match {VECTOR_ID_RE.pattern}, got {short_repr(vector_id)}", "id")
        if vector_id in self._current and not replace and version is None:
            raise RegistryError(
                409, ErrorCode.EXISTS, f"vector {vector_id!r} is already registered; register it with replace=true "
                "(hotwire register --replace) to make a new version", "id"
            )
        rows, layers_t, norms = decode_vector(
            data, dtype, list(shape), layers, self.n_layers, self.hidden_size, self.model_dtype
        )
        version = version if version is not None else self.history.next_version(vector_id)
        sha = content_sha256(rows, dtype, layers_t)
        vector = HostVector(vector_id, version, sha, dtype, tuple(shape), layers_t, rows, norms)
        if created_at is not None:
            vector.created_at = created_at
        return vector

    def supersedes(self, vector: HostVector) -> bool:
        """Whether :meth:`add` would make ``vector`` current (it is newer than the current version and than the
        id's last deletion)."""
        old = self._current.get(vector.vector_id)
        newest = max(old.version if old is not None else 0, self.history.deleted_upto(vector.vector_id))
        return vector.version > newest

    def add(self, vector: HostVector, retired_at: float | None = None) -> bool:
        """Make a prepared vector the current version of its id (the one it replaces is retired); a version older
        than the current one or than the id's last deletion is retired at once. ``retired_at`` (a
        ``time.monotonic()`` value): the version was retired elsewhere then (a fleet's other replica): it is held
        as a retired version only, for what is left of its retention. Returns whether it became current."""
        vector_id = vector.vector_id
        old = self._current.get(vector_id)
        if retired_at is not None or not self.supersedes(vector):
            if (old is None or old.version != vector.version) and (vector_id, vector.version) not in self._retired:
                self._retire(vector, retired_at)
            self.note_version(vector_id, vector.version)
            return False
        self.note_version(vector_id, vector.version)
        if old is not None:
            self._retire(old)
        self._current[vector_id] = vector
        self._changed(vector_id)
        self._prune()
        return True

    def note_version(self, vector_id: str, version: int) -> None:
        """``vector_id`` had ``version`` once: its next version is higher."""
        self.history.note(vector_id, version, self._current)

    def unregister(self, vector_id: str, version: int | None = None) -> HostVector | None:
        """Retire the current version of ``vector_id``. ``version``: the version another engine core deleted
        (data parallelism): a newer current one stays, and the deletion still holds for any older one that
        arrives later. Returns the retired vector (None when ``version`` left a newer one in place)."""
        current = self._current.get(vector_id)
        if version is not None:
            self.history.note_deleted(vector_id, version)
            self.note_version(vector_id, version)
            if current is None or current.version > version:
                return None
        if current is None:
            raise RegistryError(404, ErrorCode.UNKNOWN_VECTOR, f"unknown steering vector {vector_id!r}", "id")
        del self._current[vector_id]
        self.history.note_deleted(vector_id, current.version)
        self._retire(current)
        self._changed(vector_id)
        self._prune()
        return current

    def _changed(self, vector_id: str) -> None:
        self.generation += 1
        self._changes.append((self.generation, vector_id))

    def catalog_vectors(self, generation: int) -> dict[str, Any]:
        """The vectors of a catalog for a caller that holds ``generation`` (-1: none): ``since`` (that generation),
        the current versions of the ids changed after it and the ids ``removed`` since, while the log of changes
        reaches back that far; else every current version. An API server fetches the catalog after every
        registration, and a whole one costs the engine core's loop time in proportion to the registry."""
        log = self._changes
        if 0 <= generation <= self.generation and (generation == self.generation or (log and log[0][0] <= generation + 1)):
            newer = itertools.takewhile(lambda change: change[0] > generation, reversed(log))
            changed = {vector_id for _, vector_id in newer}
            current = [self._current[i] for i in sorted(changed) if i in self._current]
            return {"since": generation, "vectors": [v.meta() for v in current],
                    "removed": sorted(changed.difference(self._current))}
        return {"vectors": [v.meta() for v in self._current.values()]}

    def _retire(self, vector: HostVector, at: float | None = None) -> None:
        vector.retired = True
        if vector.refs:
            self._held_retired[vector.vector_id] += vector.refs
        vector.retired_at = time.monotonic() if at is None else at
        self._retired[(vector.vector_id, vector.version)] = vector

    def _prune(self) -> None:
        """Drop retired versions that no request holds and whose retention is over. ``_retired`` is in the order
        they were retired, so the pass stops at the first one still retained instead of walking them all at every
        change (under churn thousands stay retained); one retired elsewhere earlier (``add``'s ``retired_at``) may
        stay a little longer, never served past its retention (``lookup``)."""
        deadline = time.monotonic() - self.retain_s
        over = []
        for key, vector in self._retired.items():
            if vector.retired_at > deadline:
                break
            if vector.refs == 0:
                over.append(key)
        for key in over:
            del self._retired[key]

    def current(self, vector_id: str) -> HostVector | None:
        return self._current.get(vector_id)

    def lookup(self, vector_id: str, version: int | None = None) -> HostVector | None:
        """The current version of ``vector_id`` (``version`` None), or that version while it is current or
        retained; None otherwise."""
        current = self._current.get(vector_id)
        if version is None or (current is not None and current.version == version):
            return current
        vector = self._retired.get((vector_id, version))
        if vector is not None and vector.refs == 0 and vector.retired_at <= time.monotonic() - self.retain_s:
            return None  # its retention is over (pruned at the next change: vLLM's input thread reads here too)
        return vector

    def vectors(self, tenant: str | None = None) -> list[HostVector]:
        """The current versions: all, or those of ``tenant``'s namespace ("": the shared one)."""
        if tenant is None:
            return list(self._current.values())
        return [v for vector_id, v in self._current.items() if tenant_of(vector_id) == tenant]

    def retained(self) -> list[HostVector]:
        """Retired versions still held by requests or within their retention."""
        self._prune()
        return list(self._retired.values())

    def in_flight(self, vector_id: str) -> int:
        """References held by admitted requests on every live version of ``vector_id`` (kept counted: a listing
        asks it of every vector it lists, and under churn thousands of versions stay retained)."""
        current = self._current.get(vector_id)
        return (current.refs if current is not None else 0) + self._held_retired.get(vector_id, 0)

    def acquire(self, vector: HostVector) -> None:
        vector.refs += 1
        if vector.retired:
            self._held_retired[vector.vector_id] += 1

    def release(self, vector: HostVector) -> bool:
        """Drop one reference; True when this was the last one on a retired version (its bank rows can go; its
        host copy stays for the rest of its retention)."""
        vector.refs -= 1
        if not vector.retired:
            return False
        held = self._held_retired
        held[vector.vector_id] -= 1
        if not held[vector.vector_id]:
            del held[vector.vector_id]
        if vector.refs == 0:
            self._prune()
            return True
        return False
