"""Other decoder architectures than Qwen3 (Llama, Qwen2, Mistral, Gemma): hotwire finds their layers, and
steering equals a transformers forward with a hook on the same weights (CPU, float32, real random weights). The
Gemma engine hooks only layers 1-2 (``HOTWIRE_LAYERS``): the others are refused, and the hooked ones still equal
the reference."""

from __future__ import annotations

import json
import os

import pytest
import torch

import hf_reference
from engine_results import engine_kwargs, run_batches

pytestmark = pytest.mark.integration
HOOKED = {"llama": "0-3", "qwen2": "0-3", "mistral": "0-3", "gemma": "1-2"}  # HOTWIRE_LAYERS per engine (the tiny models have 4 layers)


@pytest.fixture(scope="module", params=list(HOOKED))
def arch_engine(request, model_root):
    from vllm import LLM

    from hotwire_core.offline import register_vector
    from hotwire_core.tiny_model import ModelShape, build_model

    model_dir = build_model(model_root / f"{request.param}-tiny", ModelShape(arch=request.param))
    saved = os.environ.get("HOTWIRE_LAYERS")  # read by the engine process at start; later modules must not inherit it
    os.environ["HOTWIRE_LAYERS"] = HOOKED[request.param]
    try:
        llm = LLM(str(model_dir), **engine_kwargs())
    finally:
        if saved is None:
            os.environ.pop("HOTWIRE_LAYERS")
        else:
            os.environ["HOTWIRE_LAYERS"] = saved
    vector = torch.randn(256, generator=torch.Generator().manual_seed(11))
    register_vector(llm, "v", vector)
    yield model_dir, llm, vector, request.param
    llm.llm_engine.engine_core.shutdown()


def test_steering_equals_transformers_hook(arch_engine):
    model_dir, llm, vector, _ = arch_engine
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir))("The quick brown fox jumps over").input_ids
    params = dict(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    steer = {"hotwire": json.dumps({"id": "v", "layer": [1, 2], "scale": 3.0})}
    plain, steered = run_batches(llm, [[{"prompt_token_ids": ids, "params": params}],
                                       [{"prompt_token_ids": ids, "params": {**params, "extra_args": steer}}]])
    hf = hf_reference.load(model_dir)
    expected_plain = hf_reference.prompt_logprobs(hf, ids)
    expected = hf_reference.prompt_logprobs(hf, ids, [(1, vector, 3.0, False), (2, vector, 3.0, False)])
    assert (torch.tensor(plain[0]["prompt_logprobs"][1:]) - expected_plain).abs().max() < 2e-3
    assert (torch.tensor(steered[0]["prompt_logprobs"][1:]) - expected).abs().max() < 2e-3
    assert (expected - expected_plain).abs().max() > 0.02, "the steering in this check is too weak to be seen"


def test_only_hotwire_layers_are_steered(arch_engine):
    from hotwire_core.offline import slot_stats
    from hotwire_core.settings import parse_layers

    _, llm, _, arch = arch_engine
    hooked = parse_layers(HOOKED[arch])
    assert slot_stats(llm)["model"]["layers"] == HOOKED[arch]  # what the workers hooked
    for layer in range(4):
        result = llm.collective_rpc("hotwire_check", args=(json.dumps({"id": "v", "layer": layer, "scale": 1.0}),))[0]
        if layer in hooked:
            assert result["ok"], result
        else:
            assert (result["ok"], result["code"]) == (False, "layer_out_of_range"), result
            assert f"steers layers {HOOKED[arch]} (HOTWIRE_LAYERS" in result["error"]
