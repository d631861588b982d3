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
    if len(parts) == 1:  # one rank: the probes it does not hold are NaN already
        return first, positions, np.frombuffer(first["values"], np.float32).reshape(len(positions), n, 2)
    values = np.full((len(positions), n, 2), np.nan, np.float32)
    for part in parts:
        mine = np.frombuffer(part["positions"], np.int32)
        if not np.array_equal(mine, positions):
            raise ReadoutLost("the workers read different tokens of this request (pipeline ranks out of step)")
        held = part["held"]
        values[:, held] = np.frombuffer(part["values"], np.float32).reshape(len(mine), n, 2)[:, held]
    return first, positions, values


def _scores(values: np.ndarray, probes: Sequence[dict[str, Any]]) -> list[dict[str, list[float]]]:
    """Per probe, ``score`` (dot + bias) and ``cosine`` from ``values`` ``[m, probes, 2]`` (each token's dot product
    with each probe and the stream's norm), all probes at once."""
    dots, norms = values[..., 0].astype(np.float64), values[..., 1].astype(np.float64)
    denominator = norms * np.array([probe["norm"] for probe in probes], np.float64)
    cosine = np.divide(dots, denominator, out=np.zeros_like(dots), where=denominator > 0)
    scores = dots + np.array([probe["bias"] for probe in probes], np.float64)
    return [{"score": s, "cosine": c} for s, c in zip(scores.T.tolist(), cosine.T.tolist())]


def readout_of(answers: Sequence[dict[str, Any]], tag: str, n_generated: int) -> dict[str, Any]:
    """The readout of the request read under ``tag`` that generated ``n_generated`` tokens (see the module)."""
    first, positions, values = _merged(answers, tag)
    args, prompt_len = first["args"], int(first["prompt_len"])
    probes = args["probes"]
    spans = {}
    if args["tokens"] in ("prompt", "all"):
        spans["prompt"] = (0, prompt_len)
    if args["tokens"] in ("generated", "all"):
        spans["generated"] = (prompt_len - 1, prompt_len - 1 + n_generated)
    out: list[dict[str, Any]] = [{"probe": probe["name"], "bias": probe["bias"]} for probe in probes]
    for name, (lo, hi) in spans.items():
        wanted = np.arange(lo, hi)
        at = np.searchsorted(positions, wanted)
        found = at < len(positions)
        found[found] = positions[at[found]] == wanted[found]
        lost = np.isnan(values[at[found]]).any(axis=(0, 2))
        if not found.all() or lost.any():
            missing = int(wanted[~found][0]) if not found.all() else lo
            raise ReadoutLost(f"the readout of this request has no value for position {missing} (probe "
                              f"{probes[int(np.argmax(lost)) if found.all() else 0]['name']}): the request was "
                              "aborted or preempted past what was read")
        for entry, scored in zip(out, _scores(values[at], probes)):
            entry[name] = scored
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
    return [{"probe": probe["name"], "generated": scored} for probe, scored in zip(probes, _scores(values, probes))]
