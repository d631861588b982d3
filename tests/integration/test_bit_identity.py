"""Unsteered requests, batchmates of steered ones included, are bit-identical to vLLM without hotwire — checked
in bf16 with torch.compile, where Inductor's treatment of the residual stream shows any change hotwire makes to
the compiled graph (float32 hides it: a rounding to float32 of a float32 value changes nothing)."""

from __future__ import annotations

import json

import pytest
import torch

from engine_results import assert_same_result, run_in_subprocess

pytestmark = pytest.mark.integration

GREEDY = dict(max_tokens=6, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)


def test_plain_and_batchmates_bit_identical_in_bf16(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    p1, p2 = tok("Hello world, this is").input_ids, tok("Once upon a time there was").input_ids
    long = tok(" ".join(["steering vectors nudge the residual stream"] * 16)).input_ids  # >= 3 KV blocks of 32
    steer = {"hotwire": json.dumps({"id": "v", "layer": [0, 1, 2, 3], "scale": 4.0})}
    norm = {"hotwire": json.dumps({"id": "v", "layer": 1, "scale": 0.5, "norm": True})}

    def req(ids, **extra):
        return {"prompt_token_ids": ids, "params": {**GREEDY, **extra}}

    # The long prompt runs steered first: its plain run must read none of that KV and match vanilla exactly, and
    # a repeat shows the cache is in use. No prompt logprobs there: vLLM skips reading the cache for them.
    cached = dict(prompt_logprobs=None)
    plain_batches = [[req(p1)], [req(p1), req(p2)], [req(long, **cached)]]
    ours_batches = [[req(p1)], [req(p1), req(p2, extra_args=steer)], [req(p2, extra_args=norm)],
                    [req(long, **cached, extra_args=steer)], [req(long, **cached)], [req(long, **cached)]]
    bf16 = {"dtype": "bfloat16"}
    vanilla = run_in_subprocess(tiny_model, plain_batches, tmp_path, overrides=bf16)
    vector = torch.randn(256, generator=torch.Generator().manual_seed(7)).tolist()
    ours = run_in_subprocess(tiny_model, ours_batches, tmp_path, plugins=True, vectors={"v": vector}, overrides=bf16)

    assert len(long) >= 96 and ours[4][0]["num_cached_tokens"] == 0, "a plain request read steered KV"
    assert ours[5][0]["num_cached_tokens"] >= 64, "prefix caching is off: the check above proves nothing"
    for got, want in ((ours[0][0], vanilla[0][0]), (ours[1][0], vanilla[1][0]), (ours[4][0], vanilla[2][0])):
        assert_same_result(got, want, "a plain request against vLLM without hotwire")
    assert ours[1][1]["logprobs"] != vanilla[1][1]["logprobs"], "the steered batchmate was not steered"
    # Norm-relative steering is opt-in (HOTWIRE_NORM=1) at tensor parallel 1: refused, never served unsteered.
    assert ours[2][0]["finish_reason"] == "error"
