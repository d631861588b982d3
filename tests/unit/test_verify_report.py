"""The judging and report formatting of ``python -m hotwire_core.verify`` (no engine needed)."""

import json
import math

import pytest

from hotwire_core import verify
from hotwire_core.verify import Check, Result, compare, exit_status, format_report, max_abs_diff, per_step_ms


def result(logprobs, tokens=None, cached=0) -> Result:
    return Result(tokens or list(range(len(logprobs))), list(logprobs), cached)


def test_max_abs_diff():
    assert max_abs_diff([1.0, -2.0], [1.5, -2.25]) == 0.5
    assert max_abs_diff([], []) == 0.0
    assert max_abs_diff([1.0], [1.0, 2.0]) == math.inf


def test_compare_bit_for_bit_or_within_a_cpu_tolerance():
    a = [result([-0.5, -1.25], cached=0)]
    assert compare(a, [result([-0.5, -1.25], cached=64)], 0.0) == (True, "bit-identical")  # cache use aside
    assert compare(a, [result([-0.5, -1.25 + 1e-12])], 0.0) == (False, "max |delta| 1e-12")
    assert compare(a, [result([-0.5, -1.25 + 5e-7])], 1e-5) == (True, "max |delta| 5e-07 (CPU tolerance 1e-05)")
    assert compare(a, [result([-0.5, -1.25 + 5e-5])], 1e-5)[0] is False
    ok, words = compare(a, [result([-0.5, -1.25], tokens=[0, 7])], 1e-5)
    assert not ok and words.startswith("different tokens")
    assert compare(a, [], 1e-5)[0] is False


def test_steering_fires_needs_more_than_noise():
    plain = result([-1.0, -2.0, -3.0])
    assert verify.check_steering_fires(plain, result([-1.0, -2.5, -3.0])).passed
    assert verify.check_steering_fires(plain, result([-1.0, -2.0, -3.0], tokens=[0, 9, 2])).passed
    noise = verify.check_steering_fires(plain, result([-1.0, -2.0 + 1e-6, -3.0]))
    assert not noise.passed
    assert "0/3 tokens differ" in noise.detail


def test_batchmates():
    all_plain = [result([-1.0, -2.0]), result([-0.5, -0.25]), result([-3.0, -1.0])]
    mixed = [result([-1.0, -2.0]), result([-0.9, -0.1]), result([-3.0, -1.0])]
    ok = verify.check_batchmates(all_plain, mixed, steered=[1], tolerance=0.0)
    assert ok.passed and "bit-identical" in ok.detail and "2 plain beside 1 steered in a batch of 3" in ok.detail

    moved = [result([-1.0, -2.0 + 1e-7]), *mixed[1:]]
    bad = verify.check_batchmates(all_plain, moved, steered=[1], tolerance=0.0)
    assert not bad.passed and "1e-07" in bad.detail
    assert verify.check_batchmates(all_plain, moved, steered=[1], tolerance=1e-5).passed

    unsteered = verify.check_batchmates(all_plain, all_plain, steered=[1], tolerance=1e-5)
    assert not unsteered.passed and "not steered" in unsteered.detail


@pytest.mark.parametrize(
    "after, passed",
    [
        (result([-1.0, -2.0], cached=0), True),
        (result([-1.0, -2.0], cached=128), False),  # read KV written under other steering
        (result([-1.0, -2.5], cached=0), False),
    ],
)
def test_no_cross_read(after, passed):
    check = verify.check_no_cross_read("c. prefix cache: steered -> plain", after, result([-1.0, -2.0]), tolerance=1e-5)
    assert check.passed is passed
    assert f"{after.num_cached_tokens} cached tokens read" in check.detail


def test_cache_hit_needs_a_full_block():
    first = result([-1.0])
    assert verify.check_cache_hit(first, result([-1.0], cached=512), block_size=128, prompt_len=576).passed
    miss = verify.check_cache_hit(first, result([-1.0], cached=0), block_size=128, prompt_len=576)
    assert not miss.passed and "0/576 prompt tokens" in miss.detail


def test_per_step_ms():
    assert per_step_ms(0.5, 0.5 + 64 * 0.002, 64) == pytest.approx(2.0)


NO_GRAPHS = [{"split": True, "kinds": "idle"}]  # a CPU rank: no graph wrappers


def test_decode_cost_uses_medians_and_the_limit():
    ok = verify.check_decode_cost([2.0, 9.0, 2.0], [2.2, 2.1, 2.4], 0.5, NO_GRAPHS)
    assert ok.passed and "idle 2.000 ms/step, steered 2.200 ms/step (+10.0%" in ok.detail
    assert "one graph set" in ok.detail
    assert not verify.check_decode_cost([2.0, 2.0, 2.0], [3.5, 3.5, 3.5], 0.5, NO_GRAPHS).passed


def test_readout_check_wants_exactly_what_steering_added_at_every_token():
    ok = verify.check_readout([1.0, -2.0, 0.5], [101.0, 98.0, 100.4], 100.0, 0.01)
    assert ok.passed and "3 prompt tokens" in ok.detail and "within 0.001" in ok.detail
    assert not verify.check_readout([1.0, -2.0], [101.0, 100.0], 100.0, 0.01).passed  # one token 2% off
    assert not verify.check_readout([1.0], [], 100.0, 0.01).passed
    assert not verify.check_readout([], [], 100.0, 0.01).passed


def graph_rank(serving_idle: int, holders: int = 37, split: bool = True) -> dict:
    return {"split": split, "kinds": "idle", "holders": holders, "serving_idle": serving_idle,
            "graphs": {"idle": 10 * holders, "all": 10 * holders}}


def test_decode_cost_needs_every_ranks_idle_graphs_after_an_unsteered_step():
    ok = verify.check_decode_cost([2.0], [2.1], 0.5, [graph_rank(37), graph_rank(37)])
    assert ok.passed and "74 of 74 graph holders had their hotwire-free set in place" in ok.detail
    stale = verify.check_decode_cost([2.0], [2.1], 0.5, [graph_rank(37), graph_rank(0)])
    assert not stale.passed and "37 of 74 graph holders" in stale.detail
    one_set = verify.check_decode_cost([2.0], [2.1], 0.5, [graph_rank(0, split=False)])
    assert one_set.passed and "one graph set" in one_set.detail


def test_vanilla_exact_on_gpu_tolerance_on_cpu():
    ours = [result([-1.0, -2.0]), result([-0.5])]
    assert verify.check_vanilla(ours, [[result([-1.0, -2.0]), result([-0.5])]], 0.0).detail.endswith("bit-identical")
    near = [result([-1.0, -2.0 + 5e-7]), result([-0.5])]
    assert not verify.check_vanilla(ours, [near], tolerance=0.0).passed
    cpu = verify.check_vanilla(ours, [near], tolerance=1e-5)
    assert cpu.passed and "max |delta| 5e-07 (CPU tolerance 1e-05)" in cpu.detail
    assert not verify.check_vanilla(ours, [[result([-1.0, -2.0], tokens=[0, 3]), result([-0.5])]], tolerance=1e-5).passed
    assert not verify.check_vanilla(ours, [ours[:1]], tolerance=1e-5).passed
    assert not verify.check_vanilla(ours, [ours[:1], ours[:1]], tolerance=1e-5).passed


def test_vanilla_failure_names_the_requests_and_tokens_that_differ():
    ours = [result([-1.0, -2.0]), result([-0.5, -0.7, -0.9]), result([-0.3])]
    theirs = [result([-1.0, -2.0]), result([-0.5, -0.7, -0.8]), result([-0.4])]
    check = verify.check_vanilla(ours, [theirs], tolerance=0.0)
    assert not check.passed and check.detail.endswith("(requests #1 from token 2, #2 from token 0)")
    tokens = [result([-1.0, -2.0], tokens=[0, 5]), *ours[1:]]
    assert "(requests #0 from token 1, #1 from token 2, #2 from token 0)" in verify.check_vanilla(tokens, [theirs], 0.0).detail
    assert verify.check_vanilla(ours, [ours], tolerance=0.0).detail == "3 plain requests: bit-identical"


def test_vanilla_passes_when_each_request_equals_one_of_two_plugin_free_engines():
    """At TP=2 two plugin-free engines may disagree on a request: hotwire matching either one is vLLM's own
    variation; a request matching neither fails, and the detail says which and whether the references agree."""
    a, b = result([-1.0, -2.0]), result([-1.0, -2.004])
    short = result([-0.5])
    first, second = [short, a, a], [short, b, a]
    ours = [short, b, a]  # request 1 equals the second engine only
    check = verify.check_vanilla(ours, [first, second], tolerance=0.0)
    assert check.passed
    assert check.detail == (
        "3 plain requests: each equals one of two plugin-free engines, which differ from each other "
        "(max |delta| 0.004; requests #1 from token 1): vLLM's own engine-to-engine variation"
    )
    ours = [short, b, b]  # request 2 equals neither
    check = verify.check_vanilla(ours, [first, second], tolerance=0.0)
    assert not check.passed
    assert check.detail.startswith("3 plain requests: #2 from token 1 match neither of two plugin-free engines")
    # The position is the earlier of the two references' and different tokens are called so.
    c = result([-1.0, -2.0, -3.0])
    late, early = result([-1.0, -2.0, -3.5]), result([-1.5, -2.0, -3.0])
    check = verify.check_vanilla([short, short, c], [[short, short, late], [short, result([-0.5]), early]], 0.0)
    assert check.detail.startswith("3 plain requests: #2 from token 0 match neither") and "max |delta| to the nearer 0.5" in check.detail
    swapped = result([-1.0, -2.0, -3.0], tokens=[0, 1, 9])
    check = verify.check_vanilla([short, short, swapped], [[short, short, c], [short, result([-0.5]), c]], 0.0)
    assert "#2 from token 2 match neither of two plugin-free engines (different tokens)" in check.detail
    same_refs = verify.check_vanilla([short, b, a], [first, first], tolerance=0.0)
    assert not same_refs.passed and same_refs.detail.endswith("which agree with each other")
    assert "#1 from token 1 match neither" in same_refs.detail


def test_report_and_exit_status():
    checks = [Check("a. steering fires", True, "max 1.2"), Check("b. batchmates", False, "max |delta| 3e-07")]
    report = format_report([("model", "tiny"), ("dtype", "float32")], checks, [("engine start", 61.23)])
    lines = report.splitlines()
    assert "model      tiny" in lines and "dtype      float32" in lines
    assert "PASS  a. steering fires  max 1.2" in lines
    assert "FAIL  b. batchmates      max |delta| 3e-07" in lines
    assert "timings    engine start 61.2 s" in lines
    assert "result     FAIL (b. batchmates)" in lines
    assert exit_status(checks) == 1
    passing = [checks[0]]
    assert "result     PASS (1/1 checks)" in format_report([], passing, []).splitlines()
    assert exit_status(passing) == 0
    assert exit_status([]) == 1


def test_engine_kwargs_pin_timed_kernel_choices_only_when_asked():
    plain = verify.engine_kwargs("m", "bfloat16")
    assert "compilation_config" not in plain
    untimed = verify.engine_kwargs("m", "bfloat16", untimed=True)
    assert untimed["compilation_config"] == {
        "inductor_compile_config": {"combo_kernels": True, "benchmark_combo_kernel": False, "deterministic": True,
                                    "triton.autotune_pointwise": False}
    }
    assert {k: v for k, v in untimed.items() if k != "compilation_config"} == plain
    json.dumps(untimed)  # travels to the vanilla child as JSON


def test_a_dynamo_trace_resets_inductor_deterministic_mode():
    """Why UNTIMED_INDUCTOR patches ``deterministic`` into the compile instead of relying on
    TORCHINDUCTOR_DETERMINISTIC=1: the end of every Dynamo trace writes the ATen deterministic flag into it."""
    import torch
    from torch._inductor import config as inductor_config

    with inductor_config.patch(deterministic=True):  # what the variable sets at import
        assert not torch.are_deterministic_algorithms_enabled()
        torch.compile(lambda x: x + 1, backend="eager", fullgraph=True)(torch.ones(2))
        assert inductor_config.deterministic is False


def test_untimed_inductor_settings_are_inductor_config_keys():
    """vLLM hands them to Inductor as config patches, which refuse unknown (e.g. misspelt) keys."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch(verify.UNTIMED_INDUCTOR):
        assert inductor_config.triton.autotune_pointwise is False
        assert inductor_config.benchmark_combo_kernel is False
        assert inductor_config.deterministic is True


def test_saved_results_round_trip(tmp_path):
    """--save-plain and the vanilla child write what run_vanilla and benchmarks/tp2_identity.py read back."""
    batches = [([[1, 2], [3]], 8), ([[4] * 72], 4)]
    results = [Result([1, 2], [-0.5, -1.25], 0), Result([3], [-2.0000001], 16), Result([5], [-1.0], 0)]
    verify.save_results(tmp_path / "r.json", batches, results)
    assert verify.load_results(tmp_path / "r.json") == (batches, results)


def test_a_reference_that_returned_other_requests_fails_check_e_and_says_so():
    ours = [Result([1], [-0.5], 0), Result([2], [-0.25], 0)]
    check = verify.check_vanilla(ours, [ours, ours[:1]], 0.0)
    assert not check.passed and "returned [2, 1]" in check.detail


class _RecordingLLM:
    """Stands in for ``vllm.LLM`` in :func:`verify.checks_a_to_c`: records every request and answers with a
    distinct result per request; an identical steered request on the same prompt reads a block from the cache."""

    def __init__(self):
        self.sent = []  # (prompt, max_tokens, steered, skip_cache), in order

    def generate(self, inputs, sampling, use_tqdm):
        from types import SimpleNamespace

        outputs = []
        for request, sp in zip(inputs, sampling):
            ids, steered = request["prompt_token_ids"], sp.extra_args is not None
            cached = 16 if steered and not sp.skip_reading_prefix_cache and (ids, 4, True, False) in self.sent else 0
            self.sent.append((ids, sp.max_tokens, steered, sp.skip_reading_prefix_cache))
            token = len(self.sent)
            completion = SimpleNamespace(token_ids=[token], logprobs=[{token: SimpleNamespace(logprob=-token / 7)}],
                                         finish_reason="length")
            outputs.append(SimpleNamespace(outputs=[completion], num_cached_tokens=cached, prompt_logprobs=None,
                                           prompt_token_ids=ids))
        return outputs


def test_the_second_reference_repeats_verifys_requests_in_verifys_order():
    """plain_history is what checks_a_to_c sends, steering left out: the same prompts in the same order, kept
    exactly where checks_a_to_c returns a result for (e), reading the cache exactly where verify's engine does."""
    short, x, y = [[1], [2, 3], [4], [5]], [6] * 72, [7] * 72
    llm = _RecordingLLM()
    _, ours = verify.checks_a_to_c(llm, short, x, y, {"hotwire": "{}"}, 16, 0.0)
    returned = {r.token_ids[0] - 1 for r in ours}  # indices into llm.sent of the results (e) compares
    sent = [(ids, n, i in returned, steered and not skip and (ids, n, True, False) in llm.sent[:i])
            for i, (ids, n, steered, skip) in enumerate(llm.sent)]
    last = max(returned)
    history = [(prompt, n, kept, read) for prompts, n, kept, read in verify.plain_history(short, x, y)
               for prompt in prompts]
    assert history == sent[: last + 1]
    assert [(prompts, n) for prompts, n, kept, _ in verify.plain_history(short, x, y) if kept] == \
        verify.plain_batches(short, x, y)
    assert [r.token_ids[0] - 1 for r in ours] == sorted(returned)  # (e)'s order is the order they ran in


def test_serving_configuration_flags_reach_every_engine(tmp_path):
    from hotwire_core.verify.__main__ import build_parser
    from hotwire_core.verify.setup import from_args

    args = build_parser().parse_args([])
    assert from_args(args).engine_kwargs() == {} and from_args(args).describe() == "vLLM's defaults"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 16, "peft_type": "LORA"}))
    args = build_parser().parse_args([
        "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--pipeline-parallel-size", "2",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', "--max-num-batched-tokens", "256",
        "--lora", str(adapter),
    ])
    setup = from_args(args)
    expected = {"quantization": "fp8", "kv_cache_dtype": "fp8", "pipeline_parallel_size": 2,
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}, "max_num_batched_tokens": 256,
                "enable_lora": True, "max_loras": 1, "max_lora_rank": 16}
    assert setup.engine_kwargs() == expected
    kwargs = verify.engine_kwargs("m", "bfloat16", setup=setup)
    assert {k: kwargs[k] for k in expected} == expected and kwargs["model"] == "m"
    json.dumps(kwargs)  # travels to the vanilla child as JSON
    assert setup.request_lora() == ["hotwire-verify-lora", 1, str(adapter)]
    assert "quantization=fp8" in setup.describe() and f"LoRA adapter {adapter} on every request" in setup.describe()
    assert '"method": "ngram"' in setup.describe()
    # vLLM adds objects to the speculative_config it is given (a ModelConfig: the report's header then failed to
    # print on the H200); the engines get copies.
    kwargs["speculative_config"]["target_model_config"] = object()
    setup.engine_kwargs()["speculative_config"]["draft"] = object()
    assert '"method": "ngram"' in setup.describe()


def test_serving_configuration_flags_refuse_bad_values(tmp_path, capsys):
    from hotwire_core.verify.__main__ import build_parser
    from hotwire_core.verify.setup import from_args

    for bad in ("not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--speculative-config", bad])
        assert "--speculative-config" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--lora .*no readable adapter_config.json"):
        from_args(build_parser().parse_args(["--lora", str(tmp_path / "missing")]))
