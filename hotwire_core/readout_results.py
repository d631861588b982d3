"""A finished request's readout as its reader gets it, from the workers' answers to ``hotwire_take_readouts``
(every rank answers for the probes at the layers it hooks): shared by the offline ``generate_with_readout`` and the
API server, which puts it in the response.

Per probe, for the tokens asked for: ``score`` (the dot product of the residual stream after the probe's layer with
the probe's row, plus its ``bias``) and ``cosine`` (between the two; 0 where either is zero). Prompt token ``i`` is
read at position ``i``; generated token ``j`` at the position that predicted it, ``prompt length - 1 + j``. A gated
request's readout carries ``gate`` (``gates.gate_of``) in place of its condition's probe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .error_codes import ErrorCode
from .errors import EngineError
from .gates import gate_receipt

__all__ = ["ReadoutLost", "generated_so_far", "readout_of"]


class ReadoutLost(EngineError):
    """A readout the workers did not return whole (its request was aborted, or a worker lost it)."""

    def __init__(self, message: str):
        super().__init__(500, ErrorCode.READOUT_LOST, message)


def _merged(answers: Sequence[dict[str, Any]], tag: str) -> tuple[dict, np.ndarray, np.ndarray]:
    """``(args and prompt length, positions, values [m, probes, 2])`` of ``tag`` over every rank's answer."""
    parts = [a["readouts"][tag] for a in answers if tag in a.get("readouts", {})]
    errors = [p["error"] for p in parts if "error" in p]
    if errors or not parts:
        raise ReadoutLost(f"the readout of this request was lost: {errors[0] if errors else 'no worker returned it'}")
    first = parts[0]
    n = len(first["args"]["probes"])
    positions = np.frombuffer(first["positions"], np.int32)
    values = np.full((len(positions), n, 2), np.nan, np.float32)
    for part in parts:
        mine = np.frombuffer(part["positions"], np.int32)
        if not np.array_equal(mine, positions):
            raise ReadoutLost("the workers read different tokens of this request (pipeline ranks out of step)")
        held = part["held"]
        values[:, held] = np.frombuffer(part["values"], np.float32).reshape(len(mine), n, 2)[:, held]
    return first, positions, values


def _scored(values: np.ndarray, probe: dict[str, Any]) -> dict[str, list[float]]:
    """``score`` (dot + bias) and ``cosine`` from ``values`` ``[m, 2]`` (each token's dot product and norm)."""
    dots, norms = values[:, 0].astype(np.float64), values[:, 1].astype(np.float64)
    denominator = norms * probe["norm"]
    cosine = np.divide(dots, denominator, out=np.zeros_like(dots), where=denominator > 0)
    return {"score": (dots + probe["bias"]).tolist(), "cosine": cosine.tolist()}


def readout_of(answers: Sequence[dict[str, Any]], tag: str, n_generated: int) -> dict[str, Any]:
    """The readout of the request read under ``tag`` that generated ``n_generated`` tokens (see the module)."""
    first, positions, values = _merged(answers, tag)
    args, prompt_len = first["args"], int(first["prompt_len"])
    spans = {}
    if args["tokens"] in ("prompt", "all"):
        spans["prompt"] = (0, prompt_len)
    if args["tokens"] in ("generated", "all"):
        spans["generated"] = (prompt_len - 1, prompt_len - 1 + n_generated)
    out = []
    for k, probe in enumerate(args["probes"]):
        entry: dict[str, Any] = {"probe": probe["name"], "bias": probe["bias"]}
        for name, (lo, hi) in spans.items():
            at = np.searchsorted(positions, np.arange(lo, hi))
            found = (at < len(positions)) & (positions[np.minimum(at, len(positions) - 1)] == np.arange(lo, hi)) \
                if len(positions) else np.zeros(hi - lo, bool)
            if not found.all() or np.isnan(values[at[found], k]).any():
                missing = int(np.arange(lo, hi)[~found][0]) if not found.all() else lo
                raise ReadoutLost(f"the readout of this request has no value for position {missing} (probe "
                                  f"{probe['name']}): the request was aborted or preempted past what was read")
            entry[name] = _scored(values[at, k], probe)
        out.append(entry)
    result: dict[str, Any] = {"tokens": args["tokens"], "probes": out}
    gate = gate_receipt(first, positions, values, n_generated)
    if gate is not None:  # its probe is the condition's, not one the reader asked for
        del out[args["gate"]["probe"]]
        result["gate"] = gate
    return result


def generated_so_far(answers: Sequence[dict[str, Any]], tag: str, first: int) -> list[dict[str, Any]] | None:
    """The generated tokens' values from token ``first`` on that every rank has read (``hotwire_peek_readouts``),
    as far as they run without a gap: per probe ``{"probe", "generated": {"score", "cosine"}}``; None when there
    are none yet."""
    parts = [a["readouts"][tag] for a in answers if tag in a.get("readouts", {})]
    if not parts or any("error" in p for p in parts):
        return None
    probes = parts[0]["args"]["probes"]
    start = int(parts[0]["prompt_len"]) - 1 + first
    n = None  # tokens from start that every rank holds, in a row
    for part in parts:
        positions = np.frombuffer(part["positions"], np.int32)
        run = int(np.argmin(np.append(positions == start + np.arange(len(positions)), False)))
        n = run if n is None else min(n, run)
    if not n:
        return None
    values = np.full((n, len(probes), 2), np.nan, np.float32)
    for part in parts:
        held = part["held"]
        mine = np.frombuffer(part["values"], np.float32).reshape(-1, len(probes), 2)[:n]
        values[:, held] = mine[:, held]
    if np.isnan(values).any():
        return None  # a probe no rank holds: the final readout says so
    return [{"probe": probe["name"], "generated": _scored(values[:, k], probe)} for k, probe in enumerate(probes)]
