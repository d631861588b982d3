"""What the queue probe (``sitecustomize.py`` here) recorded, per engine core: for steered and plain requests, the
time from ``add_request`` to the start of the schedule call that scheduled them (vLLM's queue time), how many
schedule calls passed them by, and what the calls that left requests waiting were short of.

    python benchmarks/queue_probe/analyze.py DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def analyze(path: Path) -> dict | None:
    added: dict[str, tuple[float, bool]] = {}
    waits: dict[bool, list[tuple[float, int, float]]] = {True: [], False: []}
    calls_since: dict[str, int] = {}
    short = {"tokens": 0, "running": 0, "neither": 0}
    durations: list[float] = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the last line of a process that was killed while writing it
        if event[0] == "a":
            added[event[2]] = (event[1], event[3])
            calls_since[event[2]] = 0
            continue
        _, t0, dur, _waiting, new, left, running, tokens, max_tokens, max_running = event
        durations.append(dur)
        for rid in new:
            if rid in added:
                t_add, steered = added.pop(rid)
                waits[steered].append((t0 - t_add, calls_since.pop(rid), dur))
        for rid in calls_since:
            calls_since[rid] += 1
        if left:
            short["tokens" if tokens >= max_tokens else "running" if running >= max_running else "neither"] += 1
    if not durations:
        return None
    out: dict = {"schedule_calls": len(durations), "schedule_ms_mean": 1e3 * statistics.fmean(durations),
                 "calls_leaving_requests_waiting": short}
    for steered, rows in waits.items():
        if not rows:
            continue
        ms = [1e3 * w for w, _, _ in rows]
        passed = [n for _, n, _ in rows]
        out["steered" if steered else "plain"] = {
            "requests": len(rows), "queue_ms_mean": statistics.fmean(ms), "queue_ms_p50": _quantile(ms, 0.5),
            "queue_ms_p90": _quantile(ms, 0.9), "queue_ms_p99": _quantile(ms, 0.99),
            "passed_by_1_or_more_calls": sum(1 for n in passed if n) / len(rows),
            "queue_ms_mean_when_not_passed": statistics.fmean([m for m, n in zip(ms, passed) if not n] or [0.0]),
            "calls_passed_max": max(passed),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = {p.name: r for p in sorted(args.dir.glob("*.jsonl")) if (r := analyze(p)) is not None}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
