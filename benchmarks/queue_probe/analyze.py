"""What the queue probe (``sitecustomize.py`` here) recorded, per engine core: for steered and plain requests, the
time from ``add_request`` to the start of the schedule call that scheduled them (vLLM's queue time), how many
schedule calls passed them by, what the calls that left requests waiting were short of, and how that time was
spent: the engine core's handling of the client messages that came in between (other requests added with their
admission, steered or plain; aborts; utility calls by method), the rest being the loop's own work (in vLLM's
``_process_input_queue`` and hotwire's wrapper of ``schedule``). Each kind of message handled is given with its mean
wall time and the loop thread's own CPU time in it (the difference: waiting for the GIL or the OS).

    python -m benchmarks.queue_probe.analyze DIR [--out FILE]   (from the repository root)
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

from benchmarks.soak.stats import summarize_ms


def analyze(path: Path) -> dict | None:
    added: dict[str, tuple[float, bool]] = {}
    waits: dict[bool, list[tuple[float, int]]] = {True: [], False: []}  # (queue time, schedule calls passed)
    calls_since: dict[str, int] = {}
    short = {"tokens": 0, "running": 0, "neither": 0}
    durations: list[float] = []
    server: dict = {}
    handled: list[tuple[float, float, str]] = []  # (start, duration, kind), in order
    spent: dict[bool, Counter[str]] = {True: Counter(), False: Counter()}
    handled_kinds: Counter[str] = Counter()
    handled_s: Counter[str] = Counter()
    handled_cpu_s: Counter[str] = Counter()  # the loop thread's CPU time in them
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the last line of a process that was killed while writing it
        if event[0] == "env":
            _, parent, plugins, readout = event
            server = {"parent_pid": parent, "server": "plugin-free" if plugins == "" else
                      "hotwire, readout on" if readout == "1" else "hotwire"}
            continue
        if event[0] == "h":
            _, t, dur, name, what, flag, cpu = event
            kind = (f"add {'steered' if flag else 'plain'}" if name == "ADD"
                    else f"utility {what}{'/' + flag if flag else ''}" if name == "UTILITY" else name.lower())
            handled.append((t, dur, kind))
            handled_kinds[kind] += 1
            handled_s[kind] += dur
            handled_cpu_s[kind] += cpu
            continue
        if event[0] == "a":
            added[event[2]] = (event[1], event[3])
            calls_since[event[2]] = 0
            continue
        _, t0, dur, _waiting, new, left, running, tokens, max_tokens, max_running = event
        durations.append(dur)
        for rid in new:
            if rid in added:
                t_add, steered = added.pop(rid)
                waits[steered].append((t0 - t_add, calls_since.pop(rid)))
                # what the engine core handled between this request's add and the schedule call: the messages
                # whose handling started after its add (its own handling ends just after its add)
                first = bisect.bisect_right(handled, (t_add, float("inf"), ""))
                between = 0.0
                for start, took, kind in handled[first:]:
                    if start >= t0:
                        break
                    spent[steered][kind] += took
                    between += took
                spent[steered]["rest"] += (t0 - t_add) - between
        for rid in calls_since:
            calls_since[rid] += 1
        if left:
            short["tokens" if tokens >= max_tokens else "running" if running >= max_running else "neither"] += 1
    if not durations:
        return None
    out: dict = {**server, "schedule_calls": len(durations), "schedule_ms_mean": 1e3 * statistics.fmean(durations),
                 "calls_leaving_requests_waiting": short,
                 "handled": {k: {"count": n, "ms_mean": 1e3 * handled_s[k] / n, "thread_cpu_ms_mean": 1e3 * handled_cpu_s[k] / n}
                             for k, n in handled_kinds.most_common()}}
    for steered, rows in waits.items():
        if not rows:
            continue
        ms = [1e3 * w for w, _ in rows]
        passed = [n for _, n in rows]
        out["steered" if steered else "plain"] = {
            "requests": len(rows), "queue_ms_mean": statistics.fmean(ms),
            "queue_ms": summarize_ms([w for w, _ in rows]),  # n, p50, p99, max
            "passed_by_1_or_more_calls": sum(1 for n in passed if n) / len(rows),
            "queue_ms_mean_when_not_passed": statistics.fmean([m for m, n in zip(ms, passed) if not n] or [0.0]),
            "calls_passed_max": max(passed),
            "queue_ms_mean_by_what_came_between": {k: 1e3 * v / len(rows) for k, v in spent[steered].most_common()},
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
