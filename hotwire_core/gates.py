"""Probe-gated steering: an entry with a condition (``spec.Condition``) steers a token only where a probe read at a
lower layer in the same forward lets it through, decided on the GPU with no host round trip.

A gated request reads its condition's probe as the last probe of its readout, over every token (so it gets a cache
salt of its own: every prompt token must be computed for its condition to be evaluated). The readout op evaluates
the condition as it projects the stream at the condition's layer and records, per token, whether it held and,
for a latched condition, the first position where it did; the steering op at the later layers reads that
(docs/architecture.md, "Gated steering"). The receipt of what fired (:func:`gate_of`) is computed from the same
float32 values the readout returns, with the kernel's arithmetic, so it names the tokens the GPU steered.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .admission import Lookup, Refusal, Resolved, Rules, find_version
from .contract import GateArgs
from .error_codes import ErrorCode
from .readout_admission import Reading, refuse_in_session
from .readout_spec import READOUT_KEY, Probe, ReadoutSpec
from .spec import SPEC_KEY, Condition

__all__ = ["condition_of", "condition_probe", "gate_args", "gate_of", "gate_receipt", "gated_reading", "holds"]


def condition_of(resolved: Resolved) -> Condition | None:
    """The request's condition (its gated entries share one), pinned to its probe's version."""
    return next((e.when for e, _ in resolved if e.when is not None), None)


def condition_probe(when: Condition) -> Probe:
    """The readout probe a condition is evaluated on (the caller puts it last, with every token read)."""
    return Probe(when.vector_id, when.layer, when.bias, when.version)


def _reads(resolved_probe: tuple[Probe, Any], when: Condition) -> bool:
    """Whether a readout's resolved probe reads what ``when`` (pinned) evaluates."""
    probe, vector = resolved_probe
    return (probe.vector_id, probe.layer, probe.bias, vector.version) == (when.vector_id, when.layer, when.bias,
                                                                           when.version)


def gated_reading(reading: Reading | None, when: Condition, lookup: Lookup, rules: Rules, max_probes: int,
                  session: bool = False) -> Reading:
    """The request's readout with the condition's probe last, every token read and the condition for the workers:
    ``reading`` as the API server built it (it puts the probe there), else extended, or made for a request that
    reads nothing else. ``session``: a streaming-input session's first chunk (its prompt is never whole)."""
    if session:
        refuse_in_session()
    probe = condition_probe(when)
    if reading is None:
        spec, probes = ReadoutSpec((), "all"), []
    else:
        spec, probes = reading.spec, list(reading.probes)
        if probes and spec.tokens == "all" and _reads(probes[-1], when):
            return dataclasses.replace(reading, gate=gate_args(when, len(probes) - 1))
    if len(spec.probes) + 1 > max_probes:
        raise Refusal(400, ErrorCode.BAD_READOUT, f"the readout reads {len(spec.probes)} probes and the gated "
                      f"steering's condition one more; this server reads at most {max_probes} per request "
                      "(HOTWIRE_READOUT_PROBES)", f"{READOUT_KEY}.probes")
    vector = find_version(lookup, when.vector_id, when.version, f"{SPEC_KEY}.when", "probe")
    return Reading(ReadoutSpec((*spec.probes, probe), "all", spec.tag), [*probes, (probe, vector)],
                   gate_args(when, len(probes)))


def gate_args(when: Condition, probe_index: int) -> GateArgs:
    """What the workers evaluate: the condition on readout probe ``probe_index``."""
    return GateArgs(probe=probe_index, threshold=when.threshold, below=when.below, cosine=when.cosine,
                    latch=when.latch, prompt=when.tokens == "prompt")


def holds(gate: GateArgs, dots: np.ndarray, norms: np.ndarray, bias: float, probe_norm: float) -> np.ndarray:
    """Per token, whether the condition held, in the kernel's float32 arithmetic (``triton_readout``)."""
    dots, norms = dots.astype(np.float32), norms.astype(np.float32)
    if gate["cosine"]:
        inv = np.float32(1.0 / max(probe_norm, 1e-30))
        with np.errstate(divide="ignore", invalid="ignore"):
            value = np.where(norms > 0, dots * inv / norms, np.float32(0))
    else:
        value = dots + np.float32(bias)
    threshold = np.float32(gate["threshold"])
    return value < threshold if gate["below"] else value > threshold


def gate_of(gate: GateArgs, name: str, positions: np.ndarray, dots: np.ndarray, norms: np.ndarray, bias: float,
            probe_norm: float, prompt_len: int) -> dict[str, Any]:
    """What the condition did (the response's ``hotwire_gate``): ``fired``; ``position``, the first position where
    it held (``i < prompt_tokens``: prompt token ``i``; else the token generated ``i - prompt_tokens``-th, counting
    from 0, as it was fed back); ``positions_held``. Per token, the gated entries steered exactly the positions where
    it held; latched, every position from ``position`` on."""
    held = holds(gate, dots, norms, bias, probe_norm)
    if gate["prompt"]:
        held &= positions < prompt_len
    hits = positions[held]
    first = int(hits.min()) if len(hits) else None
    return {"condition": name, "fired": first is not None, "position": first, "positions_held": int(held.sum()),
            "prompt_tokens": prompt_len, "latch": bool(gate["latch"])}


def gate_receipt(part: dict[str, Any], positions: np.ndarray, values: np.ndarray, n_generated: int) -> dict[str, Any] | None:
    """The gate receipt from a request's merged readout (``readout_results``; its condition's probe is named by
    ``args["gate"]``) over the positions that fed the prompt and the ``n_generated`` tokens the caller got."""
    gate = part["args"].get("gate")
    if gate is None:
        return None
    prompt_len = int(part["prompt_len"])
    kept = positions < prompt_len - 1 + n_generated
    probe = part["args"]["probes"][gate["probe"]]
    return gate_of(gate, probe["name"], positions[kept], values[kept, gate["probe"], 0], values[kept, gate["probe"], 1],
                   probe["bias"], probe["norm"], prompt_len)
