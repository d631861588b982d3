"""What the GPU ran in a decode step, read from a PyTorch profiler trace (the Chrome-trace JSON vLLM's worker writes
with ``profiler_config={"profiler": "torch", ...}``).

A decode step of a graphed engine is one replay of its FULL CUDA graph: CUPTI records every kernel of the replay with
the correlation id of the ``cudaGraphLaunch`` that started it. The decode replays are the launches with the most
kernels (piecewise prefill launches hold one segment each). Per replay: how many kernels, their summed time, the
span from the first kernel's start to the last one's end, and the period to the next replay's first kernel; over
the window from the first to the last decode replay, the fraction of time some kernel ran (``busy``): below 1, the
GPU waited for the host (the profiler's own host overhead included). Kernel names let two engines' steps be
compared kernel by kernel (``kernel_diff``).

Used by ``bench_decode.py --profile``.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

GRAPH_LAUNCHES = ("cudaGraphLaunch", "cudaGraphLaunch_v10000")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _busy_time(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def decode_replays(events: list[dict]) -> list[list[dict]]:
    """The kernels of each decode graph replay, in time order: the launches whose kernel count is the most common
    among the launches with at least half the largest count."""
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") == "cuda_runtime" and e.get("name") in GRAPH_LAUNCHES and "correlation" in e.get("args", {})}
    groups: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launches:
            groups[e["args"]["correlation"]].append(e)
    if not groups:
        return []
    largest = max(len(g) for g in groups.values())
    sizes = Counter(len(g) for g in groups.values() if 2 * len(g) >= largest)
    size = sizes.most_common(1)[0][0]
    replays = [sorted(g, key=lambda k: k["ts"]) for g in groups.values() if len(g) == size]
    return sorted(replays, key=lambda r: r[0]["ts"])


def summarize(events: list[dict]) -> dict[str, Any]:
    """Per decode replay (medians): kernels, summed kernel µs, span µs, period µs; ``busy`` over the window; and
    per kernel name its count and µs per replay. ``replays`` is 0 where the trace holds no graph replay whose
    kernels were recorded (e.g. ``enforce_eager``)."""
    replays = decode_replays(events)
    if not replays:
        return {"replays": 0}
    spans = [r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in replays]
    start, end = replays[0][0]["ts"], replays[-1][-1]["ts"] + replays[-1][-1]["dur"]
    window = [(k["ts"], k["ts"] + k["dur"]) for k in events
              if k.get("cat") == "kernel" and k["ts"] < end and k["ts"] + k["dur"] > start]
    clipped = [(max(s, start), min(e, end)) for s, e in window]
    names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for r in replays:
        for k in r:
            names[k["name"]][0] += 1
            names[k["name"]][1] += k["dur"]
    n = len(replays)
    return {
        "replays": n,
        "kernels": len(replays[0]),
        "kernel_us": statistics.median(sum(k["dur"] for k in r) for r in replays),
        "span_us": statistics.median(spans),
        "period_us": statistics.median(b[0]["ts"] - a[0]["ts"] for a, b in zip(replays, replays[1:])) if n > 1 else None,
        "busy": _busy_time(clipped) / (end - start),
        "by_name": {name: {"count": c / n, "us": us / n} for name, (c, us) in sorted(names.items())},
        # Where the host's time goes over the same window, per replay: CUDA runtime calls (a synchronize here is
        # a step that waited for the GPU) and the torch ops the host ran outside the graph (nested ones counted
        # in their callers too).
        "runtime_us": _host_time(events, "cuda_runtime", start, end, n),
        "cpu_op_us": _host_time(events, "cpu_op", start, end, n),
    }


def _host_time(events: list[dict], category: str, start: float, end: float, replays: int, top: int = 12) -> dict:
    """The ``top`` names of ``category`` events in ``[start, end)`` by summed duration, in µs per replay."""
    total: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == category and start <= e.get("ts", -1) < end:
            total[e["name"]] += e.get("dur", 0.0)
    return {name: round(us / replays, 1) for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]}


def kernel_diff(base: dict[str, Any], other: dict[str, Any], min_us: float = 0.5) -> list[dict]:
    """Kernel names whose count per replay differs between two summaries, or whose time per replay differs by at
    least ``min_us``; largest time difference first."""
    a, b = base.get("by_name", {}), other.get("by_name", {})
    diff = []
    for name in a.keys() | b.keys():
        x, y = a.get(name, {"count": 0, "us": 0.0}), b.get(name, {"count": 0, "us": 0.0})
        if x["count"] != y["count"] or abs(y["us"] - x["us"]) >= min_us:
            diff.append({"name": name, "count": [x["count"], y["count"]], "us": [x["us"], y["us"]]})
    return sorted(diff, key=lambda d: -abs(d["us"][1] - d["us"][0]))


def newest_trace(directory: Path) -> Path:
    """The worker trace written last in ``directory`` (vLLM names them ``<worker>.<time>.pt.trace.json[.gz]``)."""
    traces = sorted(directory.glob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no profiler trace in {directory}")
    return traces[-1]
