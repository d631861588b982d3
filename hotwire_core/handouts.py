"""Results kept until their caller takes them, each once (a worker's finished captures and readouts, the engine
core's refusals of ticketed requests): at most ``most`` of them, none older than ``KEEP_S``, so that results nobody
takes (their caller left) cannot pile up."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

__all__ = ["KEEP_S", "Handouts"]

KEEP_S = 600.0


class Handouts:
    def __init__(self, most: int):
        self.most = most
        self.kept: OrderedDict[str, tuple[float, Any]] = OrderedDict()  # tag -> (kept since, result), oldest first

    def put(self, tag: str, result: Any) -> None:
        now = time.monotonic()
        self.kept[tag] = (now, result)
        while self.kept and (len(self.kept) > self.most or next(iter(self.kept.values()))[0] < now - KEEP_S):
            self.kept.popitem(last=False)

    def take(self, tags: Iterable[str]) -> dict[str, Any]:
        """The results of ``tags`` kept here, handed out (and forgotten)."""
        return {tag: self.kept.pop(tag)[1] for tag in tags if tag in self.kept}
