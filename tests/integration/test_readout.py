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
from engine_results import engine_kwargs, run_vanilla, summarize

pytestmark = pytest.mark.integration

HIDDEN = 256
ON_GPU = torch.cuda.is_available()
# float32 on the CPU: vLLM's kernels and transformers' sum in other orders; scores here are O(1) to O(1000). On a GPU
# the engine runs bf16 against transformers' float32: a first bound of 2% of the largest score, not yet run there.
ATOL = 2e-3
GPU_RELATIVE = 0.02
PROMPT = "the residual stream carries what each layer adds to it"


@pytest.fixture(scope="module")
def llm(tiny_model):
    from vllm import LLM

    with pytest.MonkeyPatch.context() as env:  # the engine reads them at start; later modules must not inherit them
        env.setenv("HOTWIRE_READOUT", "1")
        env.setenv("HOTWIRE_READOUT_PROBES", "3")
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
    stream = streams[layer][positions]
    dots = stream @ vector.float()
    cosine = dots / (stream.norm(dim=-1) * vector.float().norm())
    return (dots + bias).numpy(), cosine.numpy()


def check(entry, part, streams, vector, layer, positions, bias=0.0):
    score, cosine = expected_scores(streams, vector, layer, positions, bias)
    got_score, got_cosine = np.array(entry[part]["score"]), np.array(entry[part]["cosine"])
    assert got_score.shape == score.shape, f"{entry['probe']} {part}: {got_score.shape} values, expected {score.shape}"
    err = np.abs(got_score - score).max()
    tolerance = GPU_RELATIVE * np.abs(score).max() if ON_GPU else ATOL
    print(f"{entry['probe']} {part}: readout vs transformers + hooks: {err:.3g} (largest {np.abs(score).max():.3g}, "
          f"tolerance {tolerance:.3g})")
    assert err < tolerance
    assert np.abs(got_cosine - cosine).max() < (GPU_RELATIVE if ON_GPU else ATOL)
    assert np.abs(score).max() > 20 * tolerance  # the check is not one of zeros


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
              SamplingParams(max_tokens=4, ignore_eos=True, extra_args=read([{"id": "deep", "layer": 0}])),
              SamplingParams(**plain)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * 3
    (vanilla,), = run_vanilla(tiny_model, [[{"prompt_token_ids": plain_ids, "params": plain}]], tmp_path)
    ours = summarize(outputs[-1])
    assert ours["token_ids"] == vanilla["token_ids"]
    assert ours["logprobs"] == vanilla["logprobs"], "the batchmate's logprobs differ from vLLM without hotwire"
    assert ours["prompt_logprobs"] == vanilla["prompt_logprobs"]


@pytest.mark.parametrize("readout, code", [
    ({"probes": [{"id": "nope", "layer": 1}]}, "unknown_vector"),
    ({"probes": [{"id": "joy", "layer": 9}]}, "layer_out_of_range"),
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
