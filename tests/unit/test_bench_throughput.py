"""The pure parts of ``benchmarks/bench_throughput.py``: how a streamed answer is judged and how rounds become the
paired ratios of the throughput targets (no server)."""

import json
import sys

from benchmark_module import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))  # by name: its dataclasses need the module in sys.modules
import bench_throughput as bt  # noqa: E402


def stream(tokens: int | None, *, done: bool = True, error: bool = False, verdicts: int | None = None) -> list[str]:
    lines = ['data: {"choices": [{"text": "a"}]}', ""]
    if error:
        lines += ['data: {"error": {"message": "refused"}}', ""]
    if tokens is not None:
        lines += ["data: " + json.dumps({"choices": [], "usage": {"completion_tokens": tokens}}), ""]
    if verdicts is not None:
        monitors = [{"monitor": f"m{i}", "probe": "v@1:L1", "score": 1.0, "flagged": True} for i in range(verdicts)]
        lines += ["data: " + json.dumps({"choices": [], "hotwire_monitors": monitors}), ""]
    return lines + (["data: [DONE]", ""] if done else [])


def test_a_stream_is_judged_by_status_receipt_end_and_token_count() -> None:
    assert bt.check_stream(200, None, stream(8), 8, None) is None
    assert bt.check_stream(200, "v1@3:L2x4", stream(8), 8, "v1") is None
    assert bt.check_stream(500, None, stream(8), 8, None) == "http_500"
    assert bt.check_stream(200, "v1@3:L2x4", stream(8), 8, None) == "receipt_on_plain"
    assert bt.check_stream(200, None, stream(8), 8, "v1") == "receipt_missing"
    assert bt.check_stream(200, "v10@1:L2x4", stream(8), 8, "v1") == "receipt_wrong"
    assert bt.check_stream(200, None, stream(8, done=False), 8, None) == "no_done"
    assert bt.check_stream(200, None, stream(7), 8, None) == "short"
    assert bt.check_stream(200, None, stream(None), 8, None) == "no_usage"
    assert bt.check_stream(200, None, stream(8, error=True), 8, None) == "error_event"
    assert bt.check_stream(200, None, stream(8, verdicts=4), 8, None, monitors=4) is None
    assert bt.check_stream(200, None, stream(8), 8, None, monitors=4) == "monitors_missing"
    assert bt.check_stream(200, None, stream(8, verdicts=3), 8, None, monitors=4) == "monitors_wrong"
    assert bt.check_stream(200, None, stream(8, verdicts=2), 8, None) == "monitors_wrong"  # none expected


def test_the_interval_of_a_median_is_the_widest_order_statistics_reaching_the_level() -> None:
    assert bt.median_interval([1.0]) is None
    three = bt.median_interval([0.9, 1.1, 1.0])
    assert (three["low"], three["high"], three["coverage"]) == (0.9, 1.1, 0.75)  # min-max: 1 - 2/8
    six = bt.median_interval([0.97, 0.99, 1.0, 0.98, 1.02, 1.01])
    assert (six["low"], six["high"]) == (0.97, 1.02) and six["coverage"] == 1 - 2 / 64
    nine = bt.median_interval([float(v) for v in range(9)])  # k = 2: 1 - 2 (1 + 9) / 512 = 0.961 >= 0.95
    assert (nine["low"], nine["high"]) == (1.0, 7.0) and abs(nine["coverage"] - (1 - 20 / 512)) < 1e-12
    assert bt.median_interval([float(v) for v in range(9)], level=0.97)["low"] == 0.0  # k = 2 covers too little


def test_rounds_give_medians_and_ratios_paired_by_round() -> None:
    rounds = [
        {"round": 0, "config": "vanilla", "completed": 100, "steered": 0, "ttft_p50_ms": 10.0},
        {"round": 0, "config": "plain", "completed": 99, "steered": 0, "ttft_p50_ms": 11.0},
        {"round": 0, "config": "steered", "completed": 98, "steered": 74, "ttft_p50_ms": 12.0},
        {"round": 1, "config": "plain", "completed": 200, "steered": 0, "ttft_p50_ms": 13.0},
        {"round": 1, "config": "steered", "completed": 190, "steered": 140, "ttft_p50_ms": 14.0},
        {"round": 1, "config": "vanilla", "completed": 200, "steered": 0, "ttft_p50_ms": 15.0},
    ]
    for r, cpu in zip(rounds, (0.2, 0.3, 0.49, None, 0.95, 0.4)):
        r["api_cpu_s"] = cpu
    out = bt.summarize(rounds, seconds=10.0)
    assert out["configs"]["steered"]["api_cpu_ms_per_request_median"] == (5.0 + 5.0) / 2
    assert out["configs"]["plain"]["api_cpu_ms_per_request_median"] == 0.3 * 1000 / 99  # round 1 has no figure
    assert out["configs"]["plain"]["req_per_s"] == [9.9, 20.0]
    assert out["configs"]["vanilla"]["req_per_s_median"] == 15.0
    assert out["configs"]["steered"]["ttft_p50_ms_median"] == 13.0
    assert out["ratios"]["steered_vs_plain"]["per_round"] == [98 / 99, 190 / 200]
    assert out["ratios"]["plain_vs_vanilla"]["per_round"] == [0.99, 1.0]
    assert out["ratios"]["plain_vs_vanilla"]["median"] == (0.99 + 1.0) / 2
    assert out["ratios"]["plain_vs_vanilla"]["interval"] == {"low": 0.99, "high": 1.0, "coverage": 0.5}
    assert "monitored" not in out["configs"] and "monitored_vs_plain" not in out["ratios"]
    rounds += [{"round": 0, "config": "monitored", "completed": 98, "steered": 0, "ttft_p50_ms": 11.0, "api_cpu_s": 0.4},
               {"round": 1, "config": "monitored", "completed": 198, "steered": 0, "ttft_p50_ms": 11.0}]
    out = bt.summarize(rounds, seconds=10.0)
    assert out["ratios"]["monitored_vs_plain"]["per_round"] == [98 / 99, 198 / 200]
    assert "salted_vs_vanilla" not in out["ratios"]
    rounds += [{"round": 0, "config": "salted", "completed": 90, "steered": 0, "ttft_p50_ms": 11.0},
               {"round": 1, "config": "salted", "completed": 180, "steered": 0, "ttft_p50_ms": 11.0}]
    out = bt.summarize(rounds, seconds=10.0)
    assert out["ratios"]["salted_vs_vanilla"]["per_round"] == [0.9, 0.9]


def test_a_salted_request_carries_a_cache_salt_and_no_steering() -> None:
    load = bt.Load("http://x", "m", 8, 0.0, (), 2, 4.0, salted_share=0.75)
    body = bt.request_body(load, False, None, 4.0, "p", "salt-1")
    assert body["cache_salt"] == "salt-1" and "vllm_xargs" not in body
    steered = bt.request_body(load, True, "v1", 4.5, "p")
    assert "cache_salt" not in steered and json.loads(steered["vllm_xargs"]["hotwire"])["scale"] == 4.5


def test_engine_counts_sum_steps_and_tokens_over_engines_and_skip_the_rest() -> None:
    text = """# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 3.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="m"} 40.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 40.0
vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 900.0
vllm:iteration_tokens_total_count{engine="1",model_name="m"} 2.0
vllm:iteration_tokens_total_sum{engine="1",model_name="m"} 7.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 640.0
vllm:generation_tokens_total{engine="1",model_name="m"} 6.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 300.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 20.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 20.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.25
"""
    assert bt.parse_engine_counts(text) == {"steps": 42.0, "generated_tokens": 646.0, "engine_ttft_s": 1.5,
                                            "first_tokens": 20.0, "queued_s": 0.25, "queued": 20.0}
    assert set(bt.parse_engine_counts("").values()) == {0.0}


def test_rounds_give_engine_steps_per_request_and_tokens_per_step() -> None:
    rounds = [
        {"round": 0, "config": "vanilla", "completed": 100, "steered": 0, "ttft_p50_ms": 10.0,
         "engine": {"steps": 400.0, "generated_tokens": 3200.0, "engine_ttft_s": 2.0, "first_tokens": 100.0,
                    "queued_s": 0.5, "queued": 100.0}},
        {"round": 1, "config": "vanilla", "completed": 50, "steered": 0, "ttft_p50_ms": 10.0,
         "engine": {"steps": 400.0, "generated_tokens": 1600.0, "engine_ttft_s": 2.0, "first_tokens": 50.0,
                    "queued_s": 0.0, "queued": 0.0}},
        {"round": 2, "config": "vanilla", "completed": 50, "steered": 0, "ttft_p50_ms": 10.0, "engine": None},
    ]
    figures = bt.summarize(rounds, seconds=10.0)["configs"]["vanilla"]
    assert figures["engine_steps_per_request_median"] == (4.0 + 8.0) / 2  # the round without /metrics left out
    assert figures["generated_tokens_per_step_median"] == (8.0 + 4.0) / 2
    assert figures["engine_ttft_ms_median"] == (20.0 + 40.0) / 2
    assert figures["engine_queue_ms_median"] == 5.0  # a round in which nothing was queued has no figure
