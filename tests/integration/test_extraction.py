"""Vectors from contrastive examples, captured inside a real vLLM 0.25.1 engine (``HOTWIRE_CAPTURE=1``), against the
same computation on a plain transformers forward with hooks on the same weights (float32 on the CPU).

One engine serves the module; the plain batchmate is compared with a plugin-free engine in a clean subprocess. On a
GPU the engine runs bf16 with CUDA graphs: tolerances there scale with how far the engine's own activations (or plain
logprobs) are from transformers' float32, measured in the same run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import hf_reference
from engine_results import assert_same_result, engine_kwargs, run_vanilla, summarize
from hotwire_core import contract
from hotwire_core.extraction import extract

pytestmark = pytest.mark.integration

LAYERS = [0, 3]
ROWS = 4  # fewer than the examples: extraction runs them in chunks
# float32 on the CPU: vLLM's kernels and transformers' sum in other orders; activations here are O(1).
ATOL = {"mean_diff": 2e-4, "pca": 2e-4}
ON_GPU = torch.cuda.is_available()

POSITIVE = ["I love this, it is wonderful and bright", "What a happy sunny day", "Joy fills the room today",
            "We laughed and danced all night long"]
NEGATIVE = ["I hate this, it is awful and dark", "What a sad rainy day", "Grief fills the room today",
            "We cried and sat alone all night long"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    from vllm import LLM

    with pytest.MonkeyPatch.context() as env:  # the engine reads them at start; later modules must not inherit them
        env.setenv("HOTWIRE_CAPTURE", "1")
        env.setenv("HOTWIRE_CAPTURE_ROWS", str(ROWS))
        engine = LLM(str(tiny_model), **engine_kwargs())
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return hf_reference.load(tiny_model)


@pytest.fixture(scope="module")
def token_ids(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    return {text: tok.encode(text) for text in POSITIVE + NEGATIVE}


def reference_acts(hf_model, token_ids, texts, position) -> np.ndarray:
    out = []
    for text in texts:
        per_layer = hf_reference.layer_outputs(hf_model, token_ids[text], LAYERS)
        out.append([(per_layer[l][-1] if position == "last" else per_layer[l].mean(0)).double().numpy() for l in LAYERS])
    return np.array(out)


def exported(llm, vector_id) -> np.ndarray:
    result = llm.collective_rpc(contract.EXPORT, args=(vector_id, None))[0]
    assert result["ok"], result
    return np.frombuffer(result["data"], np.float32).reshape(len(LAYERS), -1)


@pytest.fixture(scope="module")
def activation_floor(llm, hf_model, token_ids) -> float:
    """The engine's captured activations against transformers' at the same tokens: float32 rounding on the CPU,
    bf16 on a GPU. Extraction cannot be closer to the reference than its inputs are."""
    from hotwire_core.offline_extraction import capture_activations

    got = capture_activations(llm, POSITIVE, LAYERS, "last")
    floor = float(np.abs(got - reference_acts(hf_model, token_ids, POSITIVE, "last")).max())
    print(f"activation floor (engine vs transformers, last token): {floor:.3g}")
    return floor


@pytest.mark.parametrize("position", ["last", "mean"])
@pytest.mark.parametrize("method", ["mean_diff", "pca"])
def test_extracted_vector_equals_transformers_hooks(llm, hf_model, token_ids, activation_floor, method, position):
    from hotwire_core.offline_extraction import extract_vector

    vector_id = f"x-{method}-{position}"
    result = extract_vector(llm, vector_id, POSITIVE, NEGATIVE, layers=LAYERS, method=method, position=position)
    assert result["vector"]["layers"] == LAYERS and result["vector"]["version"] == 1
    pos = reference_acts(hf_model, token_ids, POSITIVE, position)
    neg = reference_acts(hf_model, token_ids, NEGATIVE, position)
    expected, report = extract(pos, neg, LAYERS, method)
    got = exported(llm, vector_id)
    err = np.abs(got - expected).max()
    # Averaging over examples does not add to its inputs' error (H200, bf16: 0.001-0.0021 against a floor of 0.0046).
    tolerance = max(ATOL[method], activation_floor) if ON_GPU else ATOL[method]
    print(f"{method}/{position}: extracted vector vs transformers + hooks: {err:.3g} (tolerance {tolerance:.3g}, "
          f"largest entry {np.abs(expected).max():.3g})")
    assert err < tolerance, f"{method}/{position}: extracted vector differs from transformers + hooks by {err}"
    assert np.abs(expected).max() > 20 * tolerance  # the check is not one of zeros
    for mine, theirs in zip(result["layers"], report):
        assert mine["layer"] == theirs["layer"]
        if not ON_GPU:  # bf16 may move an example across the midpoint; the vector's check above bounds it there
            assert mine["accuracy"] == theirs["accuracy"]
            assert mine["separation"] == pytest.approx(theirs["separation"], rel=1e-3)


def test_mean_capture_twice_same_prompt_is_not_served_from_the_prefix_cache(llm):
    """A mean capture must compute every prompt token: the same prompts again (cached blocks of 32 tokens) give the
    same vector, where a cache hit would make the worker refuse the capture as incomplete."""
    from hotwire_core.offline_extraction import capture_activations

    long = [" ".join(["steering vectors nudge the residual stream"] * 10)]
    first = capture_activations(llm, long, LAYERS, "mean")
    second = capture_activations(llm, long, LAYERS, "mean")
    assert np.abs(first - second).max() < 1e-5


def test_plain_batchmate_is_identical_to_vllm_without_hotwire(llm, token_ids, tiny_model, tmp_path):
    from vllm import SamplingParams

    from hotwire_core.capture_admission import capture_args
    from hotwire_core.offline_extraction import capture_tags, take_activations

    plain_ids = token_ids[POSITIVE[0]] + token_ids[NEGATIVE[1]]
    plain = dict(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    tags = capture_tags(3)
    prompts = [{"prompt_token_ids": token_ids[t]} for t in NEGATIVE[:3]] + [{"prompt_token_ids": plain_ids}]
    params = [SamplingParams(max_tokens=1, extra_args=capture_args(tag, LAYERS, "mean")) for tag in tags]
    outputs = llm.generate(prompts, params + [SamplingParams(**plain)], use_tqdm=False)
    acts = take_activations(llm, tags, LAYERS)
    assert acts.shape == (3, len(LAYERS), 256) and np.isfinite(acts).all()
    (vanilla,), = run_vanilla(tiny_model, [[{"prompt_token_ids": plain_ids, "params": plain}]], tmp_path)
    # bf16 graphs on a GPU too: the capture op reads no value Inductor would otherwise keep unstored (stream_read)
    assert_same_result(summarize(outputs[-1]), vanilla, "the plain batchmate against vLLM without hotwire")


def test_steering_with_capture_compiled_in_equals_transformers_hook(llm, hf_model, token_ids):
    from vllm import SamplingParams

    from hotwire_core.offline import register_vector

    v = torch.randn(256, generator=torch.Generator().manual_seed(7))
    register_vector(llm, "steer-me", v)
    ids = token_ids[POSITIVE[1]]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                            extra_args={"hotwire": json.dumps({"id": "steer-me", "layer": 2, "scale": 4.0})})
    got = summarize(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0])["prompt_logprobs"][1:]
    plain_params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    got_plain = summarize(llm.generate([{"prompt_token_ids": ids}], plain_params, use_tqdm=False)[0])
    got_plain = got_plain["prompt_logprobs"][1:]
    expected = hf_reference.prompt_logprobs(hf_model, ids, [(2, v, 4.0, False)])
    plain = hf_reference.prompt_logprobs(hf_model, ids)
    # On a GPU bf16 is the floor: the plain request's own distance from transformers' float32.
    tolerance = max(2e-3, 2 * (torch.tensor(got_plain) - plain).abs().max().item()) if ON_GPU else 2e-3
    err = (torch.tensor(got) - expected).abs().max().item()
    print(f"steering with capture compiled in vs transformers + hook: {err:.3g} (tolerance {tolerance:.3g})")
    assert err < tolerance
    assert (expected - plain).abs().max().item() > 10 * tolerance


def test_captures_beyond_the_rows_are_refused_and_rows_come_back(llm, token_ids):
    """HOTWIRE_CAPTURE_ROWS bounds the captures running at once: one more in the same batch is refused (429
    capture_busy, counted), never served without its capture; finished or refused, none keeps a row."""
    from vllm import SamplingParams

    from hotwire_core.capture_admission import capture_args
    from hotwire_core.extraction import ExtractionError
    from hotwire_core.offline import slot_stats
    from hotwire_core.offline_extraction import capture_tags, take_activations

    before = slot_stats(llm)["refused"].get("capture_busy", 0)
    tags = capture_tags(ROWS + 1)
    prompts = [{"prompt_token_ids": token_ids[t]} for t in (POSITIVE + NEGATIVE)[: ROWS + 1]]
    # Long enough that the first ones still run when the last arrives (the engine may step between arrivals).
    long = dict(max_tokens=64, ignore_eos=True)
    params = [SamplingParams(**long, extra_args=capture_args(tag, LAYERS, "last")) for tag in tags]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs].count("error") == 1
    refused = next(tag for tag, o in zip(tags, outputs) if o.outputs[0].finish_reason == "error")
    stats = slot_stats(llm)
    assert stats["refused"]["capture_busy"] == before + 1 and stats["capturing"] == 0
    assert take_activations(llm, [t for t in tags if t != refused], LAYERS).shape == (ROWS, len(LAYERS), 256)
    with pytest.raises(ExtractionError, match="no worker holds the capture"):
        take_activations(llm, [refused], LAYERS)
