"""Chunked prefill: prompts of ~1,000 tokens run 128 tokens a step (``max_num_batched_tokens=128``), beside
requests that decode meanwhile, with prefix caching on. Every position of every steered sequence equals
transformers with a hook there (prompt logprobs and generated ones), ``prefill_only`` / ``decode_only`` split at
the prompt's end whatever chunk it falls in, and a prefix-cache hit happens only for the same steering.

float32 on any device: the comparison with transformers is the point of this file."""

from __future__ import annotations

import json

import pytest
import torch

import hf_reference
from engine_results import engine_kwargs, run_batches

pytestmark = pytest.mark.integration

HIDDEN, BUDGET = 256, 128
ENTRY = {"id": "v", "layer": [1, 2], "scale": 1.5}
STEERING = [(1, "v", 1.5), (2, "v", 1.5)]
TOLERANCE = 2e-3  # float32 vLLM vs transformers, as in test_engine.py
LONG_TOKENS = dict(max_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
DECODING = dict(max_tokens=48, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)


def spec(**extra) -> dict:
    return {"hotwire": json.dumps({**ENTRY, **extra})}


@pytest.fixture(scope="module")
def vector() -> torch.Tensor:
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def prompts(tiny_model) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    long = tok(" ".join(["steering vectors nudge the residual stream of a language model."] * 70)).input_ids
    assert 900 <= len(long) <= 1100 and len(long) % BUDGET, len(long)  # the prompt ends inside a chunk
    return {"long": long, "short": tok("Hello world, this is").input_ids, "fox": tok("The quick brown fox").input_ids}


@pytest.fixture(scope="module")
def llm(tiny_model, vector):
    from vllm import LLM

    from hotwire_core.offline import register_vector

    kwargs = {**engine_kwargs(), "dtype": "float32", "max_model_len": 2048, "max_num_batched_tokens": BUDGET,
              "enable_chunked_prefill": True, "enable_prefix_caching": True}  # fmt: skip
    engine = LLM(str(tiny_model), **kwargs)
    scheduler = engine.llm_engine.vllm_config.scheduler_config
    assert scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens == BUDGET
    register_vector(engine, "v", vector)
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return hf_reference.load(tiny_model)


def expected(hf_model, vector, ids: list[int], positions: slice | None) -> torch.Tensor:
    """Transformers' logprob of every token of ``ids`` after the first, steered at ``positions`` (None: plain)."""
    steering = [] if positions is None else [(layer, vector, scale, False) for layer, _, scale in STEERING]
    return hf_reference.prompt_logprobs(hf_model, ids, steering, positions or slice(None))


def every_logprob(result: dict) -> torch.Tensor:
    """vLLM's logprob of every token after the first: the prompt's, then the generated ones'."""
    return torch.tensor(result["prompt_logprobs"][1:] + result["logprobs"])


def assert_equals_transformers(hf_model, vector, ids: list[int], result: dict, positions: slice | None, what: str):
    want = expected(hf_model, vector, ids + result["token_ids"], positions)
    err = (every_logprob(result) - want).abs().max().item()
    assert err < TOLERANCE, f"{what}: differs from transformers with the hook by {err}"


def test_chunked_prompts_beside_decoding_requests_equal_transformers(llm, hf_model, vector, prompts):
    """Short requests first, so that they decode while the long ones' chunks run: every step mixes decode tokens
    with a prefill chunk. The three long requests share their prompt and differ in steering: each must read only
    KV computed under its own."""
    long, short, fox = prompts["long"], prompts["short"], prompts["fox"]
    P = len(long)
    def chunked(**extra) -> dict:
        return {"prompt_token_ids": long, "params": {**LONG_TOKENS, "prompt_logprobs": 0, "extra_args": spec(**extra)}}

    batch = [
        {"prompt_token_ids": short, "params": DECODING},
        {"prompt_token_ids": fox, "params": {**DECODING, "extra_args": spec(decode_only=True)}},
        chunked(),
        chunked(prefill_only=True),
        chunked(decode_only=True),
    ]
    plain_short, steered_fox, whole, prefill, decode = run_batches(llm, [batch])[0]
    assert_equals_transformers(hf_model, vector, short, plain_short, None, "the plain decoding batchmate")
    assert_equals_transformers(hf_model, vector, fox, steered_fox, slice(len(fox), None), "the decode_only batchmate")
    assert_equals_transformers(hf_model, vector, long, whole, slice(None), "the chunked steered prompt")
    assert_equals_transformers(hf_model, vector, long, prefill, slice(None, P), "prefill_only across chunks")
    assert_equals_transformers(hf_model, vector, long, decode, slice(P, None), "decode_only across chunks")
    # The steering is far above the tolerance in every phase it touches.
    plain = expected(hf_model, vector, long + whole["token_ids"], None)
    assert (every_logprob(whole) - plain).abs().max().item() > 20 * TOLERANCE
    assert (every_logprob(decode)[P - 1 :] - plain[P - 1 :]).abs().max().item() > 20 * TOLERANCE
    assert len(plain_short["token_ids"]) == DECODING["max_tokens"]


def test_a_chunked_prompt_hits_the_prefix_cache_only_under_the_same_steering(llm, prompts):
    """No prompt logprobs here: vLLM does not read the prefix cache for a request that asks for them."""
    long = prompts["long"]

    def run(**extra) -> dict:
        return run_batches(llm, [[{"prompt_token_ids": long, "params": {**LONG_TOKENS, **extra}}]])[0][0]

    first = run(extra_args=spec(), skip_reading_prefix_cache=True)
    again = run(extra_args=spec())
    assert again["num_cached_tokens"] >= len(long) - 2 * 32, "the same steering should hit the cache"
    assert max(abs(x - y) for x, y in zip(again["logprobs"], first["logprobs"])) < 1e-5
    assert run()["num_cached_tokens"] == 0, "a plain request read steered KV"
    assert run(extra_args=spec(scale=1.0))["num_cached_tokens"] == 0, "another scale read this steering's KV"
    # prefill_only steers the prompt exactly as the whole spec does, but its cache salt is its own (with the
    # prompt length): it does not read the whole spec's blocks; run twice, it reads its own.
    assert run(extra_args=spec(scale=1.25))["num_cached_tokens"] == 0
    assert run(extra_args=spec(scale=1.25, prefill_only=True))["num_cached_tokens"] == 0
    assert run(extra_args=spec(scale=1.25, prefill_only=True))["num_cached_tokens"] >= len(long) - 2 * 32
