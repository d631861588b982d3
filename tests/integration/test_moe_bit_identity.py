"""On a mixture-of-experts model (tiny Qwen3-MoE: 4 experts, 2 per token, vLLM's fused MoE), unsteered requests,
the batchmate of a steered one included, are bit-identical to vLLM without hotwire: bf16 with torch.compile, as
``test_bit_identity.py`` checks the dense model."""

from __future__ import annotations

import json

import pytest
import torch

from engine_results import run_in_subprocess

pytestmark = pytest.mark.integration

GREEDY = dict(max_tokens=6, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)


def test_plain_requests_bit_identical_on_a_moe_model(model_root, tmp_path):
    from transformers import AutoTokenizer

    from hotwire_core.tiny_model import ModelShape, build_model

    model_dir = build_model(model_root / "qwen3_moe-tiny", ModelShape(arch="qwen3_moe"))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    p1, p2 = tok("Hello world, this is").input_ids, tok("Once upon a time there was").input_ids
    steer = {"hotwire": json.dumps({"id": "v", "layer": [0, 1, 2, 3], "scale": 4.0})}

    def req(ids, **extra):
        return {"prompt_token_ids": ids, "params": {**GREEDY, **extra}}

    plain_batches = [[req(p1)], [req(p1), req(p2)]]
    ours_batches = [[req(p1)], [req(p1), req(p2, extra_args=steer)]]
    bf16 = {"dtype": "bfloat16"}
    vanilla = run_in_subprocess(model_dir, plain_batches, tmp_path, overrides=bf16)
    vector = torch.randn(256, generator=torch.Generator().manual_seed(7)).tolist()
    ours = run_in_subprocess(model_dir, ours_batches, tmp_path, plugins=True, vectors={"v": vector}, overrides=bf16)

    for got, want in ((ours[0][0], vanilla[0][0]), (ours[1][0], vanilla[1][0])):
        for key in ("token_ids", "logprobs", "prompt_logprobs"):
            assert got[key] == want[key], f"plain request {key} differ from vLLM without hotwire"
    assert ours[1][1]["logprobs"] != vanilla[1][1]["logprobs"], "the steered batchmate was not steered"
