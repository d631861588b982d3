"""What a chat or completions request reads, decided at admission: the client's own readout
(``vllm_xargs.hotwire_readout``) and the server's monitors (``hotwire_api.monitors``), as one readout for the
engine, and, once the response is whole, each one's part of the values.

The client's probes come first, then the monitors'. A monitored request reads at least its generated tokens (a
client readout of prompt tokens becomes one of all tokens; the client gets only what it asked for). The client's
readout is refused like a spec (400, 503); no decision about the monitors makes a request fail: one they cannot
read (n > 1, beam search, another route, too many probes with the client's, a monitor's probe gone, readout off) is
served as it would be without them and counted in ``hotwire_monitor_skipped_total``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from hotwire_api.catalog import CATALOG
from hotwire_api.engine import HotwireEngine
from hotwire_api.errors import HotwireError, in_body
from hotwire_api.models import MonitorScore
from hotwire_api.monitors import Monitor, probes_of, score_of, skipped
from hotwire_core.admission import Refusal
from hotwire_core.error_codes import ErrorCode
from hotwire_core.gates import condition_probe
from hotwire_core.readout_admission import resolve_readout
from hotwire_core.readout_spec import READOUT_KEY, Probe, ReadoutSpec
from hotwire_core.spec import SPEC_KEY, Condition

__all__ = ["READOUT_ROUTES", "Reading", "authorize_gate", "authorize_readout", "decide_reading", "monitored"]

logger = logging.getLogger(__name__)

READOUT_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
_SPANS = {"prompt": ("prompt",), "generated": ("generated",), "all": ("prompt", "generated")}


@dataclass(frozen=True)
class Reading:
    """One request's readout as sent to the engine (``value``, taken back by ``tag``), and whose parts it holds."""

    value: str
    tag: str
    asked: int  # the client's probes, first in the readout
    tokens: str | None  # the tokens the client asked for; None: the client asked for no readout
    monitors: tuple[Monitor, ...]
    gated: bool = False  # the steering's condition is read last (``hotwire_core.gates``); its receipt is owed

    @property
    def owed(self) -> bool:
        """Whether the response may not go out without this readout's fields (the monitors' it may)."""
        return self.tokens is not None or self.gated

    def split(self, readout: dict[str, Any]) -> tuple[dict[str, Any] | None, list[MonitorScore]]:
        """The client's readout (None if it asked for none) and the monitors' verdicts, from the whole readout
        (``readout_results.readout_of``); flagged requests are logged."""
        mine = None
        if self.tokens is not None:
            spans = _SPANS[self.tokens]
            mine = {"tokens": self.tokens, "probes": [{k: v for k, v in probe.items() if k not in _SPANS or k in spans}
                                                      for probe in readout["probes"][:self.asked]]}
        verdicts, flags = [], []
        for monitor, read in zip(self.monitors, readout["probes"][self.asked:]):
            verdict = score_of(monitor, read)
            if verdict is None:
                skipped("nothing_generated")
                continue
            if verdict.flagged:
                flags.append(f"{monitor.id} (score {verdict.score:.6g} {'>=' if monitor.flag == 'above' else '<='} "
                             f"threshold {monitor.threshold:.6g})")
            verdicts.append(verdict)
        if flags:  # one line per request, however many monitors flagged it: logging costs the API server's loop
            logger.warning("hotwire: a request was flagged by monitor%s %s; readout %s", "s" if len(flags) > 1 else "",
                           ", ".join(flags), self.tag)
        return mine, verdicts


def authorize_readout(path: str, where: str, request: dict[str, Any]) -> None:
    """A client's readout comes back in the JSON body of a chat or completions response (a stream: in a chunk of
    its own), for one completion."""
    field = f"{where}.{READOUT_KEY}"
    if path not in READOUT_ROUTES or where != "vllm_xargs":
        raise HotwireError(400, ErrorCode.READOUT_UNSUPPORTED, f"POST {path} cannot return a readout: only "
                           f"vllm_xargs.{READOUT_KEY} of POST {', '.join(sorted(READOUT_ROUTES))} is read; send the "
                           "request without it, or to one of those routes", field)
    many = _many_completions(request)
    if many is not None:
        raise HotwireError(400, ErrorCode.BAD_READOUT, "a readout reads one completion: send n = 1 and one prompt "
                           "per request", many)


def authorize_gate(path: str, request: dict[str, Any]) -> None:
    """Gated steering's receipt (``hotwire_gate``) comes back as a readout does: for one completion of a chat or
    completions request."""
    field = f"vllm_xargs.{SPEC_KEY}"
    if path not in READOUT_ROUTES:
        raise HotwireError(400, ErrorCode.GATE_UNSUPPORTED, f"POST {path} cannot gate steering: only POST "
                           f"{', '.join(sorted(READOUT_ROUTES))} return its receipt; drop the entries' when", field)
    if _many_completions(request) is not None:
        raise HotwireError(400, ErrorCode.GATE_UNSUPPORTED, "gated steering gates one completion: send n = 1 and one "
                           "prompt per request", field)


def _many_completions(request: dict[str, Any]) -> str | None:
    """The field by which a body asks for more than one completion (``n``, or a completions ``prompt`` that is a
    list of strings or of token lists: each its own engine request), or None."""
    if request.get("n", 1) not in (1, None):
        return "n"
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt):
        return "prompt"
    return None


def monitored(monitors: tuple[Monitor, ...], path: str, request: dict[str, Any] | None,
              beam_search: bool) -> tuple[Monitor, ...]:
    """The monitors that read this request (those of a request they cannot read are counted, not run)."""
    if not monitors:
        return ()
    reason = None
    if path not in READOUT_ROUTES:
        reason = "route"
    elif request is None or not isinstance(request.get("vllm_xargs", {}), dict):
        reason = "body"  # not a JSON object, or vllm_xargs not one: vLLM answers it with a 400
    elif _many_completions(request) is not None:
        reason = "n"  # several completions in one answer: its readout would be one request's
    elif beam_search:
        reason = "beam_search"
    if reason is not None:
        skipped(reason)
        return ()
    return monitors


async def decide_reading(engine: HotwireEngine, value: Any, monitors: tuple[Monitor, ...],
                         monitors_state: int, when: Condition | None = None) -> Reading | None:
    """The readout of a request whose client asked for ``value`` (None: for none), that ``monitors`` read and whose
    steering is gated on ``when`` (pinned), or None when there is nothing to read; the client's refusal as
    :class:`HotwireError`. The condition's probe goes last, as the engine core's admission expects it."""
    asked = await _client_probes(engine, value) if value is not None else None
    rules = await CATALOG.ready(engine)
    gate = (condition_probe(when),) if when is not None else ()
    if monitors:
        probes = await _monitor_probes(engine, monitors, monitors_state)
        own = len(asked.probes) if asked is not None else 0
        if probes is not None and (asked is not None or gate) and own + len(probes) + len(gate) > rules.model.readout_probes:
            skipped("probe_limit")
            probes = None
        if probes is None:
            monitors = ()
    if asked is None and not monitors and not gate:
        return None
    tokens = "all" if gate else asked.tokens if asked is not None else "generated"
    if monitors and tokens == "prompt":
        tokens = "all"
    tag = uuid.uuid4().hex
    spec = ReadoutSpec((*(asked.probes if asked else ()), *(probes if monitors else ()), *gate), tokens, tag)
    return Reading(json.dumps(spec.to_json(), separators=(",", ":")), tag, len(asked.probes) if asked else 0,
                   asked.tokens if asked else None, monitors, bool(gate))


async def _client_probes(engine: HotwireEngine, value: Any) -> ReadoutSpec:
    """The client's readout, every probe bound to the version decided here; or its refusal (with the field named
    as in the request body)."""
    if not isinstance(value, str):
        raise HotwireError(400, ErrorCode.BAD_READOUT, f"vllm_xargs.{READOUT_KEY} must be a JSON string holding "
                           '{"probes": [{"id": ..., "layer": ...}], "tokens": ...}', f"vllm_xargs.{READOUT_KEY}")
    try:
        # A probe's pinned version the catalog lacks may be one the engine still retains: refreshed, it is held.
        return await CATALOG.decide(engine, time.monotonic(), lambda rules: _pinned(value, rules),
                                    (ErrorCode.UNKNOWN_VECTOR, ErrorCode.VERSION_GONE))
    except (Refusal, HotwireError) as exc:
        raise in_body(exc) from None


def _pinned(value: Any, rules: Any) -> ReadoutSpec:
    spec, resolved = resolve_readout(value, CATALOG.lookup, rules, rules.model.readout_probes)
    return dataclasses.replace(spec, probes=tuple(dataclasses.replace(p, version=v.version) for p, v in resolved))


# The monitors' probes pinned, by (monitors state, catalog state): every monitored request needs them.
_MONITOR_PROBES: dict[tuple[int, int], tuple[Probe, ...] | None] = {}


async def _monitor_probes(engine: HotwireEngine, monitors: tuple[Monitor, ...], state: int) -> tuple[Probe, ...] | None:
    """The monitors' probes bound to their vectors' current versions; None (counted; logged once per monitors
    and catalog state) when they cannot be read now."""
    await CATALOG.ready(engine)
    key = (state, CATALOG.state)
    if key not in _MONITOR_PROBES:
        value = probes_of(monitors)
        try:
            _MONITOR_PROBES.clear()
            _MONITOR_PROBES[key] = (await CATALOG.decide(engine, time.monotonic(), lambda rules: _pinned(value, rules),
                                                         (ErrorCode.UNKNOWN_VECTOR,))).probes
        except (Refusal, HotwireError) as exc:
            _MONITOR_PROBES[key] = None
            logger.error("hotwire: the monitors cannot read requests (%s: %s); requests are served without "
                             "them until the monitors or the vectors change", exc.code, exc.message)
    probes = _MONITOR_PROBES.get(key)
    if probes is None:
        skipped("unavailable")
    return probes
