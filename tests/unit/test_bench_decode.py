"""benchmarks/bench_decode.py: the pure parts (specs per mode, paired summary)."""

from __future__ import annotations

import json

import pytest
from benchmark_module import load

bench = load("bench_decode")


def test_specs_per_mode():
    assert bench._spec("plain", 36, 0) is None
    assert json.loads(bench._spec("steered", 36, 5)) == {"id": "v0", "layer": 18, "scale": 2.0}
    assert json.loads(bench._spec("steered_faint", 36, 5)) == {"id": "v0", "layer": 18, "scale": 1e-6}
    assert [e["id"] for e in json.loads(bench._spec("stacked", 36, 0))] == ["v0", "v1", "v2", "v3"]
    assert json.loads(bench._spec("distinct", 36, 300))["id"] == "v44"
    assert json.loads(bench._spec("steered_all_layers", 4, 0))["layer"] == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        bench._spec("nope", 4, 0)


def test_extra_args_per_mode():
    assert bench._extra_args("plain", 36, 0) is None
    assert bench._extra_args("steered", 36, 0) == {"hotwire": bench._spec("steered", 36, 0)}
    read = json.loads(bench._extra_args("read4", 36, 0)["hotwire_readout"])
    assert read == {"probes": [{"id": f"v{k}", "layer": 18} for k in range(4)], "tokens": "generated"}
    both = bench._extra_args("steered_read4", 36, 0)
    assert both["hotwire"] == bench._spec("steered", 36, 0) and json.loads(both["hotwire_readout"]) == read
    assert "hotwire" not in bench._extra_args("read4", 36, 0)


def test_read_modes_run_on_the_readout_engine_only():
    modes = ["plain", "steered", "read4", "steered_read4"]
    assert bench.modes_of("op_readout", modes) == modes
    assert bench.modes_of("op", modes) == ["plain", "steered"]
    assert bench.modes_of("vanilla", modes) == ["plain"]


def test_modes_of_config():
    modes = ["plain", "steered", "distinct"]
    assert bench.modes_of("vanilla", modes) == ["plain"]
    assert bench.modes_of("eager", modes) == ["plain", "steered"]
    assert bench.modes_of("op", modes) == modes
    assert bench.modes_of("op_8layers", ["plain", "steered", "steered_all_layers"]) == ["plain", "steered"]


def test_middle_layers_hold_the_steered_layer():
    assert bench.middle_layers(36, 8) == "14-21"
    assert bench.middle_layers(4, 8) == "0-3"
    for n in (4, 28, 36):
        lo, hi = map(int, bench.middle_layers(n, 8).split("-"))
        assert lo <= json.loads(bench._spec("steered", n, 0))["layer"] <= hi


def test_summary_pairs_each_repetition_with_its_vanilla_round():
    rows = [
        {"config": "vanilla", "mode": "plain", "batch": 8, "rep": 0, "decode_ms": 4.0, "ttft_ms": 10.0},
        {"config": "vanilla", "mode": "plain", "batch": 8, "rep": 1, "decode_ms": 5.0, "ttft_ms": 12.0},
        {"config": "op", "mode": "steered", "batch": 8, "rep": 0, "decode_ms": 4.04, "ttft_ms": 11.0},
        {"config": "op", "mode": "steered", "batch": 8, "rep": 1, "decode_ms": 5.1, "ttft_ms": 11.0},
    ]
    by = {(s["config"], s["mode"]): s for s in bench.summarize(rows)}
    op = by[("op", "steered")]
    # Paired: +1% and +2%, not the ratio of the medians (4.57 / 4.5).
    assert op["vs_vanilla_min"] == pytest.approx(0.01) and op["vs_vanilla_max"] == pytest.approx(0.02)
    assert op["vs_vanilla"] == pytest.approx(0.015)
    assert by[("vanilla", "plain")]["vs_vanilla"] == pytest.approx(0.0)
    text = bench.table(bench.summarize(rows))
    assert "| op | steered | 8 |" in text and "+1.50%" in text


def test_v1_configs_pair_with_the_v1_baseline():
    assert bench.split_config("op/v1") == ("op", "v1") and bench.split_config("inductor") == ("inductor", "v2")
    assert bench.baseline_of("op/v1") == "vanilla/v1" and bench.baseline_of("eager") == "vanilla"
    assert bench.modes_of("vanilla/v1", ["plain", "steered"]) == ["plain"]
    rows = [
        {"config": "vanilla", "mode": "plain", "batch": 1, "rep": 0, "decode_ms": 2.0, "ttft_ms": 1.0},
        {"config": "vanilla/v1", "mode": "plain", "batch": 1, "rep": 0, "decode_ms": 4.0, "ttft_ms": 1.0},
        {"config": "op/v1", "mode": "plain", "batch": 1, "rep": 0, "decode_ms": 4.4, "ttft_ms": 1.0},
    ]
    by = {s["config"]: s for s in bench.summarize(rows)}
    assert by["op/v1"]["vs_vanilla"] == pytest.approx(0.1)


def test_graph_capture_is_read_from_vllms_log():
    log = ("(EngineCore pid=1) INFO 11-30 01:50:00 [model_runner.py:722] Graph capturing finished in 7 secs, "
           "took 0.61 GiB\n")
    assert bench.graph_capture(log) == {"seconds": 7.0, "gib": 0.61}
    assert bench.graph_capture("no graphs: enforce_eager") is None


def test_request_times_time_the_requests_that_started_decoding_last():
    from types import SimpleNamespace as NS

    def out(first: float, last: float, n: int, ttft: float) -> NS:
        return NS(request_id="r", metrics=NS(first_token_ts=first, last_token_ts=last, num_generation_tokens=n,
                                            first_token_latency=ttft))

    # Two requests got their first token in the last prefill step (t=10.004): 9 gaps of 5 and of 6 ms. The one
    # that started earlier decoded through that prefill (9 gaps of 4 ms) and is not counted.
    got = bench.request_times([out(10.0, 10.036, 10, 0.02), out(10.004, 10.049, 10, 0.03),
                               out(10.004, 10.058, 10, 0.04)])
    assert got["decode_ms"] == pytest.approx(5.5) and got["late_requests"] == 2
    assert got["ttft_ms"] == pytest.approx(30.0)
    with pytest.raises(RuntimeError, match="no per-request stats"):
        bench.request_times([NS(request_id="r", metrics=None)])


def test_full_batch_steps_are_timed_between_steps_where_every_request_got_a_token():
    # ramp-up (2 then 3 of 4 requests), four full steps 6, 5 and 7 ms apart, then the tail (3 of 4)
    steps = [(1.000, 2), (1.004, 3), (1.010, 4), (1.016, 4), (1.021, 4), (1.028, 4), (1.030, 3)]
    gaps = bench.full_batch_gaps(steps, 4)
    assert gaps == pytest.approx([6.0, 5.0, 7.0])
    got = bench.step_quantiles(gaps)
    assert got["step_ms"] == pytest.approx(6.0)
    assert got["step_p10_ms"] < 5.5 and got["step_p90_ms"] > 6.5
    assert bench.full_batch_gaps(steps[:3] + steps[-1:], 4) == []  # one full step: no gap to time
    assert bench.step_quantiles([]) == {"step_ms": None, "step_p10_ms": None, "step_p90_ms": None}


def test_engines_get_disjoint_runs_of_consecutive_cores():
    assert bench.engine_cores(3, 0, list(range(16))) == [None, None, None]
    assert bench.engine_cores(3, 4, list(range(16))) == [range(0, 4), range(4, 8), range(8, 12)]
    assert bench.engine_cores(2, 2, [4, 5, 6, 7]) == [range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="needs 20 cores"):
        bench.engine_cores(5, 4, list(range(16)))
    with pytest.raises(ValueError, match="consecutive"):
        bench.engine_cores(2, 2, [0, 2, 3, 4])
    assert bench.parse_cores("4-7") == [4, 5, 6, 7] and bench.parse_cores("3") == [3]


def test_step_clock_records_the_steps_that_emitted_tokens():
    from types import SimpleNamespace as NS

    out = lambda ts, *tokens: NS(timestamp=ts, outputs=[NS(new_token_ids=t) for t in tokens])  # noqa: E731
    answers = iter([out(1.0, [5], [6]), out(1.5), out(2.0, [7], [])])
    core = NS(get_output=lambda: next(answers))
    clock = bench.StepClock(core)
    got = [core.get_output() for _ in range(3)]
    assert [o.timestamp for o in got] == [1.0, 1.5, 2.0]  # the client's answers pass through
    assert clock.steps == [(1.0, 2), (2.0, 1)]  # a step without tokens (e.g. stats only) is not a step


def test_summary_pairs_full_batch_steps_and_tolerates_rows_without_them():
    rows = [
        {"config": "vanilla", "mode": "plain", "batch": 256, "rep": 0, "decode_ms": 8.0, "ttft_ms": 1.0, "step_ms": 7.0},
        {"config": "op", "mode": "plain", "batch": 256, "rep": 0, "decode_ms": 9.0, "ttft_ms": 1.0, "step_ms": 7.07},
        {"config": "op", "mode": "plain", "batch": 256, "rep": 1, "decode_ms": 8.0, "ttft_ms": 1.0, "step_ms": None},
        {"config": "op", "mode": "steered", "batch": 256, "rep": 0, "decode_ms": 8.0, "ttft_ms": 1.0},  # older file
    ]
    by = {(s["config"], s["mode"]): s for s in bench.summarize(rows)}
    assert by[("op", "plain")]["vs_vanilla_step"] == pytest.approx(0.01)
    assert by[("op", "plain")]["step_ms"] == pytest.approx(7.07) and by[("op", "plain")]["reps"] == 2
    assert by[("op", "steered")]["step_ms"] is None and by[("op", "steered")]["vs_vanilla_step"] is None
    text = bench.table(bench.summarize(rows))
    assert "| op | plain | 256 |" in text and "+1.00% (+1.0..+1.0)" in text


def test_measure_rotates_engines_and_modes_and_warms_up_after_each_switch():
    from types import SimpleNamespace as NS

    calls = []

    class FakeEngine:
        def __init__(self, config):
            self.config = config

        def measure(self, batch, mode, warmup=False):
            calls.append((self.config, mode, warmup))
            return {"decode_ms": 1.0}

    engines = [FakeEngine("vanilla"), FakeEngine("op")]
    rows = bench.measure(engines, NS(batches=[8], modes=["plain", "steered"], reps=2))
    measured = [(r["config"], r["mode"], r["rep"]) for r in rows]
    assert measured == [("vanilla", "plain", 0), ("op", "plain", 0), ("op", "steered", 0),
                        ("op", "steered", 1), ("op", "plain", 1), ("vanilla", "plain", 1)]
    first_sight = [("vanilla", "plain", True), ("op", "plain", True), ("op", "steered", True)]
    assert calls[:3] == first_sight
    timed = calls[3:]
    # every engine's measured modes follow a warm-up on that engine
    for i, (config, _, warmup) in enumerate(timed):
        if not warmup:
            assert timed[i - 1][0] == config
        if i == 0 or timed[i - 1][0] != config:
            assert warmup
