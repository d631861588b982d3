"""Speculative decoding with an EAGLE head (``speculative_config={"method": "eagle", "model": ...}``) under
hotwire: the cases of ``tests/speculation_cases.py``. The head is a model of its own, which hotwire does not hook
(only the served model's decoder layers); it reads the served model's hidden states, steered where the request is.

No EAGLE head for the tiny model exists, so one is built here: vLLM's ``EagleLlamaForCausalLM`` with one layer
whose weights make it propose one token whatever it reads, the token the steered requests repeat (found without
speculation first). Steered requests then accept drafts and plain ones reject them: both verification paths run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speculation_cases import *  # noqa: F403 (the fixtures and tests every form of speculation must pass)
from speculation_cases import PLAIN, STEERED, K

pytestmark = pytest.mark.integration


def build_eagle_head(path: Path, target: Path, token: int) -> Path:
    """A one-layer EAGLE head for ``target`` that always proposes ``token``: every embedding row is the target's
    lm_head row for ``token``, ``fc`` passes the embedding through, and the layer's attention and MLP weights are
    zero, so the head's output (layer output + residual) is that row whatever the input, and the target's lm_head
    (which the head shares) ranks ``token`` first."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim, vocab = (config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                             "vocab_size"))  # fmt: skip
    row = load_file(str(target / "model.safetensors"))["lm_head.weight"][token]
    zeros = torch.zeros
    weights = {
        "embed_tokens.weight": (10 * row).repeat(vocab, 1),
        "fc.weight": torch.cat([torch.eye(hidden), zeros(hidden, hidden)], dim=1),
        "layers.0.self_attn.q_proj.weight": zeros(heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": zeros(kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": zeros(kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": zeros(hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": zeros(inter, hidden),
        "layers.0.mlp.up_proj.weight": zeros(inter, hidden),
        "layers.0.mlp.down_proj.weight": zeros(hidden, inter),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    head = {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
            "max_position_embeddings": config["max_position_embeddings"], "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 0}  # fmt: skip
    (path / "config.json").write_text(json.dumps(head))
    return path


@pytest.fixture(scope="module")
def speculative_config(tiny_model, unspeculated, tmp_path_factory) -> dict:
    steered = unspeculated[STEERED][0]["token_ids"]
    assert len(set(steered[1:])) == 1, f"the steered continuation is not one repeated token: {steered}"
    head = build_eagle_head(tmp_path_factory.mktemp("eagle-head"), tiny_model, steered[-1])
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": K}


def test_steered_requests_accept_the_heads_drafts_and_plain_ones_reject_them(engine):
    """The head proposes the steered continuation: a steered request accepts every draft (all 1 + k verification
    tokens steered and kept each step), a plain one none (only the first kept each step). The cases above show
    both give the tokens they give without speculation."""
    (plain_drafted, plain_accepted), (drafted, accepted) = engine["drafts"][PLAIN], engine["drafts"][STEERED]
    assert plain_drafted > 0 and plain_accepted == 0, engine["drafts"]
    assert drafted > 0 and accepted == drafted, engine["drafts"]
