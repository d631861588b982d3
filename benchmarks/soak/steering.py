"""What a request asks for (its steering entries, as sent in ``vllm_xargs.hotwire``) and what its
``x-hotwire-receipt`` says was applied, and how the two must agree."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

CLASS_WEIGHTS = {"plain": 0.25, "single": 0.5, "stacked": 0.10, "decode_only": 0.075, "prefill_only": 0.075}
PHASE_OF = {"single": "all", "stacked": "all", "decode_only": "decode", "prefill_only": "prefill"}

# -- receipts ----------------------------------------------------------------------------------------------------

_RECEIPT_ENTRY = re.compile(
    r"(?P<id>[A-Za-z0-9_][A-Za-z0-9._-]{0,63})@(?P<version>\d+):L(?P<layers>\d+(?:\+\d+)*)"
    r"x(?P<scale>[^,;]+)(?P<flags>(?:,[a-z_]+)*)"
)


@dataclass(frozen=True)
class ReceiptEntry:
    """One entry of ``x-hotwire-receipt``: ``id@version:L<layers joined by +>x<scale :g>`` and flags ``,norm``,
    ``,decode_only`` / ``,prefill_only`` (hotwire_core/admission.py ``receipt``; before 528d6ca controller.py)."""

    vector_id: str
    version: int
    layers: tuple[int, ...]
    scale: float
    flags: frozenset[str]


def parse_receipt(text: str) -> tuple[ReceiptEntry, ...]:
    """Entries of a receipt (joined by ``;``); raises ValueError for one that does not read."""
    entries = []
    for part in text.split(";"):
        match = _RECEIPT_ENTRY.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"unreadable receipt entry {part!r}")
        layers = tuple(int(x) for x in match["layers"].split("+"))
        flags = frozenset(f for f in match["flags"].split(",") if f)
        entries.append(ReceiptEntry(match["id"], int(match["version"]), layers, float(match["scale"]), flags))
    return tuple(entries)


# -- what a request asks for -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One steering entry as sent; ``phase`` is ``all``, ``decode`` or ``prefill``; ``as_list`` sends the layer
    as ``[layer]``."""

    vector_id: str
    layer: int
    scale: float
    phase: str = "all"
    as_list: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.vector_id, "layer": [self.layer] if self.as_list else self.layer,
                               "scale": self.scale}  # fmt: skip
        if self.phase != "all":
            out[f"{self.phase}_only"] = True
        return out

    @property
    def flags(self) -> frozenset[str]:
        return frozenset() if self.phase == "all" else frozenset({f"{self.phase}_only"})


@dataclass(frozen=True)
class Spec:
    """A request's steering: ``kind`` is a key of :data:`CLASS_WEIGHTS`; no entries for ``plain``."""

    kind: str
    entries: tuple[Entry, ...] = ()

    def wire(self) -> str | None:
        """The ``vllm_xargs.hotwire`` string, or None for a plain request."""
        if not self.entries:
            return None
        values = [e.to_json() for e in self.entries]
        return json.dumps(values[0] if len(values) == 1 else values)

    @property
    def steered(self) -> bool:
        return bool(self.entries)


def receipt_problem(entries: Sequence[Entry], receipt: Sequence[ReceiptEntry]) -> str | None:
    """How a receipt disagrees with the request's entries (ids, layers, float32 scale to 6 digits, flags), or None."""
    if len(entries) != len(receipt):
        return f"receipt has {len(receipt)} entries for {len(entries)} requested"
    for i, (sent, got) in enumerate(zip(entries, receipt)):
        scale32 = float(np.float32(sent.scale))
        if got.vector_id != sent.vector_id:
            return f"entry {i}: receipt names id {got.vector_id!r}, request {sent.vector_id!r}"
        if got.layers != (sent.layer,):
            return f"entry {i}: receipt layers {got.layers}, request {(sent.layer,)}"
        if not math.isclose(got.scale, scale32, rel_tol=1e-5, abs_tol=1e-30):
            return f"entry {i}: receipt scale {got.scale:g}, request {scale32:g}"
        if got.flags != sent.flags:
            return f"entry {i}: receipt flags {sorted(got.flags)}, request {sorted(sent.flags)}"
    return None
