"""Durable vector store: one safetensors file per vector id, written atomically, restored at engine start.

Also reads the ``HOTWIRE_VECTORS`` preload directory (``.safetensors``; ``.pt`` only through
``torch.load(weights_only=True)``, never a plain unpickle).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from .registry import DTYPES, HostVector
from .version_history import HISTORY_KEPT, fold_oldest, note_newest

logger = logging.getLogger(__name__)
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class StoredVector:
    """What ``VectorRegistry.register`` needs to rebuild a vector."""

    vector_id: str
    data: bytes
    dtype: str
    shape: list[int]
    layers: list[int] | None
    version: int | None = None
    created_at: float | None = None


def tensor_to_stored(vector_id: str, tensor: torch.Tensor, layers: list[int] | None = None) -> StoredVector:
    if tensor.dtype not in _DTYPE_NAMES:
        tensor = tensor.float()
    tensor = tensor.detach().cpu().contiguous()
    return StoredVector(vector_id, tensor.view(torch.uint8).numpy().tobytes(), _DTYPE_NAMES[tensor.dtype], list(tensor.shape), layers)


def _write_atomically(path: Path, write) -> None:
    """Call ``write(tmp_path)`` on a temporary file beside ``path`` and move it into place: never a torn file,
    and on disk once this returns (file and folder synced), so a power loss cannot leave an empty one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class HistoryLost(OSError):
    """``versions.json`` is unreadable, or missing beside vector files: the store no longer knows every version
    it gave out (a deleted id's, say)."""


class VectorStore:
    """A directory of ``<id>.safetensors`` files holding tensor ``rows`` plus metadata, and ``versions.json``:
    the last version of every stored id and of the last ids deleted, so that an id deleted and registered again
    after a restart does not reuse a version number (receipts name versions). Beyond ``HISTORY_KEPT`` ids, the
    ids longest without a file are forgotten and only raise a floor every id's versions go on above, kept in the
    file under :data:`FLOOR_KEY`; should the history be lost, :meth:`recover_history` sets that floor where no
    earlier version can have reached."""

    VERSIONS = "versions.json"
    FLOOR_KEY = "*"  # not a vector id (``spec.VECTOR_ID_RE``)

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # versions.json's text as this store last wrote or read it, parsed: parsing it is most of a registration's
        # work once it holds thousands of ids, and another engine core's write changes the text, so it is read again
        self._known: tuple[str, dict[str, int]] | None = None
        self._forget_above = HISTORY_KEPT  # ids in versions.json past which the oldest deleted ones are forgotten

    def last_versions(self) -> dict[str, int]:
        """The last version of every id (and :data:`FLOOR_KEY`); raises :class:`HistoryLost`."""
        path = self.root / self.VERSIONS
        try:
            text = path.read_text()
            if self._known is not None and self._known[0] == text:
                return dict(self._known[1])
            raw = json.loads(text)
            if not isinstance(raw, dict):
                raise TypeError(f"a JSON {type(raw).__name__}, not an object")
            versions = {str(k): int(v) for k, v in raw.items()}
            if any(v < 0 for v in versions.values()):
                raise ValueError("a negative version")
            self._known = (text, versions)
            return dict(versions)
        except FileNotFoundError:
            if any(self.root.glob("*.safetensors")):
                raise HistoryLost(f"{path} is missing but the store holds vectors") from None
            return {}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise HistoryLost(f"{path} is unreadable ({exc})") from None

    def recover_history(self, stored: dict[str, int]) -> int:
        """After :class:`HistoryLost`: move the damaged file aside (``versions.json.damaged-<ms>``) and start a new
        one whose floor is the time in milliseconds (or above the newest stored version, should the clock be
        behind). Versions only ever grow by one per registration, so no number the store gave out before can
        reach it. Returns the floor."""
        path = self.root / self.VERSIONS
        now_ms = int(time.time() * 1000)
        if path.exists():
            os.replace(path, self.root / f"{self.VERSIONS}.damaged-{now_ms}")
        floor = max([now_ms, *stored.values()])
        self._write_versions({**stored, self.FLOOR_KEY: floor})
        return floor

    def note_versions(self, seen: dict[str, int]) -> None:
        """Record that each id reached its version in ``seen`` (one write, only if something grows)."""
        versions = self.last_versions()
        grown = {vid: v for vid, v in seen.items() if versions.get(vid, 0) < v}
        if grown:
            for vector_id, version in grown.items():  # last: the file's order is the ids' last registration
                note_newest(versions, vector_id, version)
            if len(versions) > self._forget_above:
                self._forget_oldest(versions, grown)
            self._write_versions(versions)

    def _forget_oldest(self, versions: dict[str, int], noting: Collection[str]) -> None:
        """Fold the versions of the ids longest without a file into :data:`FLOOR_KEY`, down to three quarters of
        HISTORY_KEPT ids; the next pass once a quarter more have come (stored ids are never forgotten, so a store
        of many keeps its passes apart). ``noting``: the ids being saved, whose files come after this write."""
        def kept(vector_id: str) -> bool:
            return vector_id == self.FLOOR_KEY or vector_id in noting or self._path(vector_id).exists()

        folded = fold_oldest(versions, len(versions) - HISTORY_KEPT * 3 // 4, kept)
        versions[self.FLOOR_KEY] = max(versions.get(self.FLOOR_KEY, 0), folded)
        self._forget_above = len(versions) + HISTORY_KEPT // 4

    def _write_versions(self, versions: dict[str, int]) -> None:
        text = json.dumps(versions)
        _write_atomically(self.root / self.VERSIONS, lambda tmp: Path(tmp).write_text(text))
        self._known = (text, versions)  # (its callers hand it a dict of their own making)

    def save(self, vector: HostVector) -> None:
        meta = {
            "id": vector.vector_id,
            "version": str(vector.version),
            "layers": json.dumps(None if vector.layers is None else list(vector.layers)),
            "shape": json.dumps(list(vector.shape)),
            "sha256": vector.sha256,
            "created_at": repr(vector.created_at),
        }
        rows = vector.rows.contiguous()
        # The version first: should the file then fail, versions.json is ahead of the files, never behind them.
        self.note_versions({vector.vector_id: vector.version})
        data = save({"rows": rows}, metadata=meta)  # bytes: a failed write is an OSError like every other here
        _write_atomically(self._path(vector.vector_id), lambda tmp: Path(tmp).write_bytes(data))

    def delete(self, vector_id: str) -> None:
        self._path(vector_id).unlink(missing_ok=True)

    def _path(self, vector_id: str) -> Path:
        # A tenant's id holds a slash; "~" is in no id, and load() reads the id from the file's metadata.
        return self.root / f"{vector_id.replace('/', '~')}.safetensors"

    def load(self) -> list[StoredVector]:
        out = []
        for path in sorted(self.root.glob("*.safetensors")):
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata()
                    rows = f.get_tensor("rows")
                layers = json.loads(meta["layers"])
                stored = tensor_to_stored(meta["id"], rows)
                # Stored rows are [R, hidden]; a layer-agnostic vector goes back to its registered [hidden] shape.
                shape = json.loads(meta["shape"])
                out.append(
                    StoredVector(
                        meta["id"], stored.data, stored.dtype, shape, None if len(shape) == 1 else layers,
                        int(meta["version"]), float(meta["created_at"]),
                    )
                )
            except Exception as exc:  # one bad file must not stop the engine
                logger.error("hotwire: skipping unreadable stored vector %s: %s", path, exc)
        return out


def load_preload_dir(directory: Path) -> list[StoredVector]:
    """Vectors from ``HOTWIRE_VECTORS``: the file stem is the id; one tensor per file (2-D: a row per layer)."""
    if not directory.is_dir():
        raise ValueError(f"HOTWIRE_VECTORS={directory} is not a directory; unset it or point it at a folder of .safetensors")
    out = []
    for path in sorted(directory.iterdir()):
        try:
            if path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt") as f:
                    names = list(f.keys())
                    if len(names) != 1:
                        raise ValueError(f"expected one tensor, found {names}")
                    tensor = f.get_tensor(names[0])
            elif path.suffix == ".pt":
                tensor = torch.load(path, map_location="cpu", weights_only=True)
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"expected a tensor, found {type(tensor).__name__}")
            else:
                continue
            if any(s.vector_id == path.stem for s in out):  # a.pt beside a.safetensors: which one is meant?
                raise ValueError(f"another file in {directory} has the id {path.stem!r}; keep one")
            out.append(tensor_to_stored(path.stem, tensor))
        except Exception as exc:
            logger.error("hotwire: skipping preload file %s: %s", path, exc)
    return out
