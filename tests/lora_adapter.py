"""A LoRA adapter for a tiny model folder (``hotwire_core.tiny_model``), written offline by peft itself, so the folder
is peft's real on-disk format (``adapter_config.json`` + ``adapter_model.safetensors``) that ``vllm serve
--lora-modules`` and ``LoRARequest`` load. A and B are random and non-zero (peft's default B is zero, which would
change nothing), large enough that the adapter moves the logprobs far more than float32 rounding does."""

from __future__ import annotations

from pathlib import Path

# Attention (q and v of vLLM's packed qkv_proj, o_proj) and MLP (gate of the packed gate_up_proj, down_proj)
TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
RANK = 8


def build_lora_adapter(model_dir: Path, path: Path, *, rank: int = RANK, alpha: int = 16, std: float = 0.05,
                       seed: int = 0) -> Path:
    """Write the adapter folder at ``path`` and return it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(TARGETS), lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(str(path))
    return Path(path)


def load_merged(model_dir: Path, adapter_dir: Path):
    """The base model with the adapter merged into its weights (``merge_and_unload``), float32, for the reference."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()
