"""A 4-bit GPTQ checkpoint of a tiny model, written offline with random values in the real format, and its
dequantized twin (the same weights in float32, no quantization) for transformers to compute the reference.

GPTQ (AutoGPTQ's ``checkpoint_format: gptq``, symmetric, 4 bits): every decoder-layer projection ``W`` (out x in)
is stored as ``qweight`` (int32, in/8 x out: eight 4-bit values per word along the input dimension, the first in
the lowest bits), ``scales`` (float16, in/group x out), ``qzeros`` (int32, in/group x out/8: the zero point minus
one, packed along the output dimension; symmetric GPTQ has zero point 8) and ``g_idx`` (the group of each input
row). The weight is ``W[o, i] = scales[i // group, o] * (q[i, o] - 8)``. Embeddings, norms and the head stay as
they are.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

__all__ = ["BITS", "GROUP_SIZE", "build_gptq_model", "pack_rows"]

BITS = 4
GROUP_SIZE = 128
_PER_WORD = 32 // BITS
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_rows(q):
    """``q`` (int, rows x cols, values 0-15) packed along the rows: eight rows per int32 word, row ``8r + k`` in
    bits ``4k..4k+3`` of word ``r``."""
    import torch

    rows, cols = q.shape
    grouped = q.to(torch.int64).reshape(rows // _PER_WORD, _PER_WORD, cols)
    shifts = (torch.arange(_PER_WORD, dtype=torch.int64) * BITS)[None, :, None]
    words = (grouped << shifts).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def build_gptq_model(base: Path, out: Path, seed: int = 0) -> tuple[Path, Path]:
    """From the float model folder ``base`` (``tiny_model.build_model``) write ``out/gptq`` (the 4-bit checkpoint,
    float16) and ``out/dequantized`` (the weights it decodes to, float32). Idempotent. Returns both folders."""
    import torch
    from safetensors.torch import load_file, save_file

    quantized, plain = out / "gptq", out / "dequantized"
    marker = out / ".hotwire-gptq.json"
    recipe = {"base": str(base), "seed": seed, "bits": BITS, "group_size": GROUP_SIZE}
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return quantized, plain
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(base / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, weight in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in _PROJECTIONS):
            packed[name] = weight.to(torch.float16)
            dequantized[name] = weight.to(torch.float32)
            continue
        out_features, in_features = weight.shape
        if in_features % GROUP_SIZE or out_features % _PER_WORD:
            raise ValueError(f"{name} is {out_features} x {in_features}: GPTQ packing here needs inputs in groups of "
                             f"{GROUP_SIZE} and outputs in words of {_PER_WORD}; choose a model shape that has them")
        groups = in_features // GROUP_SIZE
        q = torch.randint(0, 2**BITS, (in_features, out_features), generator=generator)
        # q - 8 has a standard deviation of about 4.6: scales near 0.02 / 4.6 keep the 0.02 init of the float model
        scales = (0.0043 * (0.5 + torch.rand(groups, out_features, generator=generator))).to(torch.float16)
        packed[f"{module}.qweight"] = pack_rows(q)
        packed[f"{module}.scales"] = scales
        packed[f"{module}.qzeros"] = pack_rows(torch.full((out_features, groups), 7)).T.contiguous()
        packed[f"{module}.g_idx"] = torch.arange(in_features, dtype=torch.int32) // GROUP_SIZE
        rows = scales.to(torch.float32).repeat_interleave(GROUP_SIZE, dim=0)  # in x out
        dequantized[name] = (rows * (q.to(torch.float32) - 8)).T.contiguous()
    for folder, weights in ((quantized, packed), (plain, dequantized)):
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(base, folder, ignore=shutil.ignore_patterns("model.safetensors", ".hotwire-model.json"))
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "float16"
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": BITS, "group_size": GROUP_SIZE, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
    }  # fmt: skip
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    marker.write_text(json.dumps(recipe))
    return quantized, plain
