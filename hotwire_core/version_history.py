"""The version numbers an engine gave out, so that none is given out twice (receipts name ``id@version``): each
id's last version, a floor every id's next version goes on above, and the newest version a deletion removed.

Only the last :data:`HISTORY_KEPT` ids without a current version are remembered by id; older ones only raise the
floor, so a tenant that registers and deletes ever new ids grows neither this nor the store's ``versions.json``
(``store.py``), while every id's next version stays above all it had (versions grow, not always by one)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping

__all__ = ["HISTORY_KEPT", "VersionHistory", "fold_oldest", "note_newest"]

HISTORY_KEPT = 4096


class VersionHistory:
    def __init__(self) -> None:
        self.floor = 0  # the forgotten ids' highest version, or a store's that lost its history (store.py)
        self._last: dict[str, int] = {}  # in the order of the ids' last use: the oldest are forgotten first
        # the last HISTORY_KEPT deletions: a registration another engine core made before one arrives late, within
        # milliseconds (data parallelism), and must not become current
        self._deleted: dict[str, int] = {}

    def next_version(self, vector_id: str) -> int:
        return max(self._last.get(vector_id, 0), self.floor) + 1

    def deleted_upto(self, vector_id: str) -> int:
        """The newest version of ``vector_id`` a deletion removed (0: none remembered)."""
        return self._deleted.get(vector_id, 0)

    def restore(self, versions: Mapping[str, int], floor: int) -> None:
        """The store's history at engine start, before its vectors are current: bounded already, so nothing is
        forgotten here (a live id forgotten would raise the floor for every new id)."""
        self.floor = max(self.floor, floor)
        for vector_id, version in versions.items():
            note_newest(self._last, vector_id, version)

    def note(self, vector_id: str, version: int, current: Collection[str]) -> None:
        """``vector_id`` had ``version``: its next version is higher. ``current``: the ids with a current version,
        never forgotten."""
        note_newest(self._last, vector_id, version)
        if len(self._last) > len(current) + HISTORY_KEPT:
            self._forget_oldest(current)

    def note_deleted(self, vector_id: str, version: int) -> None:
        note_newest(self._deleted, vector_id, version)
        if len(self._deleted) > HISTORY_KEPT:
            del self._deleted[next(iter(self._deleted))]

    def _forget_oldest(self, current: Collection[str]) -> None:
        """Fold the last versions of the ids longest without a current version into the floor, down to three
        quarters of HISTORY_KEPT (a pass every quarter of it)."""
        excess = len(self._last) - len(current) - HISTORY_KEPT * 3 // 4
        self.floor = max(self.floor, fold_oldest(self._last, excess, current.__contains__))


def fold_oldest(newest: dict[str, int], count: int, kept: Callable[[str], bool]) -> int:
    """Take the ``count`` oldest keys of ``newest`` (in :func:`note_newest`'s order) that ``kept`` does not keep out
    of it; returns the highest version taken (0: none), which the caller's floor must reach. ``kept`` is asked only
    as far as needed."""
    taken = list(itertools.islice((key for key in newest if not kept(key)), max(count, 0)))
    return max((newest.pop(key) for key in taken), default=0)


def note_newest(newest: dict[str, int], key: str, version: int) -> None:
    """``newest[key]`` raised to ``version``, the key moved to the end: the dict's order is the keys' last use."""
    newest[key] = max(version, newest.pop(key, 0))
