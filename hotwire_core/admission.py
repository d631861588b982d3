"""Deciding a steered request: which versions it steers with, whether they may be applied as asked, its
receipt and its cache salt.

Pure functions over a catalog of vectors, so that the engine core (over its registry) and the API servers (over
the catalog snapshot the engine core hands them: ``hotwire_catalog``) decide alike. The API server decides a
request once, pins every entry to the version it resolved (``"version"`` in the spec) and writes the receipt;
the engine core resolves the pinned spec again against its registry, where retired versions are retained long
enough for that, and applies exactly those versions. What only the engine core knows (free bank rows) it
decides alone: a request whose rows are taken waits for them.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .contract import ADMISSION_ONLY_KEYS, ModelView
from .error_codes import ErrorCode
from .errors import EngineError
from .settings import format_layers
from .slots import RowKey
from .spec import SALT_PREFIX, SPEC_KEY, Phase, SpecError, SteeringEntry, canonical_spec, parse_spec

__all__ = [
    "DEFAULT_STRENGTH_LIMIT", "STRENGTH_LIMITS", "ModelInfo", "Refusal", "Resolved", "Rules", "StrengthLimit",
    "VectorView", "cache_salt", "check_client_fields", "check_rows", "find_probe", "find_version", "pinned_spec", "presalt",
    "receipt", "resolve", "row_key", "row_keys", "row_sources",
]


class Refusal(EngineError):
    """A request the engine cannot steer as asked."""


class VectorView(Protocol):
    """What deciding a request needs of one version of a vector (a registry ``HostVector``, or an entry of the
    API server's catalog snapshot)."""

    vector_id: str
    version: int
    sha256: str
    layers: tuple[int, ...] | None

    def has_row(self, layer: int) -> bool: ...
    def row_norm(self, layer: int) -> float: ...


Lookup = Callable[[str, "int | None"], "VectorView | None"]  # (id, version or None for the current) -> version
Resolved = list[tuple[SteeringEntry, Any]]  # (entry, its VectorView), in spec order


@dataclass(frozen=True)
class StrengthLimit:
    """How hard one request may steer a token, per phase, over all its layers (``_check_strength``): absolute
    entries add at most ``added_norm`` to the residual-stream norm, norm-relative ones grow it at most
    ``norm_growth``-fold. Stronger steering overflows the model's arithmetic, and the NaN or inf it writes into
    KV blocks outlives the request: on vLLM's CPU backend later plain requests read it back from reused blocks."""

    added_norm: float
    norm_growth: float


STRENGTH_LIMITS = {"float16": StrengthLimit(4096.0, 8.0)}  # float16 overflows at 65504
DEFAULT_STRENGTH_LIMIT = StrengthLimit(1e6, 1e3)  # bfloat16 and float32: sums of squares stay far from 3.4e38


@dataclass(frozen=True)
class ModelInfo:
    """What the workers reported about the served model."""

    steerable: bool
    reason: str
    n_layers: int
    hidden_size: int
    dtype: str
    layers: frozenset[int]  # layers with a hook, over all PP ranks
    norm: bool = True  # norm-relative entries supported (see steer_hook.SteerHook)
    capture_rows: int = 0  # captures at once (HOTWIRE_CAPTURE_ROWS); 0: capture is off
    readout_probes: int = 0  # probes one request may read (HOTWIRE_READOUT_PROBES); 0: readout is off
    gates: tuple[str, ...] = ()  # the conditions gated steering may take: "token", "latch" (none: gates are off)
    readout_layers: frozenset[int] | None = None  # the layers probes may read (HOTWIRE_READOUT_LAYERS); None: all hooked

    def readable_layers(self) -> frozenset[int]:
        return self.layers if self.readout_layers is None else self.readout_layers

    def to_json(self, max_stack: int) -> ModelView:
        return ModelView(
            steerable=self.steerable,
            reason=self.reason,
            n_layers=self.n_layers,
            hidden_size=self.hidden_size,
            dtype=self.dtype,
            max_stack=max_stack,
            norm=self.norm,
            layers=format_layers(self.layers),
            capture_rows=self.capture_rows,
            readout_probes=self.readout_probes,
            readout_layers=format_layers(self.readable_layers()) if self.readout_probes else "",
            gates=list(self.gates),
        )


@dataclass(frozen=True)
class Rules:
    """The server's fixed limits that every decision checks against."""

    model: ModelInfo
    max_stack: int
    capacity: int  # bank rows (HOTWIRE_SLOTS)
    max_rows: int  # bank rows one request may pin (HOTWIRE_MAX_ROWS, Settings.rows_per_request)
    layers_setting: bool = False  # HOTWIRE_LAYERS restricts the hooked layers

    def steered_layers(self) -> str:
        layers = format_layers(self.model.layers)
        if self.layers_setting:
            return f"{layers} (HOTWIRE_LAYERS; the model has 0-{self.model.n_layers - 1})"
        return layers


def resolve(spec: Any, lookup: Lookup, rules: Rules) -> Resolved:
    """Parse ``spec`` and bind each entry to a version (its pinned one, else the current one); raise
    :class:`Refusal` for anything that can never be served as asked (bank rows aside: they free up)."""
    model = rules.model
    if not model.steerable:
        raise Refusal(503, ErrorCode.MODEL_NOT_STEERABLE, f"this model cannot be steered: {model.reason}")
    try:
        entries = parse_spec(spec)
    except SpecError as exc:
        raise Refusal(400, ErrorCode.BAD_SPEC, str(exc), exc.field) from None
    resolved: Resolved = []
    for i, entry in enumerate(entries):
        vector = find_version(lookup, entry.vector_id, entry.version, f"{SPEC_KEY}[{i}]")
        if entry.norm and not model.norm:
            raise Refusal(
                400, ErrorCode.NORM_DISABLED,
                "norm-relative steering is off on this server; start it with HOTWIRE_NORM=1 to allow it",
                f"{SPEC_KEY}[{i}].norm",
            )
        for layer in entry.layers:
            if layer not in model.layers:
                raise Refusal(
                    400, ErrorCode.LAYER_OUT_OF_RANGE,
                    f"layer {layer} cannot be steered: this server steers layers {rules.steered_layers()}",
                    f"{SPEC_KEY}[{i}].layer",
                )
            if not vector.has_row(layer):
                raise Refusal(
                    400, ErrorCode.NO_ROW_FOR_LAYER,
                    f"vector {entry.vector_id!r}@{vector.version} has no row for layer {layer} (it has "
                    f"{list(vector.layers or [])})",
                    f"{SPEC_KEY}[{i}].layer",
                )
        if entry.when is not None:
            entry = _resolve_condition(entry, f"{SPEC_KEY}[{i}].when", lookup, rules)
        resolved.append((entry, vector))
    _check_stack(resolved, rules.max_stack)
    _check_strength(resolved, model.dtype)
    check_rows(len(row_keys(resolved)), rules, SPEC_KEY)
    return resolved


def _resolve_condition(entry: SteeringEntry, field: str, lookup: Lookup, rules: Rules) -> SteeringEntry:
    """``entry`` with its condition's probe pinned to the version it reads (``hotwire_core.gates``)."""
    when, model = entry.when, rules.model
    assert when is not None
    if not model.readout_probes:
        raise Refusal(503, ErrorCode.READOUT_OFF, "gated steering reads its condition's probe, and readout is off on "
                      "this server; start it with HOTWIRE_READOUT=1", field)
    mode = "latch" if when.latch else "token"
    if mode not in model.gates:
        why = ("gated steering is off: the model's layers are split over pipeline-parallel ranks, which cannot see "
               "each other's conditions") if not model.gates else ("a latched condition is off under speculative "
               "decoding: a draft token that verification rejects could latch it; gate per token instead")
        raise Refusal(400, ErrorCode.GATE_UNSUPPORTED, f"this server cannot gate as asked: {why}", field)
    probe = find_probe(lookup, rules, when.vector_id, when.version, when.layer, field)
    return entry.pinned(entry.version, probe.version)


def find_probe(lookup: Lookup, rules: Rules, vector_id: str, version: int | None, layer: int, field: str) -> VectorView:
    """The version a probe reads (:func:`find_version`), refused when this server does not hook ``layer`` or the
    vector has no row there; ``field``: the probe's (a readout's, or a condition's)."""
    vector = find_version(lookup, vector_id, version, field, "probe")
    if layer not in rules.model.layers:
        raise Refusal(400, ErrorCode.LAYER_OUT_OF_RANGE, f"layer {layer} cannot be read: this server hooks "
                      f"layers {rules.steered_layers()}", f"{field}.layer")
    if layer not in rules.model.readable_layers():
        raise Refusal(400, ErrorCode.LAYER_OUT_OF_RANGE, f"layer {layer} cannot be read: this server reads layers "
                      f"{format_layers(rules.model.readable_layers()) or 'none'} (HOTWIRE_READOUT_LAYERS)", f"{field}.layer")
    if not vector.has_row(layer):
        raise Refusal(400, ErrorCode.NO_ROW_FOR_LAYER, f"vector {vector_id!r}@{vector.version} has no row for "
                      f"layer {layer} (it has {list(vector.layers or [])})", f"{field}.layer")
    return vector


def check_rows(rows: int, rules: Rules, field: str) -> None:
    """Refuse a request that needs more bank rows than one request may pin: its steering's (``field`` the spec's)
    or its steering's and its readout's probes' together (``field`` the readout's)."""
    if rows > rules.max_rows:
        what = "this spec needs" if field == SPEC_KEY else "this request's steering and probes need"
        raise Refusal(
            400, ErrorCode.TOO_MANY_ROWS,
            f"{what} {rows} bank rows (one per vector and layer; a [hidden] vector takes one for all its layers) but "
            f"one request may pin at most {rules.max_rows} of the {rules.capacity} (HOTWIRE_MAX_ROWS={rules.max_rows}, "
            f"HOTWIRE_SLOTS={rules.capacity}); steer fewer layers or vectors, read fewer probes, or ask the operator "
            "to raise HOTWIRE_MAX_ROWS",
            field,
        )


def check_client_fields(user_salt: str | None, extra_args: dict[str, Any]) -> None:
    """Refuse what a client may not set on an engine request: a cache salt with hotwire's prefix (it could forge a
    steered request's cache key), or what only admission gives a request (``ADMISSION_ONLY_KEYS``)."""
    if user_salt and user_salt.startswith(SALT_PREFIX):
        raise Refusal(400, ErrorCode.RESERVED_SALT, f"cache_salt may not start with {SALT_PREFIX!r}", "cache_salt")
    for key in ADMISSION_ONLY_KEYS:
        if key in extra_args:
            raise Refusal(400, ErrorCode.RESERVED_FIELD, f"{key} is set by hotwire's admission, not by clients: "
                          "remove it", key)


def find_version(lookup: Lookup, vector_id: str, version: int | None, field: str, role: str = "steering") -> VectorView:
    """``version`` of ``vector_id`` (None: the current one), or the :class:`Refusal` saying it is unknown (400) or no
    longer held (410); ``field``: the entry naming it, ``role``: "steering" or "probe"."""
    vector = lookup(vector_id, version)
    if vector is not None:
        return vector
    if version is None or lookup(vector_id, None) is None:
        raise Refusal(400, ErrorCode.UNKNOWN_VECTOR, f"unknown {role} vector {vector_id!r}; register it first",
                      f"{field}.id")
    use = "steer with" if role == "steering" else "read"
    raise Refusal(410, ErrorCode.VERSION_GONE, f"version {version} of {vector_id!r} is neither current nor retained any "
                  f"more; leave out 'version' to {use} the current one", f"{field}.version")


def row_key(vector: VectorView, layer: int) -> RowKey:
    """The bank row ``vector`` contributes at ``layer`` (layer -1: a vector with one row for any layer)."""
    return RowKey(vector.vector_id, vector.version, -1 if vector.layers is None else layer)


def row_sources(resolved: Resolved) -> dict[RowKey, tuple[Any, int]]:
    """The bank rows a spec reads, each with the (vector, layer) its values come from."""
    return {row_key(v, layer): (v, layer) for e, v in resolved for layer in e.layers}


def row_keys(resolved: Resolved) -> set[RowKey]:
    """The bank rows a resolved spec reads."""
    return {row_key(v, layer) for e, v in resolved for layer in e.layers}


def _check_stack(resolved: Resolved, max_stack: int) -> None:
    for phase in (Phase.PREFILL, Phase.DECODE) if len(resolved) > max_stack else ():
        per_layer = Counter(l for e, _ in resolved if e.phase in (Phase.ALL, phase) for l in e.layers)
        for layer, count in per_layer.items():
            if count > max_stack:
                raise Refusal(
                    400, ErrorCode.TOO_MANY_ENTRIES,
                    f"{count} entries steer layer {layer}; at most HOTWIRE_MAX_STACK={max_stack} may",
                    SPEC_KEY,
                )


def _check_strength(resolved: Resolved, dtype: str) -> None:
    """Bound what the spec can do to a token's residual-stream norm ``n``, layer by layer in order: a layer's
    absolute entries add at most ``A = sum |scale| x row norm``, its norm-relative ones (one norm read per
    layer) multiply by at most ``g = 1 + sum |scale|``, so ``n -> g n + A``. Over the layers that composes to
    ``G n + added``; ``G`` and ``added`` must stay within the model dtype's limits."""
    limit = STRENGTH_LIMITS.get(dtype, DEFAULT_STRENGTH_LIMIT)
    phased = any(entry.phase is not Phase.ALL for entry, _ in resolved)
    for phase in (Phase.PREFILL, Phase.DECODE) if phased else (Phase.PREFILL,):  # unphased: both phases alike
        active = [(i, e, v) for i, (e, v) in enumerate(resolved) if e.phase in (Phase.ALL, phase)]
        added, log_growth = 0.0, 0.0  # the growth as a log: it can exceed a float
        for layer in sorted({layer for _, entry, _ in active for layer in entry.layers}):
            here = [(e, v) for _, e, v in active if layer in e.layers]
            growth = 1.0 + sum(abs(e.scale) for e, _ in here if e.norm)
            added = added * growth + sum(abs(e.scale) * v.row_norm(layer) for e, v in here if not e.norm)
            log_growth += math.log(growth)
        tokens = f" on {'prompt' if phase is Phase.PREFILL else 'generated'} tokens" if phased else ""
        if log_growth > math.log(limit.norm_growth) + 1e-12:  # a growth of exactly the limit is allowed
            growth_text = f"{math.exp(log_growth):.3g}" if log_growth < 700 else f"e^{log_growth:.0f}"
            what = (f"its norm-relative entries can grow a token's residual-stream norm {growth_text}-fold"
                    f"{tokens} (1 + the sum of |scale| at a layer, multiplied over layers; at most "
                    f"{limit.norm_growth:.3g} for a {dtype} model)")
            culprit = max((i for i, e, _ in active if e.norm), key=lambda i: abs(resolved[i][0].scale))
        elif added > limit.added_norm:
            what = (f"it can add up to {added:.3g} to a token's residual-stream norm{tokens} (|scale| x vector "
                    "norm, summed over entries and layers, multiplied by the growth of norm-relative entries at "
                    f"later layers; at most {limit.added_norm:.3g} for a {dtype} model)")
            culprit = max(
                (i for i, e, _ in active if not e.norm),
                key=lambda i: abs(resolved[i][0].scale) * sum(map(resolved[i][1].row_norm, resolved[i][0].layers)),
            )
        else:
            continue
        raise Refusal(400, ErrorCode.TOO_STRONG, f"this spec steers too strongly: {what}; stronger steering overflows "
                      f"the model's arithmetic. Lower the scale ({SPEC_KEY}[{culprit}] weighs most).",
                      f"{SPEC_KEY}[{culprit}].scale")


def receipt(resolved: Resolved) -> str:
    """``id@version:L<layers>x<scale>[,norm][,<phase>_only]`` per entry, joined by ``;``."""
    parts = []
    for e, v in resolved:
        flags = "".join(f",{f}" for f, on in (("norm", e.norm), (e.phase.value + "_only", e.phase is not Phase.ALL)) if on)
        if e.when is not None:
            flags += f",when={e.when.describe()}"
        parts.append(f"{v.vector_id}@{v.version}:L{'+'.join(map(str, e.layers))}x{e.scale:g}{flags}")
    return ";".join(parts)


def pinned_spec(resolved: Resolved) -> str:
    """The spec as a JSON string with every entry pinned to the version it resolved to."""
    return canonical_spec(tuple(e.pinned(v.version, e.when and e.when.version) for e, v in resolved))


def presalt(spec: Any, user_salt: str | None, prompt_len: int, lookup: Lookup) -> str | None:
    """The cache salt the engine core's admission would give a request with this spec and user salt as ``lookup``
    stands now; None where it would refuse it. Setting it before vLLM hashes the prompt's blocks spares admission
    hashing them again."""
    if user_salt and user_salt.startswith(SALT_PREFIX):
        return None
    try:
        entries = parse_spec(spec)
    except SpecError:
        return None
    if any(e.when is not None for e in entries):
        return None  # a gated request reads every prompt token: it gets a salt of its own (``gates``)
    vectors = [lookup(e.vector_id, e.version) for e in entries]
    if None in vectors:
        return None
    return cache_salt(user_salt, zip(entries, vectors), prompt_len)


def cache_salt(user_salt: str | None, resolved: Iterable[tuple[SteeringEntry, Any]], prompt_len: int) -> str:
    """The cache salt of a request steered as ``resolved``: its KV is reused only by requests with the same user
    salt, entries and vector contents (not version numbers: a pinned and an unpinned spec of the same contents
    share KV). With a ``prefill_only`` / ``decode_only`` entry, also the same prompt length: a token's KV then
    depends on whether it was prompt or output, and vLLM caches output tokens' blocks too (a follow-up whose
    prompt holds an earlier answer would read KV steered as output for tokens that are now prompt)."""
    resolved = tuple(resolved)
    phased = any(e.phase is not Phase.ALL for e, _ in resolved)
    entries = tuple((e.steering(), v.sha256) for e, v in resolved)
    small = len(user_salt or "") <= _CACHED_SALT_CHARS and sum(len(e.layers) for e, _ in entries) <= _CACHED_LAYERS
    return (_salt if small else _salt.__wrapped__)(user_salt, entries, prompt_len if phased else None)


# The cache keeps its keys, and a client chooses the salt and the spec: only small ones are cached.
_CACHED_SALT_CHARS, _CACHED_LAYERS = 256, 256


@functools.lru_cache(maxsize=4096)
def _salt(user_salt: str | None, entries: tuple[tuple[SteeringEntry, str], ...], prompt_len: int | None) -> str:
    """Cached: the input thread and admission both need a request's salt, and requests repeat specs."""
    boundary = "" if prompt_len is None else f"|prompt={prompt_len}"
    return SALT_PREFIX + hashlib.sha256(
        f"{user_salt or ''}|hotwire|".encode()
        + "|".join(f"{e.to_json()}@{sha}" for e, sha in entries).encode()
        + boundary.encode()
    ).hexdigest()
