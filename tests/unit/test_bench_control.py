"""The pure helpers of ``benchmarks/bench_control.py`` (no server needed)."""

import pytest
from benchmark_module import load

bench = load("bench_control")


def test_summarize_percentiles_interpolate():
    s = bench.summarize([float(v) for v in range(1, 101)])
    assert s == {"n": 100, "p50": 50.5, "p99": 99.01, "max": 100.0}


def test_summarize_empty():
    assert bench.summarize([]) == {"n": 0, "p50": None, "p99": None, "max": None}


def test_classify_gaps_by_overlap_and_window():
    streams = [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    busy = {"register": [(1.5, 1.6), (3.9, 4.5)], "slots": [(2.5, 2.6)]}
    gaps = bench.classify_gaps(streams, busy, window=(1.0, 5.0))
    # 1->2 overlaps a registration, 2->3 a poll, 3->4 and 4->5 the second registration; 0->1 is outside the window
    assert gaps == {"idle": [], "register": [1000.0, 1000.0, 1000.0], "slots": [1000.0]}
    gaps = bench.classify_gaps(streams, {"register": [(0.2, 0.4)]}, window=(0.0, 5.0))
    assert gaps == {"idle": [1000.0] * 4, "register": [1000.0]}


def test_classify_gaps_touching_is_not_overlapping():
    gaps = bench.classify_gaps([[0.0, 1.0, 2.0]], {"register": [(1.0, 1.0), (2.0, 2.5)]}, window=(0.0, 2.0))
    assert gaps == {"idle": [1000.0, 1000.0], "register": []}


def test_capacity_cost_pct_is_paired_per_round():
    # The machine drifts between rounds (10 -> 12 ms); 4096 slots is 1% slower than 16 in each round but the
    # middle one. Unpaired medians (11 vs 12.1) would say 10%.
    rows = [{"slots": 4096, "decode_ms": [10.1, 12.1, 12.12]}, {"slots": 16, "decode_ms": [10.0, 11.0, 12.0]},
            {"slots": 256, "decode_ms": [9.9, 11.0, 12.0]}]
    assert bench.paired_change_pct(rows[0], rows[1]) == pytest.approx([1.0, 10.0, 1.0])
    assert bench.capacity_cost_pct(rows) == pytest.approx(1.0)
    rows[2]["decode_ms"] = [9.7, 10.67, 11.64]  # 3% faster in every round: a change either way counts
    assert bench.capacity_cost_pct(rows) == pytest.approx(3.0)
    assert bench.capacity_cost_pct(rows[:1]) is None
    with pytest.raises(ValueError):  # rounds must line up
        bench.capacity_cost_pct([{"slots": 16, "decode_ms": [1.0]}, {"slots": 32, "decode_ms": [1.0, 2.0]}])


def test_rotated_order_per_round():  # bench_decode's rotation, which the sweep uses
    assert [bench.rotated([16, 256, 4096], k) for k in range(4)] == [
        [16, 256, 4096], [256, 4096, 16], [4096, 16, 256], [16, 256, 4096]]


def test_markdown_capacity_paired_column():
    result = {"meta": {"batch": 64}, "capacity": [{"slots": 256, "decode_ms": [10.2, 11.0]},
                                                   {"slots": 16, "decode_ms": [10.0, 11.0]}]}
    result["targets"] = bench.judge(result)
    lines = bench.markdown(result).splitlines()
    assert "| 16 | 10.500 | 10.000-11.000 | — |" in lines
    assert "| 256 | 10.600 | 10.200-11.000 | +1.00% (+0.0..+2.0) |" in lines
    assert any(line.startswith("## Decode ms/token vs slot capacity (batch 64, 2 rounds)") for line in lines)


def test_judge_pass_miss_and_missing():
    result = {"registration": {"usable_ms": {"p99": 12.0}}, "decode_stall": {"stall_p99_ms": 2.5},
              "slots_get_ms": {"fresh": {"p99": 3.0}, "max_age_ms=1000": {"p99": None}}, "capacity": []}
    assert [t["pass"] for t in bench.judge(result)] == [True, False, False, False]  # 2.5 > 2; None: not measured
    result["slots_get_ms"]["max_age_ms=1000"]["p99"] = 4.0
    assert bench.judge(result)[2]["pass"] and bench.judge(result)[2]["value"] == 4.0
    assert [t["value"] for t in bench.judge({"capacity": []})] == [None] * 4


def test_markdown_marks_unmeasured_targets():
    """A target with nothing to measure (e.g. one slot capacity: no change to compare) is not called a miss."""
    result = {"meta": {"date": "d", "batch": 64}, "capacity": [{"slots": 256, "decode_ms": [5.0]}],
              "registration": {"usable_ms": {"n": 1, "p50": 9.0, "p99": 60.0, "max": 60.0}}}
    result["targets"] = bench.judge(result)
    table = [line for line in bench.markdown(result).splitlines() if line.startswith("| ") and "(" in line]
    assert table[0].endswith("| 60.0 | MISS |")
    assert table[3].endswith("| None | not measured |")


def test_targets_measured_under_load_only():
    """A phase no inter-token gap overlapped (the streams had ended) measured an idle server: not a pass."""
    result = {"decode_stall": {"stall_p99_ms": 0.5, "streams_finished_early": 0, "phases_without_load": []},
              "slots_get_ms": {"max_age_ms=1000": {"p99": 4.0}}, "capacity": []}
    assert [t["value"] for t in bench.judge(result)][1:3] == [0.5, 4.0]
    result["decode_stall"]["phases_without_load"] = ["version"]
    assert [t["value"] for t in bench.judge(result)][1:3] == [None, None]
    result["decode_stall"].update(phases_without_load=[], streams_finished_early=3)
    assert [t["pass"] for t in bench.judge(result)][1:3] == [False, False]


def test_per_token_ms_counts_tokens_not_events():
    # 3 events; the second carried 3 tokens (the client fell behind): 5 tokens in 20 ms after the first event.
    assert bench.per_token_ms([1.000, 1.012, 1.020], [1, 4, 6]) == pytest.approx(4.0)
