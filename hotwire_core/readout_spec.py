"""Readout specs: what a request asks to read from its residual stream, parsed and checked.

A readout travels in ``SamplingParams.extra_args["hotwire_readout"]`` (``vllm_xargs`` over HTTP) as a JSON string
or an object::

    {"probes": [{"id": "happy", "layer": 10}, {"id": "refusal", "layer": 14, "bias": -0.5}],
     "tokens": "generated"}

``probes``: registered vectors used as linear probes (``id``, ``layer``, optional ``bias`` added to the dot
product, optional ``version``); ``tokens``: ``prompt``, ``generated`` (the default) or ``all``; optional ``tag``:
the handle the readout is taken by (default: the engine's request id). For each probe and token the reader gets the
dot product of the residual stream after the layer (where steering adds) with the probe's row, plus ``bias``, and
the cosine between the two. A generated token's value is read at the position that predicted it, as its logprob is:
the first generated token's at the last prompt token.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .spec import SpecError, VECTOR_ID_RE, short_repr

__all__ = ["READOUT_KEY", "TOKENS", "Probe", "ReadoutSpec", "build_readout", "parse_readout"]

READOUT_KEY = "hotwire_readout"
TOKENS = ("prompt", "generated", "all")
MAX_READOUT_CHARS = 16_384
_FIELDS = {"probes", "tokens", "tag"}
_PROBE_FIELDS = {"id", "layer", "bias", "version"}


@dataclass(frozen=True)
class Probe:
    vector_id: str
    layer: int
    bias: float = 0.0
    version: int | None = None


@dataclass(frozen=True)
class ReadoutSpec:
    probes: tuple[Probe, ...]
    tokens: str = "generated"
    tag: str | None = None

    @property
    def reads_prompt(self) -> bool:
        """Whether prompt tokens before the last are read: their residuals must be computed, not cached."""
        return self.tokens in ("prompt", "all")

    def to_json(self) -> dict[str, Any]:
        probes = [{"id": p.vector_id, "layer": p.layer, "bias": p.bias, **({"version": p.version} if p.version else {})}
                  for p in self.probes]
        return {"probes": probes, "tokens": self.tokens, **({"tag": self.tag} if self.tag else {})}


def _probe(raw: Any, field: str) -> Probe:
    if not isinstance(raw, dict):
        raise SpecError(field, f"each probe must be an object with id and layer, got {short_repr(raw)}")
    unknown = sorted(set(raw) - _PROBE_FIELDS)
    if unknown:
        raise SpecError(f"{field}.{unknown[0][:64]}", f"unknown field; allowed: {sorted(_PROBE_FIELDS)}")
    vector_id, layer, bias, version = raw.get("id"), raw.get("layer"), raw.get("bias", 0.0), raw.get("version")
    if not isinstance(vector_id, str) or not VECTOR_ID_RE.fullmatch(vector_id):
        raise SpecError(f"{field}.id", f"must match {VECTOR_ID_RE.pattern}, got {short_repr(vector_id)}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise SpecError(f"{field}.layer", f"must be one non-negative layer index, got {short_repr(layer)}")
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
        raise SpecError(f"{field}.bias", f"must be a finite number, got {short_repr(bias)}")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise SpecError(f"{field}.version", f"must be a positive int (a version of the vector), got {short_repr(version)}")
    return Probe(vector_id, layer, float(bias), version)


def parse_readout(value: Any, max_probes: int) -> ReadoutSpec:
    """Parse a readout (JSON string or object) into a :class:`ReadoutSpec`; raises :class:`SpecError`.
    ``max_probes``: probes one request may read (``HOTWIRE_READOUT_PROBES``)."""
    if isinstance(value, str):
        if len(value) > MAX_READOUT_CHARS:
            raise SpecError(READOUT_KEY, f"is {len(value)} characters long; at most {MAX_READOUT_CHARS} are allowed")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise SpecError(READOUT_KEY, "is not valid JSON; a readout is an object with probes and tokens") from None
    if not isinstance(value, dict):
        raise SpecError(READOUT_KEY, f"must be a JSON object with probes (and tokens), got {type(value).__name__}")
    unknown = sorted(set(value) - _FIELDS)
    if unknown:
        raise SpecError(f"{READOUT_KEY}.{unknown[0][:64]}", f"unknown field; allowed: {sorted(_FIELDS)}")
    probes = value.get("probes")
    if isinstance(probes, dict):
        probes = [probes]
    if not isinstance(probes, list) or not probes:
        raise SpecError(f"{READOUT_KEY}.probes", "must be a non-empty list of probes ({id, layer[, bias]})")
    if len(probes) > max_probes:
        raise SpecError(f"{READOUT_KEY}.probes", f"has {len(probes)} probes; this server reads at most {max_probes} per "
                        "request (HOTWIRE_READOUT_PROBES)")
    parsed = tuple(_probe(raw, f"{READOUT_KEY}.probes[{i}]") for i, raw in enumerate(probes))
    tokens = value.get("tokens", "generated")
    if tokens not in TOKENS:
        raise SpecError(f"{READOUT_KEY}.tokens", f"must be one of {', '.join(TOKENS)}, got {short_repr(tokens)}")
    tag = value.get("tag")
    if tag is not None and (not isinstance(tag, str) or not VECTOR_ID_RE.fullmatch(tag)):
        raise SpecError(f"{READOUT_KEY}.tag", f"must match {VECTOR_ID_RE.pattern}, got {short_repr(tag)}")
    return ReadoutSpec(parsed, tokens, tag)


def build_readout(probes: list[dict[str, Any]], tokens: str = "generated") -> str:
    """A readout's value for ``extra_args`` / ``vllm_xargs`` (a JSON string), checked here; raises
    :class:`SpecError`. The server checks its own probe limit."""
    spec = parse_readout({"probes": list(probes), "tokens": tokens}, max_probes=1 << 16)
    return json.dumps(spec.to_json(), separators=(",", ":"))
