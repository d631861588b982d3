"""Steering specs: what a request asks for, parsed and canonicalised.

A spec travels in ``SamplingParams.extra_args["hotwire"]`` (``vllm_xargs`` over HTTP) as a JSON string
holding one entry or a list of entries::

    {"id": "happy", "layer": [10, 12], "scale": 4.0}
    [{"id": "happy", "layer": 10, "scale": 4.0, "decode_only": true},
     {"id": "formal", "layer": 10, "scale": 0.1, "norm": true}]

Entry fields: ``id`` (string), ``layer`` (int or list of ints), ``scale`` (finite float, taken as float32), optional
``decode_only`` / ``prefill_only`` (bool, mutually exclusive), ``norm`` (bool: the scale is relative to
the token's residual norm, ``residual += scale * |residual| * v/|v|``) and ``version`` (int: steer with that
version of the vector, which must be current or still retained; absent: the version current at admission), ``when`` (a condition, below).
The HTTP admission pins every entry's version this way, so the engine applies what the receipt names.

``when`` gates an entry on a probe: ``{"id": "toxic", "layer": 8, "above": 0.5}`` steers a token only where the
residual stream after layer 8 projects onto vector ``toxic``'s row (dot product plus optional ``bias``, or with
``"cosine": true`` the cosine) above 0.5 (``below``: under). ``"latch": true`` steers from the first token that
crossed to the end of the request; ``"tokens": "prompt"`` evaluates only prompt tokens (with ``latch`` this is
CAST: the prompt decides whether the answer is steered). The condition's layer lies below every layer the entry
steers, and every gated entry of a request shares one condition (``hotwire_core.gates``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import operator
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

SPEC_KEY = "hotwire"
TICKET_KEY = "hotwire_ticket"  # extra_args key the HTTP admission gives a request: the engine keeps its refusal by it
SALT_PREFIX = "hotwire:"  # steered requests' cache salts; a user cache_salt may not start with it (it could forge one)
# Use with fullmatch. The first character is no dot or dash: ids name store files (".", ".." and hidden files) and
# CLI arguments. A tenant's vectors are ``<tenant>/<name>`` (hotwire_api.tenancy); the engine only counts their bank
# rows by tenant (slots.SlotCache), so a slash is the one character an id and a tenant's name may not hold.
TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
VECTOR_ID_RE = re.compile(rf"(?:{TENANT_RE.pattern}/)?{NAME_RE.pattern}")
MAX_ENTRIES = 64
MAX_SPEC_CHARS = 65_536  # far above 64 entries of 64-character ids; longer specs are refused before parsing
_CACHED_SPEC_CHARS = 1024  # specs up to this length are cached: a server sees few distinct short specs
_ENTRY_FIELDS = {"id", "layer", "scale", "decode_only", "prefill_only", "norm", "version", "when"}
_CONDITION_FIELDS = {"id", "layer", "above", "below", "bias", "cosine", "latch", "tokens", "version"}
FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103  # the smallest magnitude float32 rounds to inf (FLOAT32_MAX + half a step)


def tenant_of(vector_id: str) -> str:
    """The tenant whose namespace holds ``vector_id``; "" for the shared namespace."""
    tenant, slash, _ = vector_id.partition("/")
    return tenant if slash else ""


class Phase(str, Enum):
    """Which tokens of a request an entry steers, decided from request state (position vs prompt length)."""

    ALL = "all"
    PREFILL = "prefill"  # prompt tokens only
    DECODE = "decode"  # generated tokens only


@dataclass(frozen=True)
class Condition:
    """When a gated entry steers a token: the probe ``vector_id`` (at ``version``) read after ``layer`` crosses
    ``threshold`` (``below``: from above). ``tokens``: ``"all"`` or ``"prompt"`` (only prompt tokens are
    evaluated)."""

    vector_id: str
    layer: int
    threshold: float
    below: bool = False
    bias: float = 0.0
    cosine: bool = False
    latch: bool = False
    tokens: str = "all"
    version: int | None = None

    def pinned(self, version: int | None) -> Condition:
        return dataclasses.replace(self, version=version)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.vector_id, "layer": self.layer, "below" if self.below else "above": self.threshold}
        for name, value, default in (("bias", self.bias, 0.0), ("cosine", self.cosine, False),
                                     ("latch", self.latch, False), ("tokens", self.tokens, "all"),
                                     ("version", self.version, None)):
            if value != default:
                out[name] = value
        return out

    def describe(self) -> str:
        """For receipts: ``toxic@3:L8>0.5`` (``cos`` for a cosine, ``,latch``, ``,prompt``)."""
        measure = "cos" if self.cosine else ""
        bias = f"{self.bias:+g}" if self.bias else ""
        flags = (",latch" if self.latch else "") + (",prompt" if self.tokens == "prompt" else "")
        return (f"{self.vector_id}@{self.version}:L{self.layer}{measure}{bias}{'<' if self.below else '>'}"
                f"{self.threshold:g}{flags}")


class SpecError(ValueError):
    """A spec that cannot be parsed; ``field`` names the offending field (e.g. ``hotwire[1].scale``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class SteeringEntry:
    """One vector applied at one or more layers with one scale."""

    vector_id: str
    layers: tuple[int, ...]
    scale: float
    phase: Phase = Phase.ALL
    norm: bool = False
    version: int | None = None  # None: the version current when the engine admits the request
    when: Condition | None = None  # a gated entry steers only the tokens its condition lets through

    def pinned(self, version: int | None, when_version: int | None = None) -> SteeringEntry:
        """This entry bound to ``version`` of its vector (and its condition to ``when_version`` of its probe)."""
        when = self.when.pinned(when_version) if self.when is not None else None
        return dataclasses.replace(self, version=version, when=when)

    def steering(self) -> SteeringEntry:
        """What the entry does, without the versions that name its vectors' contents (the cache salt and the
        strength check use the contents themselves)."""
        return self if self.version is None and (self.when is None or self.when.version is None) else self.pinned(None)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.vector_id, "layer": list(self.layers), "scale": self.scale}
        if self.phase is Phase.DECODE:
            out["decode_only"] = True
        elif self.phase is Phase.PREFILL:
            out["prefill_only"] = True
        if self.norm:
            out["norm"] = True
        if self.version is not None:
            out["version"] = self.version
        if self.when is not None:
            out["when"] = self.when.to_json()
        return out


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(field, f"must be a finite number, got {short_repr(value)}")
    if abs(value) >= _FLOAT32_OVERFLOW:
        raise SpecError(field, f"{value!r} is outside float32's range")
    return float(np.float32(value))  # compared in float32 on the GPU: the value that decides is float32's


def _version(value: Any, field: str) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SpecError(field, f"must be a positive int (a version of the vector), got {short_repr(value)}")
    return value


def _parse_condition(raw: Any, field: str, layers: list[int]) -> Condition:
    if not isinstance(raw, dict):
        raise SpecError(field, f'must be an object such as {{"id": "toxic", "layer": 8, "above": 0.5}}, got {short_repr(raw)}')
    unknown = set(raw) - _CONDITION_FIELDS
    if unknown:
        raise SpecError(f"{field}.{sorted(unknown)[0][:64]}", f"unknown field; allowed: {sorted(_CONDITION_FIELDS)}")
    vector_id, layer = raw.get("id"), raw.get("layer")
    if not isinstance(vector_id, str) or not VECTOR_ID_RE.fullmatch(vector_id):
        raise SpecError(f"{field}.id", f"must match {VECTOR_ID_RE.pattern}, got {short_repr(vector_id)}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise SpecError(f"{field}.layer", f"must be one non-negative layer index, got {short_repr(layer)}")
    if layer >= min(layers):
        raise SpecError(f"{field}.layer", f"must be below every layer the entry steers (lowest {min(layers)}): the "
                        "condition is decided from the stream after its layer, before the steering it gates")
    if ("above" in raw) == ("below" in raw):
        raise SpecError(field, "needs exactly one of above and below (the threshold)")
    below = "below" in raw
    threshold = _number(raw["below" if below else "above"], f"{field}.{'below' if below else 'above'}")
    tokens = raw.get("tokens", "all")
    if tokens not in ("all", "prompt"):
        raise SpecError(f"{field}.tokens", f"must be all or prompt, got {short_repr(tokens)}")
    return Condition(vector_id, layer, threshold, below, _number(raw.get("bias", 0.0), f"{field}.bias"),
                     _bool(raw.get("cosine", False), f"{field}.cosine"), _bool(raw.get("latch", False), f"{field}.latch"),
                     tokens, _version(raw.get("version"), f"{field}.version"))


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(field, f"must be true or false, got {short_repr(value)}")
    return value


def _parse_entry(raw: Any, field: str) -> SteeringEntry:
    if not isinstance(raw, dict):
        raise SpecError(field, f"each entry must be a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - _ENTRY_FIELDS
    if unknown:
        name = sorted(unknown)[0]
        shown = name if len(name) <= 64 else f"{name[:64]}..."
        raise SpecError(f"{field}.{shown}", f"unknown field; allowed: {sorted(_ENTRY_FIELDS)}")
    for required in ("id", "layer", "scale"):
        if required not in raw:
            raise SpecError(f"{field}.{required}", "is required")

    vector_id = raw["id"]
    if not isinstance(vector_id, str) or not VECTOR_ID_RE.fullmatch(vector_id):
        raise SpecError(f"{field}.id", f"must match {VECTOR_ID_RE.pattern}, got {short_repr(vector_id)}")

    layer = raw["layer"]
    layers = layer if isinstance(layer, list) else [layer]
    if not layers:
        raise SpecError(f"{field}.layer", "must name at least one layer")
    for value in layers:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SpecError(f"{field}.layer", f"must be a non-negative int or a list of them, got {short_repr(layer)}")
    if len(set(layers)) != len(layers):
        raise SpecError(f"{field}.layer", f"lists a layer twice: {short_repr(layer)}")

    scale = raw["scale"]
    if isinstance(scale, int) and not isinstance(scale, bool):
        try:
            scale = float(scale)
        except OverflowError:
            raise SpecError(f"{field}.scale", f"is too large for a float (about 2**{scale.bit_length()})") from None
    if not isinstance(scale, float) or not math.isfinite(scale):
        raise SpecError(f"{field}.scale", f"must be a finite number, got {short_repr(scale)}")
    if abs(scale) >= _FLOAT32_OVERFLOW:  # the per-token scale table is float32: a larger scale would become inf
        raise SpecError(f"{field}.scale", f"{scale!r} is outside float32's range (|scale| <= {FLOAT32_MAX:.4g})")
    scale32 = np.float32(scale)
    # What steers is the float32 value: written with the fewest digits that give it back, scales that steer
    # alike get one cache salt, e.g. 0.1 and numpy's float32(0.1) = 0.10000000149011612.
    scale = float(str(scale32 + np.float32(0)))  # + 0: -0.0 (or a negative scale too small for float32) is 0.0

    decode_only = _bool(raw.get("decode_only", False), f"{field}.decode_only")
    prefill_only = _bool(raw.get("prefill_only", False), f"{field}.prefill_only")
    if decode_only and prefill_only:
        raise SpecError(f"{field}.decode_only", "decode_only and prefill_only exclude each other")
    phase = Phase.DECODE if decode_only else Phase.PREFILL if prefill_only else Phase.ALL
    norm = _bool(raw.get("norm", False), f"{field}.norm")
    version = _version(raw.get("version"), f"{field}.version")
    when = _parse_condition(raw["when"], f"{field}.when", layers) if raw.get("when") is not None else None
    return SteeringEntry(vector_id, tuple(sorted(layers)), float(scale), phase, norm, version, when)


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages quote what a client sent, which may be huge."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_spec(value: Any) -> tuple[SteeringEntry, ...]:
    """Parse a spec (JSON string, dict or list of dicts) into entries; raises :class:`SpecError`."""
    if isinstance(value, str):
        if len(value) > MAX_SPEC_CHARS:
            raise SpecError(SPEC_KEY, f"is {len(value)} characters long; at most {MAX_SPEC_CHARS} are allowed")
        if len(value) <= _CACHED_SPEC_CHARS:
            return _parse_cached(value)
        return _parse_spec_string(value)
    return _parse_spec_value(value)


def _parse_spec_string(text: str) -> tuple[SteeringEntry, ...]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(SPEC_KEY, f"is not valid JSON ({exc.msg} at char {exc.pos})") from None
    except RecursionError:
        raise SpecError(SPEC_KEY, "nests too deeply to be read; a spec is an object or a list of objects") from None
    except ValueError:  # Python refuses integers of over 4300 digits
        raise SpecError(SPEC_KEY, "holds a number with too many digits to be read") from None
    return _parse_spec_value(value)


# Cached (the result is immutable): a server sees the same few spec strings over and over, and the engine parses
# each request's twice (``cache_salt_for``, then admission). Only short strings: the cache keeps its keys, and a
# client chooses them.
_parse_cached = functools.lru_cache(maxsize=1024)(_parse_spec_string)


def _parse_spec_value(value: Any) -> tuple[SteeringEntry, ...]:
    if isinstance(value, dict):
        return (_parse_entry(value, SPEC_KEY),)
    if not isinstance(value, list):
        raise SpecError(SPEC_KEY, f"must be a JSON object or a list of objects, got {type(value).__name__}")
    if not value:
        raise SpecError(SPEC_KEY, "is an empty list; omit the field to serve unsteered")
    if len(value) > MAX_ENTRIES:
        raise SpecError(SPEC_KEY, f"has {len(value)} entries; at most {MAX_ENTRIES} are allowed")
    entries = tuple(_parse_entry(raw, f"{SPEC_KEY}[{i}]") for i, raw in enumerate(value))
    conditions = [(i, e.when) for i, e in enumerate(entries) if e.when is not None]
    for i, when in conditions[1:]:
        if when != conditions[0][1]:
            raise SpecError(f"{SPEC_KEY}[{i}].when", "differs from the condition of entry "
                            f"{conditions[0][0]}: the gated entries of a request share one condition")
    return entries


def canonical_spec(entries: tuple[SteeringEntry, ...]) -> str:
    """A stable string for a spec: same steering, same string (entry order is kept: it is not semantic
    for the sum, but keeping it makes receipts read like the request)."""
    return json.dumps([e.to_json() for e in entries], sort_keys=True, separators=(",", ":"))


def build_spec(*entries: dict[str, Any]) -> str:
    """Build and validate a spec string for ``SamplingParams(extra_args={"hotwire": ...})`` or ``vllm_xargs``.

    >>> build_spec({"id": "happy", "layer": 10, "scale": 4.0})
    '[{"id":"happy","layer":[10],"scale":4.0}]'

    Numpy and torch numbers (and arrays or tuples of layers) are taken as the Python numbers they hold.
    """
    return canonical_spec(parse_spec([_python_numbers(e) for e in entries]))


def _python_numbers(entry: Any) -> Any:
    if not isinstance(entry, dict):
        return entry
    out = dict(entry)
    layer = out.get("layer")
    if hasattr(layer, "tolist"):  # numpy / torch: an array, or a scalar (tolist gives its Python number)
        layer = layer.tolist()
    if isinstance(layer, (tuple, range)):
        layer = list(layer)
    if isinstance(layer, list):
        layer = [as_index(v) for v in layer]
    elif layer is not None:
        layer = as_index(layer)
    if "layer" in out:
        out["layer"] = layer
    scale = out.get("scale")
    if isinstance(scale, numbers.Real) and not isinstance(scale, (bool, int, float)):
        out["scale"] = float(scale)
    elif hasattr(scale, "item") and getattr(scale, "ndim", None) == 0:  # a 0-dim tensor
        out["scale"] = scale.item()
    return out


def as_index(value: Any) -> Any:
    """An integer-like value (numpy / torch integer) as an int; anything else (a bool tensor too, which has
    ``__index__``) unchanged, for the caller to refuse."""
    if isinstance(value, (bool, int)) or not hasattr(value, "__index__") or "bool" in str(getattr(value, "dtype", "")):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value
