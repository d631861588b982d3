"""The worker's config table rows: which per-phase steering config each holds, shared by requests with equal
configs (see :class:`ConfigRows`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .contract import SteerItem

__all__ = ["ConfigRows"]


class ConfigRows:
    """Which rows of the device's config table (``cfg_slot`` / ``cfg_scale`` / ``cfg_rel``) hold which per-phase
    config. Requests with the same config share its row (refcounted), so admitting one whose config is live
    already writes nothing to the device. Row 0 is "no steer" and never handed out."""

    def __init__(self, n_rows: int, n_layers: int):
        self.n_rows = n_rows
        self._free = list(range(n_rows - 1, 0, -1))
        self._row_of: dict[tuple, int] = {}  # config items -> its row
        self._key_of: dict[int, tuple] = {}
        self._users: dict[int, int] = {}  # row -> requests (phases) using it
        self._layers: dict[int, np.ndarray] = {}  # row -> the layers it steers (bool [n_layers])
        self.layer_users = np.zeros(n_layers, np.int64)  # live rows steering each layer

    def __len__(self) -> int:
        """Rows in use."""
        return len(self._users)

    def acquire(self, items: Sequence[SteerItem]) -> tuple[int, bool]:
        """The row holding config ``items``, and whether it is new (then the caller writes it to the device)."""
        key = tuple(map(tuple, items))
        row = self._row_of.get(key)
        if row is not None:
            self._users[row] += 1
            return row, False
        if not self._free:
            raise RuntimeError(
                f"hotwire: all {self.n_rows - 1} steering config rows hold configs of running or preempted steered "
                "requests; this should not happen (please report it), and a larger --max-num-seqs makes room"
            )
        row = self._free.pop()
        layers = np.zeros(len(self.layer_users), bool)
        layers[[int(item[0]) for item in items]] = True
        self._row_of[key], self._key_of[row], self._users[row], self._layers[row] = row, key, 1, layers
        self.layer_users += layers
        return row, True

    def release(self, row: int) -> None:
        self._users[row] -= 1
        if not self._users[row]:
            del self._users[row], self._row_of[self._key_of.pop(row)]
            self.layer_users -= self._layers.pop(row)
            self._free.append(row)
