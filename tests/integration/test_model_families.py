"""Model families beyond the dense decoders of the model matrix (CPU: float32, real random weights, eager; a GPU:
bf16 with graphs, steering within twice the plain request's own distance from transformers): hotwire
finds their decoder layers and steering equals a transformers forward with a hook on the same weights, or, for a
model whose layers lack the contract, hotwire says why and refuses steering.

* ``qwen3_moe``: mixture of experts (4 experts, 2 per token; vLLM's fused MoE for the CPU);
* ``gemma3``: interleaved attention, layers 0 and 2 with a 16-token sliding window, 1 and 3 global; the prompt is
  longer than the window (the test shows the window changes its logprobs), and one steered layer is of each kind;
* ``cohere`` (Command R): its layers return the whole stream in ``hidden_states`` and a stale ``residual``;
  norm-relative steering (``HOTWIRE_NORM=1``) scales by the stream's norm, as transformers' hook does;
* Mistral with a 16-token window on every layer (vLLM 0.25.1's CPU attention fails on it, with or without hotwire:
  skipped on that message only);
* ``granitemoehybrid`` (Granite 4: Mamba2 layers 0 and 2, attention 1 and 3): hotwire hooks the attention layers
  (the Mamba ones lack ``positions``); skipped where vLLM cannot load the model (see ``_why_granite_cannot_load``);
* ``gpt_oss`` (its ``TransformerBlock`` takes ``(hidden_states, positions, residual)``): experts (4, 2 per token),
  layers 0 and 2 with a 16-token sliding window, attention sinks; bf16 on the CPU too (``CPU_BF16_ARCHS``), so held
  to the GPU's bound;
* ``qwen3_next`` (gated delta net + attention): its ``Qwen3NextDecoderLayer.forward(hidden_states, residual,
  positions)`` lacks the contract, so the engine says so and refuses steered requests.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import hf_reference
from engine_results import engine_kwargs, run_batches
from hotwire_core.tiny_model import CPU_BF16_ARCHS

pytestmark = pytest.mark.integration

# engine -> (tiny model shape overrides, the layers hotwire hooks, the layers the check steers, norm-relative)
FAMILIES = {
    "qwen3_moe": ({"arch": "qwen3_moe"}, "0-3", [1, 2], False),
    "gemma3": ({"arch": "gemma3"}, "0-3", [1, 2], False),
    "cohere": ({"arch": "cohere"}, "0-3", [1, 2], True),
    "granitemoehybrid": ({"arch": "granitemoehybrid"}, "1,3", [1, 3], False),
    "gpt_oss": ({"arch": "gpt_oss"}, "0-3", [1, 2], False),
}
PROMPT = " ".join(["steering vectors nudge the residual stream"] * 4)  # 36 tokens: past the 16-token windows


def _why_granite_cannot_load(model_dir) -> str | None:
    """Why vLLM cannot build this Granite 4 model here, or None: vLLM 0.25.1 picks each layer's class from
    ``config.layer_types`` by the names "mamba" / "attention", which transformers 5 renames on loading any config
    (to "linear_attention" / "full_attention"), so the model fails to load on any device."""
    from transformers import AutoConfig
    from vllm.model_executor.models.granitemoehybrid import ALL_DECODER_LAYER_TYPES

    kinds = set(AutoConfig.from_pretrained(str(model_dir)).layer_types)
    if kinds <= set(ALL_DECODER_LAYER_TYPES):
        return None
    return (f"vLLM's granitemoehybrid knows layer types {sorted(ALL_DECODER_LAYER_TYPES)}, transformers gives "
            f"{sorted(kinds)}: the model cannot load")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_engine(request, model_root):
    from vllm import LLM

    from hotwire_core.offline import register_vector
    from hotwire_core.tiny_model import ModelShape, build_model

    shape = ModelShape(**FAMILIES[request.param][0])
    model_dir = build_model(model_root / f"{request.param}-tiny", shape)
    if request.param == "granitemoehybrid" and (why := _why_granite_cannot_load(model_dir)):
        pytest.skip(why)
    norm = FAMILIES[request.param][3]
    saved = os.environ.get("HOTWIRE_NORM")  # read by the engine process at start; later engines must not inherit it
    os.environ["HOTWIRE_NORM"] = "1" if norm else "0"
    try:
        on_cpu = {} if torch.cuda.is_available() else {"enforce_eager": True}
        if on_cpu and request.param in CPU_BF16_ARCHS:
            on_cpu["dtype"] = "bfloat16"  # (bf16 on the GPU in any case: engine_kwargs)
        llm = LLM(str(model_dir), **{**engine_kwargs(), **on_cpu})
    finally:
        os.environ.pop("HOTWIRE_NORM") if saved is None else os.environ.update(HOTWIRE_NORM=saved)
    vector = torch.randn(256, generator=torch.Generator().manual_seed(11))
    register_vector(llm, "v", vector)
    yield model_dir, llm, vector, request.param
    llm.llm_engine.engine_core.shutdown()


def test_the_decoder_layers_are_hooked(family_engine):
    from hotwire_core.offline import slot_stats

    _, llm, _, family = family_engine
    model = slot_stats(llm)["model"]
    assert (model["steerable"], model["layers"], model["n_layers"]) == (True, FAMILIES[family][1], 4), model


def test_steering_equals_transformers_hook(family_engine):
    model_dir, llm, vector, family = family_engine
    _check_steering(model_dir, llm, vector, FAMILIES[family][2], norm=FAMILIES[family][3])


def test_mistral_with_a_sliding_window(model_root, capfd):
    """Its own engine, started inside the test so that ``capfd`` holds the engine's log."""
    from vllm import LLM

    from hotwire_core.offline import register_vector
    from hotwire_core.tiny_model import ModelShape, build_model

    model_dir = build_model(model_root / "mistral-window-tiny", ModelShape(arch="mistral", sliding_window=16))
    llm = LLM(str(model_dir), **engine_kwargs(), **({} if torch.cuda.is_available() else {"enforce_eager": True}))
    try:
        vector = torch.randn(256, generator=torch.Generator().manual_seed(11))
        register_vector(llm, "v", vector)
        try:
            _check_steering(model_dir, llm, vector, [1, 2])
        except Exception:
            log = "".join(capfd.readouterr())
            if "cpu_attn.cpp" in log and "BlockSizeAlignment" in log:
                pytest.skip("vLLM 0.25.1's CPU attention fails on a model whose every layer has a sliding window "
                            "(cpu_attn.cpp: block_size % BlockSizeAlignment), plugin-free too")
            raise
    finally:
        llm.llm_engine.engine_core.shutdown()


def _check_steering(model_dir, llm, vector: torch.Tensor, layers: list[int], norm: bool = False) -> None:
    """Plain and steered prompt logprobs equal transformers' without and with the hook (``norm``: a norm-relative
    scale of 2, else an absolute one of 3), to the bound of the engine's dtype; where the model has a sliding window,
    the prompt reaches past it."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir))(PROMPT).input_ids
    params = dict(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scale = 2.0 if norm else 3.0
    steer = {"hotwire": json.dumps({"id": "v", "layer": layers, "scale": scale, "norm": norm})}
    plain, steered = run_batches(llm, [[{"prompt_token_ids": ids, "params": params}],
                                       [{"prompt_token_ids": ids, "params": {**params, "extra_args": steer}}]])
    hf = hf_reference.load(model_dir)
    expected_plain = hf_reference.prompt_logprobs(hf, ids)
    expected = hf_reference.prompt_logprobs(hf, ids, [(layer, vector, scale, norm) for layer in layers])
    plain_err = (torch.tensor(plain[0]["prompt_logprobs"][1:]) - expected_plain).abs().max().item()
    steered_err = (torch.tensor(steered[0]["prompt_logprobs"][1:]) - expected).abs().max().item()
    effect = (expected - expected_plain).abs().max().item()
    print(f"{model_dir.name}: plain {plain_err:.2e}, steered {steered_err:.2e} from transformers; effect {effect:.2f}")
    bf16 = llm.llm_engine.model_config.dtype == torch.bfloat16
    hf_reference.assert_steering_matches(plain_err, steered_err, effect, bf16)
    if getattr(hf.config, "sliding_window", None):
        hf.config.sliding_window = len(ids)  # every layer sees the whole prompt: the logprobs must move
        for layer in hf.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = len(ids)
        unwindowed = hf_reference.prompt_logprobs(hf, ids)
        assert (unwindowed - expected_plain).abs().max() > 0.02, "the prompt does not reach past the window"


def test_qwen3_next_says_why_it_cannot_be_steered_and_refuses_steering(model_root):
    """No plain request here: on the CPU vLLM 0.25.1's gated delta net needs bf16, and in bf16 its
    ``chunk_gated_delta_rule_cpu`` fails on the first prompt ("Input tensor dtype mismatch"), plugin-free too. A
    steered request is refused at admission, before the model runs."""
    from vllm import LLM, SamplingParams

    from hotwire_core.offline import register_vector, slot_stats
    from hotwire_core.tiny_model import ModelShape, build_model

    model_dir = build_model(model_root / "qwen3_next-tiny", ModelShape(arch="qwen3_next"))
    llm = LLM(str(model_dir), **{**engine_kwargs(), "dtype": "bfloat16", "enforce_eager": True})
    try:
        model = slot_stats(llm)["model"]
        assert model["steerable"] is False, model
        assert "Qwen3NextDecoderLayer.forward(hidden_states, residual, positions" in model["reason"], model
        register_vector(llm, "v", torch.randn(256))
        steer = {"hotwire": json.dumps({"id": "v", "layer": 1, "scale": 1.0})}
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=2, extra_args=steer),
                           use_tqdm=False)[0]
        assert (out.outputs[0].finish_reason, list(out.outputs[0].token_ids)) == ("error", [])
        assert slot_stats(llm)["refused"] == {"model_not_steerable": 1}
    finally:
        llm.llm_engine.engine_core.shutdown()
