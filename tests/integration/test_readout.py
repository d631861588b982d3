"""Readout: per-token projections of the residual stream onto registered probes, read inside a real vLLM 0.25.1 engine
(``HOTWIRE_READOUT=1``), against the same projections on a plain transformers forward with hooks on the same weights
(float32 on the CPU).

One engine serves the module; the plain batchmate is compared with a plugin-free engine in a clean subprocess.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hf_reference
from engine_results import assert_same_result, engine_kwargs, run_vanilla, summarize

pytestmark = pytest.mark.integration

HIDDEN = 256
ON_GPU = torch.cuda.is_available()
# float32 on the CPU: vLLM's kernels and transformers' sum in other orders; scores here are O(1) to O(1000). On a GPU
# the engine runs bf16 against transformers' float32: the stream differs by bf16's rounding, so a score's error
# scales with |stream| |probe| (not with the score, which a probe nearly orthogonal to the stream makes small): 2%
# of that product, the bound the cosines meet. Measured on an H100: 0.018-0.037 on scores whose largest was 1.2-3.6.
ATOL = 2e-3
GPU_RELATIVE = 0.02
PROMPT = "the residual stream carries what each layer adds to it"


@pytest.fixture(scope="module")
def llm(tiny_model):
    from vllm import LLM

    with pytest.MonkeyPatch.context() as env:  # the engine reads them at start; later modules must not inherit them
        env.setenv("HOTWIRE_READOUT", "1")
        env.setenv("HOTWIRE_READOUT_PROBES", "3")
        env.setenv("HOTWIRE_READOUT_LAYERS", "1-3")  # layer 0 is steered, not read
        engine = LLM(str(tiny_model), **engine_kwargs())
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return hf_reference.load(tiny_model)


@pytest.fixture(scope="module")
def probes(llm):
    from hotwire_core.offline import register_vector

    g = torch.Generator().manual_seed(11)
    vectors = {"joy": torch.randn(HIDDEN, generator=g), "deep": torch.randn(4, HIDDEN, generator=g)}
    register_vector(llm, "joy", vectors["joy"])
    register_vector(llm, "deep", vectors["deep"])
    return {"joy": lambda layer: vectors["joy"], "deep": lambda layer: vectors["deep"][layer]}


@pytest.fixture(scope="module")
def prompt_ids(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model)).encode(PROMPT)


def expected_scores(streams, vector, layer, positions, bias=0.0):
    """``(scores, cosines, |stream| |probe|)`` per position."""
    stream = streams[layer][positions]
    dots = stream @ vector.float()
    norms = stream.norm(dim=-1) * vector.float().norm()
    return (dots + bias).numpy(), (dots / norms).numpy(), norms.numpy()


def check(entry, part, streams, vector, layer, positions, bias=0.0):
    score, cosine, norms = expected_scores(streams, vector, layer, positions, bias)
    got_score, got_cosine = np.array(entry[part]["score"]), np.array(entry[part]["cosine"])
    assert got_score.shape == score.shape, f"{entry['probe']} {part}: {got_score.shape} values, expected {score.shape}"
    err = np.abs(got_score - score).max()
    tolerance = GPU_RELATIVE * norms.max() if ON_GPU else ATOL
    print(f"{entry['probe']} {part}: readout vs transformers + hooks: {err:.3g} (largest {np.abs(score).max():.3g}, "
          f"|stream| |probe| up to {norms.max():.3g}, tolerance {tolerance:.3g})")
    assert err < tolerance, (got_score.tolist(), score.tolist())
    assert np.abs(got_cosine - cosine).max() < (GPU_RELATIVE if ON_GPU else ATOL)
    assert np.abs(score).max() > (tolerance if ON_GPU else 20 * ATOL)  # the check is not one of zeros


def greedy(**extra):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, **extra)


def test_readout_of_prompt_and_generated_tokens_equals_transformers_hooks(llm, hf_model, probes, prompt_ids):
    from hotwire_core.offline import generate_with_readout

    asked = [{"id": "joy", "layer": 1, "bias": 0.25}, {"id": "deep", "layer": 3}]
    (out,) = generate_with_readout(llm, [{"prompt_token_ids": prompt_ids}], greedy(), asked, tokens="all")
    generated = list(out.outputs[0].token_ids)
    readout = out.hotwire_readout
    assert readout["tokens"] == "all" and [p["probe"] for p in readout["probes"]] == ["joy@1:L1", "deep@1:L3"]
    streams = hf_reference.layer_outputs(hf_model, prompt_ids + generated[:-1], [1, 3])
    P, G = len(prompt_ids), len(generated)
    for entry, (name, layer, bias) in zip(readout["probes"], [("joy", 1, 0.25), ("deep", 3, 0.0)]):
        check(entry, "prompt", streams, probes[name](layer), layer, slice(0, P), bias)
        check(entry, "generated", streams, probes[name](layer), layer, slice(P - 1, P - 1 + G), bias)


def test_readout_of_a_steered_request_reads_the_steered_stream(llm, hf_model, probes, prompt_ids):
    """Steering and readout in one request: the probe at the steered layer reads the stream after the steering."""
    from hotwire_core.offline import generate_with_readout, steer

    params = greedy(extra_args=steer({"id": "joy", "layer": 1, "scale": 3.0}))
    (out,) = generate_with_readout(llm, [{"prompt_token_ids": prompt_ids}], params,
                                   [{"id": "joy", "layer": 1}, {"id": "deep", "layer": 2}], tokens="all")
    generated = list(out.outputs[0].token_ids)
    streams = hf_reference.layer_outputs(hf_model, prompt_ids + generated[:-1], [1, 2], [(1, probes["joy"](1), 3.0)])
    P, G = len(prompt_ids), len(generated)
    for entry, (name, layer) in zip(out.hotwire_readout["probes"], [("joy", 1), ("deep", 2)]):
        check(entry, "prompt", streams, probes[name](layer), layer, slice(0, P))
        check(entry, "generated", streams, probes[name](layer), layer, slice(P - 1, P - 1 + G))


def test_each_step_replays_the_graph_variant_of_the_ops_it_needs_and_steering_stays_exact(llm, hf_model, probes,
                                                                                          prompt_ids):
    """With the read op compiled in, a step that only steers replays graphs without it (``ops.graph_variants``),
    one that only reads graphs without the steering op, one that does both the full set; steering in the
    steering-only graphs equals transformers with the hook (on the GPU these are separately captured graphs)."""
    from hotwire_core import contract
    from hotwire_core.offline import generate_with_readout, steer

    def kinds() -> str:
        sets = llm.collective_rpc(contract.GRAPH_SETS)[0]
        assert sets["variants"] == ["idle", "steer", "read", "all"], sets
        return sets["kinds"]

    params = greedy(logprobs=0, prompt_logprobs=0, extra_args=steer({"id": "deep", "layer": 3, "scale": 6.0}))
    (out,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    assert kinds() == "steer"
    generated = list(out.outputs[0].token_ids)
    ids = prompt_ids + generated
    want = hf_reference.logprobs(hf_model, ids, [(3, probes["deep"](3), 6.0, False)])
    plain = hf_reference.logprobs(hf_model, ids)
    got = np.array([next(iter(lp.values())).logprob for lp in [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]])
    targets = torch.tensor(ids[1:])
    expected = want[torch.arange(len(targets)), targets].numpy()
    err = np.abs(got - expected).max()
    moved = np.abs(expected - plain[torch.arange(len(targets)), targets].numpy()).max()
    print(f"steered in the steering-only graphs: logprobs vs transformers {err:.3g}, steering moved them {moved:.3g}")
    assert err < (5e-2 if ON_GPU else 1e-4) and moved > (5 if ON_GPU else 100) * err
    generate_with_readout(llm, [{"prompt_token_ids": prompt_ids}], greedy(), [{"id": "joy", "layer": 1}])
    assert kinds() == "read"
    generate_with_readout(llm, [{"prompt_token_ids": prompt_ids}], params, [{"id": "joy", "layer": 1}])
    assert kinds() == "all"


def test_generated_readout_keeps_the_prefix_cache_and_prompt_readout_does_not_need_it(llm, hf_model, probes):
    """A long prompt twice: the second run's prompt blocks come from the prefix cache. A ``generated`` readout is
    still exact (the last prompt token is always computed); a ``prompt`` readout computes every prompt token (a
    cache salt of its own) and is exact too."""
    from transformers import AutoTokenizer

    from hotwire_core.offline import generate_with_readout

    ids = AutoTokenizer.from_pretrained(str(llm.llm_engine.model_config.model)).encode(" ".join([PROMPT] * 8))
    asked = [{"id": "deep", "layer": 2}]
    prompt = [{"prompt_token_ids": ids}]
    runs = [generate_with_readout(llm, prompt, greedy(), asked, tokens=t)[0] for t in ("generated", "generated", "prompt")]
    assert runs[1].num_cached_tokens > 0, "the second run did not hit the prefix cache: the test checks nothing"
    generated = list(runs[0].outputs[0].token_ids)
    streams = hf_reference.layer_outputs(hf_model, ids + generated[:-1], [2])
    P = len(ids)
    for run in runs[:2]:
        check(run.hotwire_readout["probes"][0], "generated", streams, probes["deep"](2), 2, slice(P - 1, P - 1 + 6))
    check(runs[2].hotwire_readout["probes"][0], "prompt", streams, probes["deep"](2), 2, slice(0, P))
    assert "generated" not in runs[2].hotwire_readout["probes"][0]


def test_plain_batchmate_of_readouts_is_identical_to_vllm_without_hotwire(llm, probes, prompt_ids, tiny_model, tmp_path):
    from vllm import SamplingParams

    from hotwire_core.offline import read

    plain = dict(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    plain_ids = prompt_ids[::-1]
    prompts = [{"prompt_token_ids": prompt_ids}, {"prompt_token_ids": prompt_ids[:5]}, {"prompt_token_ids": plain_ids}]
    params = [SamplingParams(max_tokens=4, ignore_eos=True, extra_args=read([{"id": "joy", "layer": 2}], "all")),
              SamplingParams(max_tokens=4, ignore_eos=True, extra_args=read([{"id": "deep", "layer": 1}])),
              SamplingParams(**plain)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * 3
    (vanilla,), = run_vanilla(tiny_model, [[{"prompt_token_ids": plain_ids, "params": plain}]], tmp_path)
    assert_same_result(summarize(outputs[-1]), vanilla, "the plain batchmate against vLLM without hotwire")


@pytest.mark.parametrize("readout, code", [
    ({"probes": [{"id": "nope", "layer": 1}]}, "unknown_vector"),
    ({"probes": [{"id": "joy", "layer": 9}]}, "layer_out_of_range"),
    ({"probes": [{"id": "joy", "layer": 0}]}, "layer_out_of_range"),  # hooked, but not in HOTWIRE_READOUT_LAYERS
    ({"probes": [{"id": "joy", "layer": 1}] * 4}, "bad_readout"),  # HOTWIRE_READOUT_PROBES=3
    ({"probes": [{"id": "joy", "layer": 1}], "tokens": "some"}, "bad_readout"),
])
def test_a_readout_the_engine_cannot_serve_is_refused_not_served_unread(llm, probes, prompt_ids, readout, code):
    import json

    from vllm import SamplingParams

    from hotwire_core.offline import slot_stats

    before = slot_stats(llm)["refused"].get(code, 0)
    params = SamplingParams(max_tokens=2, extra_args={"hotwire_readout": json.dumps(readout)})
    try:
        outputs = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    except ValueError as exc:  # an in-process engine raises the refusal to the caller
        assert "hotwire" in str(exc)
    else:
        assert outputs[0].outputs[0].finish_reason == "error"
    assert slot_stats(llm)["refused"][code] == before + 1


# -- gated steering (hotwire_core.gates): the condition read at layer 1, the steering applied above it ------------


def gate_decisions(hf_model, token_ids, vector, bias, threshold, below, latch, prompt_len=None):
    """Which positions the reference steers: the condition evaluated on transformers' stream at layer 1 (steering
    above it does not change that layer), per token or latched; and the scores, to keep clear of the threshold."""
    stream = hf_reference.layer_outputs(hf_model, token_ids, [1])[1]
    scores = (stream @ vector.float() + bias).numpy()
    held = scores < threshold if below else scores > threshold
    if prompt_len is not None:
        held[prompt_len:] = False
    if latch:
        first = int(np.argmax(held)) if held.any() else len(held)
        held = np.arange(len(held)) >= first
    return torch.from_numpy(held), scores


def latched_threshold(scores, below):
    """A threshold that a latched condition first crosses at a position after the first, as far as can be from every
    score up to that crossing (later ones do not change a latched decision)."""
    best = (0.0, None)
    for first in range(1, len(scores)):
        before = scores[:first]
        gap = before.min() - scores[first] if below else scores[first] - before.max()
        if gap > best[0]:
            best = (gap, float(np.float32(scores[first] + (gap / 2 if below else -gap / 2))))
    assert best[1] is not None, "no position crosses a threshold the earlier ones stay clear of: choose another prompt"
    return best[1]


def threshold_between(scores):
    """A threshold in the widest gap between two neighbouring scores of the middle half (so that about half hold),
    far from both: the engine's rounding (bf16 on a GPU) must not flip a decision."""
    ordered = np.sort(scores)
    quarter = len(ordered) // 4
    rank = quarter + int(np.argmax(np.diff(ordered[quarter : len(ordered) - quarter])))
    return float(np.float32((ordered[rank] + ordered[rank + 1]) / 2))


@pytest.mark.parametrize("latch, below, cast", [(False, False, False), (True, True, False), (True, False, True)])
def test_gated_steering_equals_transformers_steering_the_tokens_the_condition_lets_through(
        llm, hf_model, probes, prompt_ids, latch, below, cast):
    """Per token (above), latched (below), and CAST (latched on the prompt, steering the answer: ``tokens prompt``
    and ``decode_only``): the engine steers exactly the positions where the reference's condition holds (latched:
    from the first), and its receipt names them."""
    from hotwire_core.offline import generate_with_readout, steer

    P = len(prompt_ids)
    _, scores = gate_decisions(hf_model, prompt_ids, probes["joy"](1), 0.5, 0.0, False, False)
    # per token: about half the prompt holds; latched: the condition first holds after the first prompt token
    threshold = latched_threshold(scores, below) if latch else threshold_between(scores)
    when = {"id": "joy", "layer": 1, "bias": 0.5, "below" if below else "above": threshold, "latch": latch,
            **({"tokens": "prompt"} if cast else {})}
    entry = {"id": "deep", "layer": 3, "scale": 6.0, "when": when, **({"decode_only": True} if cast else {})}
    params = greedy(logprobs=0, prompt_logprobs=0, extra_args=steer(entry))
    (out,) = generate_with_readout(llm, [{"prompt_token_ids": prompt_ids}], params)
    generated = list(out.outputs[0].token_ids)
    ids = prompt_ids + generated[:-1]
    mask, scores = gate_decisions(hf_model, ids, probes["joy"](1), 0.5, threshold, below, latch, P if cast else None)
    held = np.flatnonzero(mask.numpy())  # (latched: every position from the first that held)
    if cast:  # CAST by hand: the prompt decided; only the generated tokens are steered
        mask[:P] = False
    decisive = scores[: held[0] + 1] if latch else scores  # latched: nothing after the first crossing decides
    margin = np.abs(decisive - threshold).min()
    assert margin > (GPU_RELATIVE * np.abs(scores).max() if ON_GPU else 1e-3), "a score lies at the threshold: " \
        "the decision would be rounding's"
    assert mask.any() and not mask.all(), "the condition must let some positions through and hold others back"
    want = hf_reference.logprobs(hf_model, ids + generated[-1:], [(3, probes["deep"](3), 6.0, False)], mask.tolist() + [False])
    plain = hf_reference.logprobs(hf_model, ids + generated[-1:])
    got_prompt = np.array([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]])
    got_generated = np.array([next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs])
    targets = torch.tensor(ids[1:] + generated[-1:])
    expected = want[torch.arange(len(targets)), targets].numpy()
    unsteered = plain[torch.arange(len(targets)), targets].numpy()
    err = np.abs(np.concatenate([got_prompt, got_generated]) - expected).max()
    moved = np.abs(expected - unsteered).max()
    print(f"gated (latch={latch}): {int(mask.sum())} of {len(mask)} positions steered; logprobs vs transformers "
          f"{err:.3g}, steering moved them {moved:.3g}")
    assert err < (5e-2 if ON_GPU else 1e-4) and moved > (5 if ON_GPU else 100) * err
    gate = out.hotwire_gate
    assert gate["fired"] and gate["position"] == int(held[0]) and gate["latch"] is latch
    if not latch:
        assert gate["positions_held"] == len(held)
    assert out.hotwire_readout["probes"] == []  # the condition's probe is not one the caller asked for


def test_a_condition_that_never_holds_steers_nothing_and_says_so(llm, hf_model, probes, prompt_ids, tiny_model,
                                                                 tmp_path):
    """Gated off everywhere: the request's tokens and logprobs are those of vLLM without hotwire, and so are its
    plain batchmate's."""
    from vllm import SamplingParams

    from hotwire_core.offline import generate_with_readout, steer

    plain = dict(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    when = {"id": "joy", "layer": 1, "above": 1e9}
    params = [SamplingParams(**plain, extra_args=steer({"id": "deep", "layer": [2, 3], "scale": 8.0, "when": when})),
              SamplingParams(**plain)]
    prompts = [{"prompt_token_ids": prompt_ids}, {"prompt_token_ids": prompt_ids[::-1]}]
    gated = generate_with_readout(llm, prompts[:1], params[0])[0]
    outputs = llm.generate(prompts, [params[0], params[1]], use_tqdm=False)
    vanilla = run_vanilla(tiny_model, [[{"prompt_token_ids": p["prompt_token_ids"], "params": plain}
                                        for p in prompts]], tmp_path)[0]
    assert gated.hotwire_gate["fired"] is False and gated.hotwire_gate["positions_held"] == 0
    for ours, theirs, what in zip([summarize(gated), *map(summarize, outputs)], [vanilla[0], *vanilla],
                                  ["the gated request alone", "the gated request", "its plain batchmate"]):
        assert_same_result(ours, theirs, f"{what} against vLLM without hotwire")


def test_a_gate_the_engine_cannot_serve_is_refused(llm, probes, prompt_ids):
    from hotwire_core.offline import HotwireError, check_steering, steer

    too_many = [{"id": "joy", "layer": 1}] * 3  # HOTWIRE_READOUT_PROBES=3: no room for the condition's probe
    cases = [
        ({"id": "deep", "layer": 3, "scale": 1.0, "when": {"id": "nope", "layer": 1, "above": 0}}, "unknown_vector"),
        ({"id": "deep", "layer": 3, "scale": 1.0, "when": {"id": "deep", "layer": 2, "above": 0, "version": 9}},
         "version_gone"),
    ]
    for entry, code in cases:
        with pytest.raises(HotwireError) as info:
            check_steering(llm, steer(entry))
        assert info.value.code == code
    import json

    from vllm import SamplingParams

    from hotwire_core.offline import slot_stats

    before = slot_stats(llm)["refused"].get("bad_readout", 0)
    extra = {**steer({"id": "deep", "layer": 3, "scale": 1.0, "when": {"id": "joy", "layer": 1, "above": 0}}),
             "hotwire_readout": json.dumps({"probes": too_many})}
    try:
        outputs = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(max_tokens=2, extra_args=extra),
                               use_tqdm=False)
    except ValueError as exc:
        assert "hotwire" in str(exc)
    else:
        assert outputs[0].outputs[0].finish_reason == "error"
    assert slot_stats(llm)["refused"]["bad_readout"] == before + 1
