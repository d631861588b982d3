"""The report of a run: the JSON (counts, failures by kind / detail / route with examples, latencies,
throughput, control plane, churn, drain) and its short text forms."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from .calibration import Calibration
from .churn import Churn
from .control_plane import Poller
from .markers import MarkerBook
from .plan import Plan, SoakConfig
from .responses import Observation
from .stats import summarize_ms
from .verdicts import FAILURE_KINDS, judge_all, route_key
from .windows import Windows, split


def report(config: SoakConfig, urls: Sequence[str], plan: Plan, calibration: Calibration, book: MarkerBook,
           observations: list[Observation], churn: Churn, poller: Poller, drained: dict[str, Any], elapsed: float,
           busy: Sequence[float] = (), windows: Windows | None = None) -> dict[str, Any]:  # fmt: skip
    """The JSON report: counts, failures by kind / detail / route with examples, latencies, throughput, control
    plane latencies, churn and drain; ``busy``: the share of a core each client process used; ``windows``: the
    requests judged ok split by flood window (``by_window``)."""
    judged = judge_all(observations, book, config.max_tokens)
    kinds: Counter[str] = judged["kinds"]
    failures = {kind: kinds.get(kind, 0) for kind in FAILURE_KINDS}
    failures["churn_error"] = len(churn.errors) + len(book.conflicts)
    failures["poll_error"] = len(poller.errors)
    failures["not_drained"] = 0 if drained.get("drained") else 1
    by_class: dict[str, list[Observation]] = {"plain": [], "steered": []}
    ok_by_class: dict[str, list[Observation]] = {"plain": [], "steered": []}
    for obs, verdict in zip(observations, judged["verdicts"]):
        name = "steered" if obs.spec.steered else "plain"
        by_class[name].append(obs)
        if verdict.kind == "ok":
            ok_by_class[name].append(obs)
    ok = ok_by_class["plain"] + ok_by_class["steered"]
    return {
        "config": asdict(config) | {"api_key": bool(config.api_key)},
        "servers": list(urls),
        "model": plan.model,
        "layer": plan.layer,
        "calibration": asdict(calibration),
        "elapsed_s": round(elapsed, 2),
        "requests": {
            "total": len(observations),
            "ok": kinds.get("ok", 0),
            "refused_expected": kinds.get("refused_expected", 0),
            "by_class": dict(Counter(obs.spec.kind for obs in observations)),
            "by_route": dict(Counter(route_key(obs) for obs in observations)),
            "by_server": dict(Counter(urls[obs.client % len(urls)] for obs in observations)),
        },
        "failures": failures,
        "failed": sum(failures.values()),
        "failure_details": {k: dict(v) for k, v in judged["details"].items()},
        "failures_by_route": {k: dict(v) for k, v in judged["routes"].items()},
        "examples": dict(judged["examples"]) | {"churn_error": churn.errors[:5] + book.conflicts[:5],
                                                "poll_error": poller.errors[:5]},  # fmt: skip
        "latency_ms": {  # of the requests judged ok
            name: {"ttft": summarize_ms([o.ttft for o in group if o.ttft is not None]),
                   "total": summarize_ms([o.end - o.start for o in group])}
            for name, group in ok_by_class.items()
        },  # fmt: skip
        "throughput_rps": {
            "all": round(len(observations) / elapsed, 2) if elapsed else None,
            "ok": round(len(ok) / elapsed, 2) if elapsed else None,
            **{name: round(len(group) / elapsed, 2) if elapsed else None for name, group in by_class.items()},
        },
        "control_plane_ms": {name: summarize_ms(values) for name, values in poller.latencies.items()},
        "client_processes_busy": list(busy),
        "churn": {"replaced": churn.replaced, "deleted": churn.deleted, "registered": churn.registered,
                  "errors": len(churn.errors), "by_server": dict(churn.by_server),
                  "latency_ms": {k: summarize_ms(v) for k, v in churn.latencies.items()}},  # fmt: skip
        "drain": drained,
    } | ({"by_window": split(ok_by_class, windows, elapsed)} if windows is not None else {})


def busiest(busy: Sequence[float]) -> str:
    """``busy`` (the share of a core each client process used) in words."""
    return f"{len(busy)} client processes, the busiest {max(busy):.0%} of a core" if busy else "no client process"


def server_busy_text(shares: Mapping[str, float] | None) -> str:
    """``shares`` (the share of a core the soak's own server's processes used) in words."""
    if not shares:
        return "the server's processes not measured (not the soak's own)"
    return ", ".join(f"{name.replace('_', ' ')} {share:.0%} of a core" for name, share in shares.items())


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(result: dict[str, Any]) -> str:
    """A short human-readable summary of a report."""
    requests, rps = result["requests"], result["throughput_rps"]
    lines = [
        f"soak: {requests['total']} requests in {result['elapsed_s']} s ({rps['all']} req/s, ok {rps['ok']} req/s), "
        f"{result['config']['clients']} clients, mix {result['config']['mix']}, "
        f"strength {result['calibration']['strength']:g}, {busiest(result['client_processes_busy'])}; "
        f"{server_busy_text(result.get('server_busy'))}",
        f"  ok {requests['ok']}   refused_expected {requests['refused_expected']}   failed {result['failed']}",
        f"  {'kind':<18}{'count':>7}  routes",
    ]
    for kind, count in result["failures"].items():
        routes = ", ".join(f"{r} {n}" for r, n in sorted(result["failures_by_route"].get(kind, {}).items()))
        lines.append(f"  {kind:<18}{count:>7}  {routes}")
    lines.append(f"  {'latency ms':<18}{'n':>7}{'ttft p50':>10}{'ttft p99':>10}{'total p50':>11}{'total p99':>11}")
    for name, lat in result["latency_ms"].items():
        lines.append(f"  {name:<18}{lat['total']['n']:>7}{_ms(lat['ttft']['p50']):>10}{_ms(lat['ttft']['p99']):>10}"
                     f"{_ms(lat['total']['p50']):>11}{_ms(lat['total']['p99']):>11}")  # fmt: skip
    lines.append(f"  {'control plane ms':<34}{'n':>7}{'p50':>9}{'p99':>9}{'max':>9}")
    for name, path in Poller.PATHS.items():
        lat = result["control_plane_ms"][name]
        lines.append(f"  GET {path:<30}{lat['n']:>7}{_ms(lat['p50']):>9}{_ms(lat['p99']):>9}{_ms(lat['max']):>9}")
    churn, drained = result["churn"], result["drain"]
    lines.append(f"  churn: {churn['replaced']} replaced, {churn['deleted']} deleted and re-registered, "
                 f"{churn['errors']} errors")  # fmt: skip
    spread = churn["latency_ms"].get("propagation")
    if spread:  # several servers: a re-registration until every one held it
        lines.append(f"  on every server after {spread['n']} re-registrations: p50 {_ms(spread['p50'])} ms, "
                     f"p99 {_ms(spread['p99'])} ms, max {_ms(spread['max'])} ms; requests by server "
                     f"{result['requests']['by_server']}")  # fmt: skip
    lines.append(f"  drain: {'ok' if drained.get('drained') else 'NOT DRAINED'}, {drained.get('pinned')} pinned after "
                 f"{drained.get('seconds')} s")  # fmt: skip
    return "\n".join(lines)


def examples_text(result: dict[str, Any], per_kind: int = 2) -> str:
    """A few examples of each failure kind, one JSON line each."""
    lines = []
    for kind, found in result["examples"].items():
        for item in found[:per_kind]:
            lines.append(f"  {kind}: {json.dumps(item)[:600]}")
    return "\n".join(lines)
