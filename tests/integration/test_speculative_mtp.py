"""Speculative decoding with multi-token prediction (``speculative_config={"method": "mtp"}``) under hotwire: the
cases of ``tests/speculation_cases.py``. The MTP module lives in the target's own checkpoint and runs as the
drafter, a model of its own that hotwire does not hook; it reads the target's hidden states, steered where the
request is.

No small model has MTP layers, so the target here is a tiny Xiaomi MiMo (``MiMoForCausalLM``: Qwen2's layers plus
``num_nextn_predict_layers`` MTP layers; vLLM's ``mimo_mtp``), built from the tiny Qwen2 with one MTP layer whose
weights make it propose one token whatever it reads: the token the steered requests repeat (found without
speculation first). Steered requests then accept drafts and plain ones reject them: both verification paths run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from speculation_cases import *  # noqa: F403 (the fixtures and tests every form of speculation must pass)
from speculation_cases import PLAIN, STEERED, K

pytestmark = pytest.mark.integration


def add_mtp_layer(path: Path, token: int) -> None:
    """Give the tiny MiMo at ``path`` one MTP layer that always proposes ``token``, in MiMo's checkpoint
    layout (``model.mtp_layers.0.*``, the decoder block's weights unwrapped). Its attention is zero; its MLP has
    gate = up = identity, so every unit gives ``x² sigmoid(x)`` (never negative), and ``down`` adds all of them
    along the lm_head row of ``token``, a hundred times the residual's size: after the final norm the row dominates
    whatever the layer read, and the lm_head (shared with the target) ranks ``token`` first."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    weights = load_file(str(path / "model.safetensors"))
    row = weights["lm_head.weight"][token]
    eye = torch.eye(inter, hidden)
    layer = {
        "token_layernorm.weight": torch.ones(hidden),
        "hidden_layernorm.weight": torch.ones(hidden),
        "input_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
        "input_layernorm.weight": torch.ones(hidden),
        "self_attn.q_proj.weight": torch.zeros(q, hidden),
        "self_attn.q_proj.bias": torch.zeros(q),
        "self_attn.k_proj.weight": torch.zeros(kv, hidden),
        "self_attn.k_proj.bias": torch.zeros(kv),
        "self_attn.v_proj.weight": torch.zeros(kv, hidden),
        "self_attn.v_proj.bias": torch.zeros(kv),
        "self_attn.o_proj.weight": torch.zeros(hidden, q),
        "post_attention_layernorm.weight": torch.ones(hidden),
        "mlp.gate_proj.weight": eye,
        "mlp.up_proj.weight": eye.clone(),
        "mlp.down_proj.weight": (100 * row / row.norm()).unsqueeze(1).repeat(1, inter),
        "final_layernorm.weight": torch.ones(hidden),
    }
    weights.update({f"model.mtp_layers.0.{name}": value.contiguous() for name, value in layer.items()})
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


def build_mimo(path: Path, model_root: Path) -> Path:
    """The tiny Qwen2 (built under ``model_root``) as MiMo at ``path``, without an MTP layer yet. model_type stays
    qwen2: transformers reads the model (without its MTP layer) as the reference."""
    from hotwire_core.tiny_model import ModelShape, build_model

    shutil.copytree(build_model(model_root / "qwen2-tiny", ModelShape(arch="qwen2")), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["MiMoForCausalLM"]}))
    return path


@pytest.fixture(scope="module")
def tiny_model(model_root, tmp_path_factory) -> Path:
    """The tiny MiMo; its MTP layer is added once the steered continuation is known."""
    return build_mimo(tmp_path_factory.mktemp("mimo") / "model", model_root)


@pytest.fixture(scope="module")
def speculative_config(tiny_model, unspeculated) -> dict:
    steered = unspeculated[STEERED][0]["token_ids"]
    assert len(set(steered[1:])) == 1, f"the steered continuation is not one repeated token: {steered}"
    add_mtp_layer(tiny_model, steered[-1])
    return {"method": "mtp", "num_speculative_tokens": K}


def test_steered_requests_accept_the_mtp_drafts_and_plain_ones_reject_them(engine):
    """The MTP layer proposes the steered continuation: a steered request accepts every draft (all 1 + k
    verification tokens steered and kept each step), a plain one none. The cases above show both give the tokens
    they give without speculation."""
    (plain_drafted, plain_accepted), (drafted, accepted) = engine["drafts"][PLAIN], engine["drafts"][STEERED]
    assert plain_drafted > 0 and plain_accepted == 0, engine["drafts"]
    assert drafted > 0 and accepted == drafted, engine["drafts"]


def test_plain_requests_stay_bit_identical_where_the_model_adds_its_last_layer_itself(model_root, tmp_path):
    """MiMo's model adds its last layer's ``hidden + residual`` itself, in the model dtype, and Inductor makes that
    add and the layer's down projection one GEMM; hotwire's op on ``hidden`` there split it, and in bf16 every plain
    token moved (7.8e-3 in a logprob, on the development CPU and on the H200). Steered in ``residual`` at that layer
    (``vllm_glue.layers.MODEL_ADD``), plain requests are bit-identical to plugin-free vLLM again. bf16 with
    torch.compile on the CPU too: float32 hides the rounding."""
    from engine_results import CPU_REPEAT_TOLERANCE, max_diff, run_in_subprocess
    from speculation_cases import GREEDY, prompt_ids

    import torch

    path = build_mimo(tmp_path / "mimo", model_root)
    prompts = prompt_ids(path)
    batches = [[{"prompt_token_ids": prompts[p], "params": GREEDY} for p in "ab"]]
    bf16 = {"dtype": "bfloat16"}
    (work := tmp_path / "vanilla").mkdir()
    vanilla = run_in_subprocess(path, batches, work, overrides=bf16)
    (work := tmp_path / "hotwire").mkdir()
    hotwire = run_in_subprocess(path, batches, work, plugins=True, overrides=bf16)
    bound = 0.0 if torch.cuda.is_available() else CPU_REPEAT_TOLERANCE
    for got, want in zip(hotwire[0], vanilla[0]):
        assert got["token_ids"] == want["token_ids"]
        assert max_diff(got["logprobs"], want["logprobs"]) <= bound
        assert max_diff(got["prompt_logprobs"], want["prompt_logprobs"]) <= bound
