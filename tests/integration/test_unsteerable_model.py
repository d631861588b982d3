"""A model hotwire cannot steer (GPT-2: its ``GPT2Block`` lacks the ``(positions, hidden_states, residual)``
decoder-layer contract) starts normally with the plugin loaded, says why it cannot be steered, serves plain
requests, and refuses steered ones instead of serving them unsteered."""

from __future__ import annotations

import json

import pytest
import torch

from engine_results import engine_kwargs, summarize

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gpt2_model(model_root):
    import transformers

    from hotwire_core.tiny_model import SHAPES, _write_tokenizer

    path = model_root / "gpt2-tiny"
    if not (path / "config.json").exists():
        vocab = SHAPES["tiny"].vocab_size
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=512, n_embd=128, n_layer=2, n_head=2,
                                         bos_token_id=0, eos_token_id=0, initializer_range=0.02)  # fmt: skip
        config.architectures = ["GPT2LMHeadModel"]
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(config).save_pretrained(str(path), safe_serialization=True)
        _write_tokenizer(path, vocab)
    return path


def test_an_unsteerable_model_starts_says_why_and_refuses_steering(gpt2_model):
    from vllm import LLM, SamplingParams

    from hotwire_core.offline import register_vector, slot_stats

    llm = LLM(str(gpt2_model), **engine_kwargs())
    try:
        model = slot_stats(llm)["model"]
        assert model["steerable"] is False and "decoder layer" in model["reason"], model
        register_vector(llm, "v", torch.randn(128))  # vectors can still be registered; steering cannot run
        greedy = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
        steer = {"hotwire": json.dumps({"id": "v", "layer": 0, "scale": 1.0})}
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 2,
                            [SamplingParams(**greedy), SamplingParams(**greedy, extra_args=steer)], use_tqdm=False)  # fmt: skip
        plain, steered = (summarize(o) for o in outs)
        assert len(plain["token_ids"]) == 4 and plain["finish_reason"] == "length"
        assert steered["finish_reason"] == "error" and steered["token_ids"] == []  # refused, not served unsteered
        assert slot_stats(llm)["refused"] == {"model_not_steerable": 1}
    finally:
        llm.llm_engine.engine_core.shutdown()
