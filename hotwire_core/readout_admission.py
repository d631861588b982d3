"""Admitting readout requests in the engine core: which versions a request's probes read, the bank rows they pin
(beside its steering's, in the same binding), what the workers get, and the cache salt.

A request reading prompt tokens gets a cache salt of its own: every prompt token it reads must be computed (a
prefix-cache hit would skip it), and the KV it leaves behind is then never read by another request. One reading
only generated tokens keeps the prefix cache: vLLM always computes the last prompt token, where the first generated
token's value is read.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, NoReturn

from .admission import Lookup, Refusal, Rules, find_probe, row_key
from .contract import READOUT_ARGS_KEY, GateArgs, ReadoutArgs, ReadoutProbe
from .error_codes import ErrorCode
from .readout_spec import READOUT_KEY, ReadoutSpec, parse_readout
from .slots import RowKey
from .spec import SALT_PREFIX, SpecError

__all__ = [
    "Reading", "ResolvedProbes", "probe_name", "readout_salt", "refuse_in_session", "resolve_readout", "worker_args",
]

ResolvedProbes = list[tuple[Any, Any]]  # (readout_spec.Probe, its VectorView), in spec order


def refuse_in_session() -> NoReturn:
    """A streaming-input session's prompt grows chunk by chunk, past what its readout would call the prompt."""
    raise Refusal(400, ErrorCode.READOUT_UNSUPPORTED, "a streaming-input session cannot be read: send the readout "
                  "with a request whose prompt is whole", READOUT_KEY)


def probe_name(vector: Any, layer: int) -> str:
    """``id@version:L<layer>``, as receipts name steering."""
    return f"{vector.vector_id}@{vector.version}:L{layer}"


def resolve_readout(value: Any, lookup: Lookup, rules: Rules, max_probes: int) -> tuple[ReadoutSpec, ResolvedProbes]:
    """Parse a request's readout (``READOUT_KEY``'s value) and bind each probe to a version; raise :class:`Refusal`
    for what can never be served (``max_probes``: 0 when the readout op is not compiled in)."""
    model = rules.model
    if not model.steerable:
        raise Refusal(503, ErrorCode.MODEL_NOT_STEERABLE, f"this model cannot be steered or read: {model.reason}")
    if not max_probes:
        raise Refusal(503, ErrorCode.READOUT_OFF, "readout is off on this server; start it with HOTWIRE_READOUT=1 to "
                      "read probes", READOUT_KEY)
    try:
        spec = parse_readout(value, max_probes)
    except SpecError as exc:
        raise Refusal(400, ErrorCode.BAD_READOUT, str(exc), exc.field) from None
    resolved: ResolvedProbes = []
    for i, probe in enumerate(spec.probes):
        field = f"{READOUT_KEY}.probes[{i}]"
        resolved.append((probe, find_probe(lookup, rules, probe.vector_id, probe.version, probe.layer, field)))
    return spec, resolved


@dataclass(frozen=True)
class Reading:
    """A readout the engine core admits: the spec and its probes' versions (``resolve_readout``)."""

    spec: ReadoutSpec
    probes: ResolvedProbes
    gate: GateArgs | None = None  # a gated request's condition, on one of the probes (``gates.gated_reading``)

    @classmethod
    def of(cls, value: Any, lookup: Lookup, rules: Rules, max_probes: int, session: bool) -> Reading:
        """``session``: the request is a streaming-input session's first chunk, which cannot be read."""
        if session:
            refuse_in_session()
        return cls(*resolve_readout(value, lookup, rules, max_probes))

    def sources(self) -> dict[RowKey, tuple[Any, int]]:
        """The bank rows the probes read, each with the (vector, layer) its values come from."""
        return {row_key(v, p.layer): (v, p.layer) for p, v in self.probes}

    def worker_args(self, tag: str) -> dict[str, ReadoutArgs]:
        args = worker_args(self.spec, self.probes, tag)
        if self.gate is not None:
            args[READOUT_ARGS_KEY]["gate"] = self.gate
        return args

    def own_salt(self) -> str | None:
        """The request's own cache salt when it reads prompt tokens (see the module's docstring), else None."""
        return readout_salt() if self.spec.reads_prompt else None


def worker_args(spec: ReadoutSpec, resolved: ResolvedProbes, tag: str) -> dict[str, ReadoutArgs]:
    """The ``extra_args`` entry the workers read a readout request's probes from (their bank slots come with the
    binding's config, ``"r"``)."""
    probes = [ReadoutProbe(name=probe_name(v, p.layer), layer=p.layer, bias=p.bias, norm=v.row_norm(p.layer))
              for p, v in resolved]
    return {READOUT_ARGS_KEY: ReadoutArgs(tag=spec.tag or tag, tokens=spec.tokens, probes=probes)}


def readout_salt() -> str:
    """A cache salt no other request has (see the module's docstring)."""
    return f"{SALT_PREFIX}readout:{uuid.uuid4().hex}"
