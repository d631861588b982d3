"""benchmarks/gpu_trace.py (decode graph replays in a profiler trace) and bench_decode's profile table."""

from __future__ import annotations

import gzip
import json

import pytest
from benchmark_module import load

gpu_trace = load("gpu_trace")
bench = load("bench_decode")


def _launch(corr: int, ts: float) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5, "args": {"correlation": corr}}


def _kernel(name: str, corr: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _trace(steer_us: float | None = None) -> list[dict]:
    """Two decode replays (100 µs apart, 3 kernels, 60 µs of them over 70), a one-kernel piecewise launch, an eager kernel."""
    events = [_launch(1, 0), _launch(2, 100), _launch(3, 300)]
    for corr, t in ((1, 10), (2, 110)):
        events += [_kernel("mm", corr, t, 30), _kernel("norm", corr, t + 30, 10), _kernel("mm", corr, t + 50, 20)]
        if steer_us is not None:
            events.append(_kernel("steer", corr, t + 40, steer_us))
    events += [_kernel("piece", 3, 310, 50), _kernel("sample", 99, 75, 10)]
    return events


def test_decode_replays_are_the_graph_launches_with_the_most_kernels():
    replays = gpu_trace.decode_replays(_trace())
    assert [[k["name"] for k in r] for r in replays] == [["mm", "norm", "mm"]] * 2
    assert gpu_trace.decode_replays([_kernel("eager", 7, 0, 1)]) == []


def test_summary_per_replay_and_busy_window():
    s = gpu_trace.summarize(_trace())
    assert (s["replays"], s["kernels"], s["kernel_us"], s["span_us"], s["period_us"]) == (2, 3, 60, 70, 100)
    # Window 10..180: kernels cover 10-50, 60-80 and 75-85 (eager), 110-150, 160-180: 40+25+40+20 of 170 µs.
    assert s["busy"] == pytest.approx(125 / 170)
    assert s["by_name"]["mm"] == {"count": 2, "us": 50}
    assert gpu_trace.summarize([_kernel("eager", 7, 0, 1)]) == {"replays": 0}


def test_host_time_in_the_window_per_replay():
    sync = {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 90, "dur": 40}
    ops = [{"ph": "X", "cat": "cpu_op", "name": "aten::index", "ts": t, "dur": 6} for t in (20, 120, 400)]
    s = gpu_trace.summarize(_trace() + [sync, *ops])
    # Window 10..180, two replays: the launch at 100 and the sync; the op at 400 is outside.
    assert s["runtime_us"] == {"cudaEventSynchronize": 20.0, "cudaGraphLaunch": 2.5}
    assert s["cpu_op_us"] == {"aten::index": 6.0}


def test_kernel_diff_names_what_differs():
    base, steered = gpu_trace.summarize(_trace()), gpu_trace.summarize(_trace(steer_us=2.0))
    assert gpu_trace.kernel_diff(base, base) == []
    assert gpu_trace.kernel_diff(base, steered) == [{"name": "steer", "count": [0, 1.0], "us": [0.0, 2.0]}]


def test_traces_load_gzipped_and_newest_first(tmp_path):
    old, new = tmp_path / "w.1.pt.trace.json.gz", tmp_path / "w.2.pt.trace.json.gz"
    for path, events in ((old, []), (new, _trace())):
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": events}, f)
    new.touch()
    assert gpu_trace.newest_trace(tmp_path) == new
    assert gpu_trace.load_events(new) == _trace()
    with pytest.raises(FileNotFoundError):
        gpu_trace.newest_trace(tmp_path / "none")


def test_profile_table_compares_with_the_same_runners_vanilla():
    base, steered = gpu_trace.summarize(_trace()), gpu_trace.summarize(_trace(steer_us=2.0))
    profiles = [{"config": "vanilla", "mode": "plain", "batch": 8, **base},
                {"config": "op", "mode": "plain", "batch": 8, **base},
                {"config": "op", "mode": "steered", "batch": 8, **steered},
                {"config": "op/v1", "mode": "plain", "batch": 8, **base},
                {"config": "eager", "mode": "plain", "batch": 8, "replays": 0}]
    lines = bench.profile_table(profiles).splitlines()
    assert lines[2].endswith("| 73.5% | — |")  # vanilla itself
    assert lines[3].endswith("| none |")
    assert "`steer` 0→1, 0.0→2.0" in lines[4]
    assert lines[5].endswith("| — |")  # no vanilla/v1 profile to compare with
    assert "no graph replay traced" in lines[6]
