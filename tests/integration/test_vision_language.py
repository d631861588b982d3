"""A vision-language model with an image in the prompt (CPU: float32, real random weights, eager): hotwire hooks the
text decoder's layers (not the vision tower's), steering with the image's tokens in the prompt equals a transformers
forward of the same model with the same image and a hook, and a plain request with the image is bit-identical to
vLLM without hotwire.

The model is a tiny Idefics3 (:mod:`hotwire_core.tiny_vlm`: a Llama text decoder under ``model.text_model``, a
SigLIP-style vision tower). Qwen2-VL and Qwen2.5-VL do not start on vLLM 0.25.1's CPU install, plugin-free too: its
``qwen2_vl.py`` imports transformers' Qwen2-VL image processor, which needs torchvision, which that install leaves
out.
"""

from __future__ import annotations

import json

import pytest
import torch

import hf_reference
from engine_results import engine_kwargs, run_batches, run_in_subprocess
from hotwire_core.tiny_vlm import IMAGE_SIDE, IMAGE_TOKEN, build_vlm

pytestmark = pytest.mark.integration

PROMPT = f"Hello {IMAGE_TOKEN} steering vectors nudge the residual stream"
STEERED_LAYERS = [1, 2]
SCALE = 3.0
# Over engine_kwargs(), for both engines: one image a prompt; eager on the CPU (an eager and a compiled engine
# differ in the last bit of some logprobs).
ENGINE = {"limit_mm_per_prompt": {"image": 1}, **({} if torch.cuda.is_available() else {"enforce_eager": True})}


def _image() -> list:
    """A tile-sized RGB image of random pixels, as nested lists (the runner's JSON form)."""
    import numpy as np

    return np.random.default_rng(0).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8).tolist()


def _request(params: dict) -> dict:
    return {"prompt": PROMPT, "image": _image(), "params": params}


@pytest.fixture(scope="module")
def vlm(model_root):
    from vllm import LLM

    from hotwire_core.offline import register_vector

    model_dir = build_vlm(model_root / "idefics3-tiny")
    llm = LLM(str(model_dir), **engine_kwargs(), **ENGINE)
    vector = torch.randn(128, generator=torch.Generator().manual_seed(11))
    register_vector(llm, "v", vector)
    yield model_dir, llm, vector
    llm.llm_engine.engine_core.shutdown()


def test_the_text_decoder_layers_are_hooked(vlm):
    """The 4 text-decoder layers, at the text decoder's width (the vision tower's 2 layers are 32 wide)."""
    from transformers import AutoConfig

    from hotwire_core.offline import slot_stats

    model_dir, llm, _ = vlm
    model = slot_stats(llm)["model"]
    config = AutoConfig.from_pretrained(str(model_dir))
    assert config.vision_config.hidden_size != config.text_config.hidden_size
    assert (model["steerable"], model["layers"], model["n_layers"], model["hidden_size"]) == (
        True, "0-3", config.text_config.num_hidden_layers, config.text_config.hidden_size), model


def test_steering_with_an_image_equals_transformers_hook(vlm):
    """Plain and steered prompt logprobs (the image's tokens among them) equal transformers' forward of the same
    token ids and pixels without and with the hook after the steered text-decoder layers."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    model_dir, llm, vector = vlm
    params = dict(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    steer = {"hotwire": json.dumps({"id": "v", "layer": STEERED_LAYERS, "scale": SCALE})}
    [plain], [steered] = run_batches(llm, [[_request(params)], [_request({**params, "extra_args": steer})]])
    processor = AutoProcessor.from_pretrained(str(model_dir))
    image = Image.fromarray(np.array(_image(), dtype=np.uint8))  # as the runner gives it to vLLM
    inputs = processor(text=[PROMPT], images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    assert plain["prompt_token_ids"] == steered["prompt_token_ids"] == ids
    assert ids.count(processor.image_token_id) == 5 * 16, "the image is 4 tiles and the whole, 16 tokens each"
    pixels = {"pixel_values": inputs["pixel_values"], "pixel_attention_mask": inputs["pixel_attention_mask"]}
    hf = hf_reference.load(model_dir, images=True)
    expected_plain = hf_reference.prompt_logprobs(hf, ids, **pixels)
    expected = hf_reference.prompt_logprobs(hf, ids, [(layer, vector, SCALE, False) for layer in STEERED_LAYERS],
                                            **pixels)
    white = hf_reference.prompt_logprobs(hf, ids, **{**pixels, "pixel_values": torch.ones_like(pixels["pixel_values"])})
    errors = {"plain": (torch.tensor(plain["prompt_logprobs"][1:]) - expected_plain).abs().max().item(),
              "steered": (torch.tensor(steered["prompt_logprobs"][1:]) - expected).abs().max().item(),
              "steering's effect": (expected - expected_plain).abs().max().item(),
              "a white image's effect": (white - expected_plain).abs().max().item()}
    print(f"largest prompt logprob differences: {errors}")
    assert errors["plain"] < 2e-3 and errors["steered"] < 2e-3, errors
    assert errors["steering's effect"] > 0.02, "the steering in this check is too weak to be seen"
    assert errors["a white image's effect"] > 0.02, "the image's pixels do not reach the logprobs"


def test_a_plain_request_with_an_image_is_bit_identical_to_vllm_without_hotwire(vlm, tmp_path):
    """Prompt logprobs and four greedy tokens with their logprobs, after a steered request with the same image (vLLM
    caches the vision tower's output by the image alone: hotwire steers only the text decoder, so that is right)."""
    model_dir, llm, _ = vlm
    params = dict(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0)
    steer = {"hotwire": json.dumps({"id": "v", "layer": STEERED_LAYERS, "scale": SCALE})}
    batches = [[_request(params)]]
    [_], ours = run_batches(llm, [[_request({**params, "extra_args": steer})], *batches])
    vanilla = run_in_subprocess(model_dir, batches, tmp_path, overrides=ENGINE)  # VLLM_PLUGINS=""
    assert ours == vanilla[0]
    assert len(ours[0]["token_ids"]) == 4

