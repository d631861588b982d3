"""The offline GPTQ checkpoint (``hotwire_core.tiny_gptq``): its packing is the one vLLM's own unpacking reads,
and the dequantized twin holds exactly the weights the packed values and scales decode to."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from hotwire_core.tiny_gptq import GROUP_SIZE, build_gptq_model, pack_rows
from hotwire_core.tiny_model import build_model


def test_packing_is_what_vllm_unpacks():
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    q = torch.randint(0, 16, (64, 24), generator=torch.Generator().manual_seed(3))
    packed = pack_rows(q)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24)
    assert (packed < 0).any()  # words with the top bit set keep their bits
    assert torch.equal(unpack_quantized_values_into_int32(packed, scalar_types.uint4b8, 0), q.to(torch.int32))


def test_checkpoint_and_its_dequantized_twin(tmp_path):
    base = build_model(tmp_path / "base")
    quantized, plain = build_gptq_model(base, tmp_path / "q")
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "gptq" and config["bits"] == 4 and config["group_size"] == GROUP_SIZE
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    packed, twin, original = (load_file(str(d / "model.safetensors")) for d in (quantized, plain, base))
    name = "model.layers.1.mlp.down_proj"
    out_features, in_features = original[f"{name}.weight"].shape
    assert packed[f"{name}.qweight"].shape == (in_features // 8, out_features)
    assert packed[f"{name}.scales"].shape == (in_features // GROUP_SIZE, out_features)
    assert packed[f"{name}.qzeros"].shape == (in_features // GROUP_SIZE, out_features // 8)
    assert torch.equal(packed[f"{name}.g_idx"], torch.arange(in_features, dtype=torch.int32) // GROUP_SIZE)
    assert (packed[f"{name}.qzeros"] == 0x77777777).all()  # zero point 8, stored minus one
    # decode by hand: 4 bits at a time along the input dimension
    words = packed[f"{name}.qweight"].to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(words >> (4 * k)) & 0xF for k in range(8)], dim=1).reshape(in_features, out_features)
    scales = packed[f"{name}.scales"].float().repeat_interleave(GROUP_SIZE, dim=0)
    assert torch.equal(twin[f"{name}.weight"], (scales * (q.float() - 8)).T)
    assert 0.01 < twin[f"{name}.weight"].std() < 0.03  # the scale of the float model's 0.02 init
    assert f"{name}.weight" not in packed
    assert torch.equal(twin["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    assert packed["model.norm.weight"].dtype == torch.float16
