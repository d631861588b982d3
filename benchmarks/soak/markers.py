"""Marker tokens: which one means which (id, version) (the book the verdicts read), how they are chosen among the
vocabulary, and the vector registered for one (the direction of its LM-head row)."""

from __future__ import annotations

import base64
import math
import random
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np


class MarkerBook:
    """Marker tokens: their text, the id that owns each (pools are disjoint), the token each registered (id,
    version) carries, and when each id was (possibly) unregistered."""

    def __init__(self, texts: dict[int, str], pools: dict[str, list[int]]):
        self.text = texts
        self.pools = pools
        self.owner = {token: vector_id for vector_id, pool in pools.items() for token in pool}
        assert len(self.owner) == sum(len(p) for p in pools.values()), "marker pools overlap"
        self.versions: dict[tuple[str, int], int] = {}
        self.current: dict[str, int] = {}  # id -> marker of its latest registered version
        self.conflicts: list[str] = []  # one (id, version) answered twice with different markers
        self._absent: dict[str, list[list[float]]] = defaultdict(list)

    def next_marker(self, vector_id: str) -> int:
        """The marker the next version of ``vector_id`` takes: the one after its current version's."""
        pool = self.pools[vector_id]
        current = self.current.get(vector_id)
        return pool[0] if current is None else pool[(pool.index(current) + 1) % len(pool)]

    def record(self, vector_id: str, version: int, token: int) -> None:
        known = self.versions.get((vector_id, version))
        if known is not None and known != token:
            self.conflicts.append(f"{vector_id}@{version} answered with markers {known} and {token}")
        self.versions[(vector_id, version)] = token
        self.current[vector_id] = token

    def marker(self, vector_id: str, version: int) -> int | None:
        return self.versions.get((vector_id, version))

    def versions_with(self, vector_id: str, token: int) -> list[int]:
        return sorted(v for (i, v), t in self.versions.items() if i == vector_id and t == token)

    def absent_from(self, vector_id: str, at: float) -> None:
        """``vector_id`` may be unregistered from ``at`` (its delete was sent) until :meth:`present_again`."""
        self._absent[vector_id].append([at, math.inf])

    def present_again(self, vector_id: str, at: float) -> None:
        if self._absent[vector_id]:
            self._absent[vector_id][-1][1] = at

    def was_absent(self, vector_ids: Iterable[str], start: float, end: float) -> bool:
        """Whether any of the ids may have been unregistered at some moment of [start, end]."""
        return any(a <= end and start <= b for i in vector_ids for a, b in self._absent.get(i, ()))

    def describe(self, token: int | None) -> str:
        if token is None:
            return "no marker"
        owner = self.owner.get(token)
        if owner is None:
            return f"token {token} (no marker)"
        versions = ",".join(map(str, self.versions_with(owner, token))) or "?"
        return f"marker {self.text.get(token, '?')!r} of {owner}@{versions}"


def printable_marker_text(text: str) -> bool:
    return bool(text) and all("!" <= c <= "~" for c in text)


def choose_markers(texts: dict[int, str], norms: np.ndarray, excluded: set[int], count: int, seed: int) -> list[int]:
    """``count`` marker tokens: printable ASCII without spaces, none a prefix or suffix of another (nor equal),
    not in ``excluded``, with an LM-head row norm within 0.8-1.25x the candidates' median (so stacked entries
    rank by scale alone). Shortest texts first, in a seeded random order."""
    candidates = [t for t, s in texts.items() if printable_marker_text(s) and t not in excluded]
    if not candidates:
        raise ValueError("no printable marker token outside the excluded ones")
    median = float(np.median(norms[candidates]))
    rng = random.Random(seed)
    ranked = sorted((t for t in candidates if 0.8 * median <= norms[t] <= 1.25 * median),
                    key=lambda t: (len(texts[t]), rng.random()))  # fmt: skip
    chosen: list[int] = []
    for token in ranked:
        text = texts[token]
        if all(not (texts[c].startswith(text) or text.startswith(texts[c]) or texts[c].endswith(text)
                    or text.endswith(texts[c])) for c in chosen):  # fmt: skip
            chosen.append(token)
            if len(chosen) == count:
                return chosen
    raise ValueError(f"only {len(chosen)} marker tokens available, {count} needed: use fewer ids or a smaller --pool")


def unit(row: np.ndarray) -> np.ndarray:
    return (row / np.linalg.norm(row)).astype(np.float32)


def vector_body(vector_id: str, vector: np.ndarray) -> dict[str, Any]:
    return {"id": vector_id, "data": base64.b64encode(vector.tobytes()).decode(), "dtype": "float32",
            "shape": list(vector.shape)}  # fmt: skip
