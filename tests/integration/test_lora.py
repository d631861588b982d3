"""LoRA adapters and steering together, on a real vLLM engine with ``enable_lora`` (CPU, float32).

The adapter is peft's own on-disk format (``tests/lora_adapter.py``), with random non-zero A and B on attention and
MLP projections. The reference for a request with the adapter is transformers with the adapter merged into the
weights (peft's ``merge_and_unload``), plus a hook adding ``scale * v`` after the steered layers (``hf_reference``);
unsteered requests, with the adapter or without, are compared bit for bit with a plugin-free engine that serves the
same adapter (within 1e-5 on vLLM's AVX2 CPU build: ``engine_results.assert_same_result``). vLLM's CPU backend runs
LoRA engines eagerly (``CpuPlatform`` sets compilation mode NONE when LoRA is on). The first test serves the adapter
with ``vllm serve --lora-modules`` and steers it through the OpenAI route; the others use an in-process engine.
"""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import torch

import hf_reference
from engine_results import (assert_same_result, engine_kwargs, max_diff, run_batches, run_in_subprocess,
                            same_on_repeat, same_with_cache_hit)
from lora_adapter import RANK, build_lora_adapter, load_merged
from server_fixture import VllmServer

pytestmark = pytest.mark.integration

LORA_ENGINE = dict(enable_lora=True, max_lora_rank=RANK, max_loras=2)
GREEDY = dict(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
# Prompt logprobs only for a request alone in its batch: vLLM 0.25.1 computes them with the batch's per-request
# LoRA mapping (``GPUModelRunner._get_prompt_logprobs_dict``: one logits row per prompt token, one mapping entry
# per request): a batch of two requests that both ask for them killed the engine on the CPU, plugin-free too
# (``einsum(): subscript b has size 2 ... size 3`` in ``bgmv_shrink``; vllm-project/vllm#29955).
ALONE = dict(GREEDY, prompt_logprobs=0)
# Without prompt logprobs: vLLM reads the prefix cache only for requests that do not ask for them.
CACHED = dict(max_tokens=3, temperature=0.0, logprobs=0, ignore_eos=True)
# Weak enough that the adapter still shows under it (at scale 3 the steering swamps the residual stream and the
# adapter moves a steered logprob by only 0.018; at 0.5 by 0.10, the steering by 0.73)
STEER = {"id": "v", "layer": [1, 2], "scale": 0.5}
# float32 vLLM against float32 transformers, the adapter as low-rank matmuls beside the weights on vLLM's side and
# merged into them on transformers': seen 4.8e-7 for every request here
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    return build_lora_adapter(tiny_model, tmp_path_factory.mktemp("lora") / "tiny-lora")


@pytest.fixture(scope="module")
def lora(adapter) -> list:
    """The adapter as the engine runner names it: ``LoRARequest(name, id, path)``."""
    return ["tiny-lora", 1, str(adapter)]


@pytest.fixture(scope="module")
def prompts(tiny_model) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    texts = {  # of different lengths, so a mis-assigned token row would land in another request's tokens
        "fox": "The quick brown fox jumps over",
        "hello": "Hello world, this is",
        "once": "Once upon a time there was a tiny model that",
        "serve": "vLLM serves many requests",
        # >= 3 KV blocks of 32 each, one per order of the prefix-cache check
        "long_steered_first": " ".join(["steering vectors nudge the residual stream"] * 16),
        "long_plain_first": " ".join(["continuous batching with cuda graphs"] * 16),
    }
    return {name: tok(text).input_ids for name, text in texts.items()}


@pytest.fixture(scope="module")
def vector() -> torch.Tensor:
    return torch.randn(256, generator=torch.Generator().manual_seed(11))


def req(ids: list[int], lora: list | None = None, steer: bool = False, **params) -> dict:
    extra = {"extra_args": {"hotwire": json.dumps(STEER)}} if steer else {}
    return {"prompt_token_ids": ids, "params": {**(params or GREEDY), **extra}, "lora": lora}


def unsteered_batches(prompts, lora) -> list[list[dict]]:
    """adapter only beside neither; adapter only alone, with prompt logprobs."""
    return [[req(prompts["hello"], lora), req(prompts["serve"])], [req(prompts["hello"], lora, **ALONE)]]


def mixed_batch(prompts, lora, steered: bool = True) -> list[dict]:
    """adapter + steering, adapter only, steering only, neither (``steered=False``: the same without steering)."""
    return [req(prompts["fox"], lora, steered), req(prompts["hello"], lora), req(prompts["once"], None, steered),
            req(prompts["serve"])]  # fmt: skip


def test_openai_route_steers_a_request_that_names_the_adapter(tiny_model, adapter, prompts, vector, references,
                                                              tmp_path):
    """``vllm serve --enable-lora --lora-modules tiny-lora=PATH``: a completion whose ``model`` is the adapter and
    whose ``vllm_xargs.hotwire`` names a vector registered over HTTP gets both. First in this file: its server
    stops before the module's other engines start (one engine at a time on the CPU)."""
    args = ["--enable-lora", "--max-lora-rank", str(RANK), "--lora-modules", f"tiny-lora={adapter}"]
    server = VllmServer(tiny_model, tmp_path, {}, args)
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            data = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
            registered = http.post("/steer/vectors", json={"id": "v", "data": data, "dtype": "float32", "shape": [256]})
            assert registered.status_code == 201, registered.text

            def complete(model: str, steer: bool) -> httpx.Response:
                body = {"model": model, "prompt": prompts["fox"], "max_tokens": GREEDY["max_tokens"], "temperature": 0,
                        "logprobs": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
                if steer:
                    body["vllm_xargs"] = {"hotwire": json.dumps(STEER)}
                return http.post("/v1/completions", json=body)

            answers = {(model, steer): complete(model, steer)
                       for model, steer in (("tiny-lora", True), ("tiny-lora", False), (str(tiny_model), True))}
    finally:
        server.stop()
    weights = {"tiny-lora": "merged", str(tiny_model): "base"}
    for (model, steer), answer in answers.items():
        assert answer.status_code == 200, answer.text
        assert answer.headers.get("x-hotwire-receipt") == ("v@1:L1+2x0.5" if steer else None)
        choice = answer.json()["choices"][0]
        result = {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"],
                  "prompt_logprobs": []}  # fmt: skip
        assert len(result["logprobs"]) == GREEDY["max_tokens"]
        assert_matches(result, references[weights[model]], prompts["fox"], hook_entries(vector) if steer else [],
                       f"model {model!r}, {'steered' if steer else 'plain'}, over HTTP")


@pytest.fixture(scope="module")
def vanilla(tiny_model, prompts, lora, tmp_path_factory):
    """A plugin-free engine serving the same adapter: the batches of ``mixed`` without steering."""
    batches = [mixed_batch(prompts, lora, steered=False), *unsteered_batches(prompts, lora)]
    return run_in_subprocess(tiny_model, batches, tmp_path_factory.mktemp("vanilla"), overrides=LORA_ENGINE)


@pytest.fixture(scope="module")
def llm(tiny_model, vector, vanilla):
    """hotwire's engine with LoRA on. Started after ``vanilla`` has finished: one engine at a time on the CPU."""
    from vllm import LLM

    from hotwire_core.offline import register_vector

    engine = LLM(str(tiny_model), **engine_kwargs(), **LORA_ENGINE)
    register_vector(engine, "v", vector)
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def references(tiny_model, adapter):
    return {"base": hf_reference.load(tiny_model), "merged": load_merged(tiny_model, adapter)}


def hook_entries(vector) -> list:
    return [(layer, vector, STEER["scale"], False) for layer in STEER["layer"]]


def vllm_logprobs(result: dict) -> torch.Tensor:
    """The prompt tokens' logprobs (all but the first; none if not asked for) followed by the generated tokens'."""
    return torch.tensor(result["prompt_logprobs"][1:] + result["logprobs"])


def reference_logprobs(model, ids: list[int], result: dict, steering: list) -> torch.Tensor:
    """transformers' logprobs of the same tokens: the prompt's (if vLLM's result has them) and those vLLM generated
    after it."""
    full = hf_reference.prompt_logprobs(model, ids + result["token_ids"], steering)
    return full if result["prompt_logprobs"] else full[len(ids) - 1:]


def assert_matches(result, model, ids, steering, what):
    error = (vllm_logprobs(result) - reference_logprobs(model, ids, result, steering)).abs().max().item()
    assert error < TOLERANCE, f"{what}: vLLM differs from its transformers reference by {error}"


def test_adapter_and_steering_equal_merged_weights_plus_hook(llm, prompts, lora, vector, references):
    ids = prompts["fox"]
    (result,) = run_batches(llm, [[req(ids, lora, steer=True, **ALONE)]])[0]
    assert len(result["prompt_logprobs"]) == len(ids) and len(result["logprobs"]) == GREEDY["max_tokens"]
    assert_matches(result, references["merged"], ids, hook_entries(vector), "adapter + steering")
    # Each of the two changes is far above the tolerance, so neither can hide behind it.
    merged_plain = reference_logprobs(references["merged"], ids, result, [])
    base_steered = reference_logprobs(references["base"], ids, result, hook_entries(vector))
    steered = reference_logprobs(references["merged"], ids, result, hook_entries(vector))
    assert (steered - merged_plain).abs().max() > 1000 * TOLERANCE, "the steering is too weak to be seen"
    assert (steered - base_steered).abs().max() > 1000 * TOLERANCE, "the adapter is too weak to be seen"


@pytest.fixture(scope="module")
def mixed(llm, prompts, lora):
    """The mixed batch, then batches with nothing steered (the steering op switched off for the whole step)."""
    return run_batches(llm, [mixed_batch(prompts, lora), *unsteered_batches(prompts, lora)])


def test_a_mixed_batch_gives_each_request_its_own_reference(mixed, prompts, vector, references):
    """One batch (prefill and decode steps) holding adapter + steering, adapter only, steering only and neither."""
    expected = [("fox", "merged", True), ("hello", "merged", False), ("once", "base", True), ("serve", "base", False)]
    for result, (prompt, weights, steered) in zip(mixed[0], expected, strict=True):
        assert result["finish_reason"] == "length"
        steering = hook_entries(vector) if steered else []
        assert_matches(result, references[weights], prompts[prompt], steering,
                       f"{prompt} ({weights} weights, {'steered' if steered else 'plain'}) in a mixed batch")


def test_plain_and_adapter_only_requests_are_bit_identical_to_vllm_without_hotwire(mixed, vanilla):
    """In the mixed batch (steered batchmates: the steering op runs) and in a batch with nothing steered (the op is
    switched off), against a plugin-free engine with the same adapter and the same batches (on vLLM's AVX2 CPU
    kernels within their run-to-run variation: ``assert_same_result``)."""
    assert mixed[2][0]["prompt_logprobs"], "the prompt logprobs were not compared"
    for batch, positions in ((0, (1, 3)), (1, (0, 1)), (2, (0,))):
        for i in positions:
            assert_same_result(mixed[batch][i], vanilla[batch][i],
                               f"batch {batch}, request {i} against vLLM without hotwire")
    # the steered requests of the mixed batch were steered (against their unsteered runs in the vanilla engine)
    for i in (0, 2):
        assert mixed[0][i]["logprobs"] != vanilla[0][i]["logprobs"], f"request {i} was not steered"


def test_prefix_cache_keeps_steered_and_plain_kv_apart_under_one_adapter(llm, prompts, lora):
    def one(prompt: str, steer: bool, **extra) -> dict:
        ids = prompts[prompt]
        assert len(ids) >= 96
        return run_batches(llm, [[req(ids, lora, steer, **CACHED, **extra)]])[0][0]

    # steered first: a plain request with the same adapter and prompt must not read the steered KV
    steered = one("long_steered_first", True)
    again = one("long_steered_first", True)
    assert again["num_cached_tokens"] >= 64, "identical steered requests should share the prefix cache"
    assert same_with_cache_hit(again["logprobs"], steered["logprobs"])
    plain = one("long_steered_first", False)
    assert plain["num_cached_tokens"] == 0, "a plain request with the adapter read steered KV"
    uncached = one("long_steered_first", False, skip_reading_prefix_cache=True)
    assert same_on_repeat(plain["logprobs"], uncached["logprobs"])
    assert max_diff(plain["logprobs"], steered["logprobs"]) > 1e-3, "the steering is too weak to tell the KV apart"

    # plain first: a steered request must not read the plain KV
    one("long_plain_first", False)
    assert one("long_plain_first", False)["num_cached_tokens"] >= 64, "plain requests should share the cache"
    steered = one("long_plain_first", True)
    assert steered["num_cached_tokens"] == 0, "a steered request with the adapter read plain KV"
    uncached = one("long_plain_first", True, skip_reading_prefix_cache=True)
    assert same_on_repeat(steered["logprobs"], uncached["logprobs"])
