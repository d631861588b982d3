"""Unsteered requests, the batchmate of a steered one included, are bit-identical to vLLM without hotwire on model
families beyond the dense Llama shape of ``test_bit_identity.py``, with torch.compile:

* a mixture of experts (tiny Qwen3-MoE: 4 experts, 2 per token, vLLM's fused MoE), in bf16;
* gpt-oss (experts, sliding-window and global layers, attention sinks), in bf16;
* Gemma 3 (post-MLP norm, interleaved sliding window), in float32. In bf16 its plain requests are *not*
  bit-identical: Inductor fuses Gemma 3's post-MLP norm with the next layer's add-norm and keeps the residual
  stream in float32 across the layer boundary, where any hotwire node there (the op on ``hidden`` or on
  ``residual``, or steering as plain torch ops) makes it a bf16 tensor in memory. Same greedy tokens, logprobs
  4e-3 apart on the CPU (benchmarks/RESULTS.md, "Serving configurations"); docs/usage.md says so."""

from __future__ import annotations

import json

import pytest
import torch

from engine_results import assert_same_result, run_in_subprocess

pytestmark = pytest.mark.integration

GREEDY = dict(max_tokens=6, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)


@pytest.mark.parametrize(("arch", "dtype"),
                         [("qwen3_moe", "bfloat16"), ("gemma3", "float32"), ("gpt_oss", "bfloat16")])
def test_plain_requests_bit_identical(model_root, tmp_path, arch, dtype):
    from transformers import AutoTokenizer

    from hotwire_core.tiny_model import ModelShape, build_model

    model_dir = build_model(model_root / f"{arch}-tiny", ModelShape(arch=arch))
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    p1, p2 = tok("Hello world, this is").input_ids, tok("Once upon a time there was").input_ids
    steer = {"hotwire": json.dumps({"id": "v", "layer": [0, 1, 2, 3], "scale": 4.0})}

    def req(ids, **extra):
        return {"prompt_token_ids": ids, "params": {**GREEDY, **extra}}

    plain_batches = [[req(p1)], [req(p1), req(p2)]]
    ours_batches = [[req(p1)], [req(p1), req(p2, extra_args=steer)]]
    overrides = {"dtype": dtype}
    vanilla = run_in_subprocess(model_dir, plain_batches, tmp_path, overrides=overrides)
    vector = torch.randn(hidden, generator=torch.Generator().manual_seed(7)).tolist()
    ours = run_in_subprocess(model_dir, ours_batches, tmp_path, plugins=True, vectors={"v": vector}, overrides=overrides)

    for got, want in ((ours[0][0], vanilla[0][0]), (ours[1][0], vanilla[1][0])):
        assert_same_result(got, want, "a plain request against vLLM without hotwire")
    assert ours[1][1]["logprobs"] != vanilla[1][1]["logprobs"], "the steered batchmate was not steered"
