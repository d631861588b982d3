"""Build model folders offline (no hub): ``config.json``, a byte-level BPE tokenizer with a chat template, and
optionally real random weights (transformers ``from_config``, 0.02 init) for correctness checks.

Used by the tests, the demo, ``hotwire_core.verify`` and the benchmarks. ``weights=False`` writes only the
config, for ``load_format="dummy"`` timing runs of full-size shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Steering vectors nudge the residual stream of a language model.",
    "vLLM serves many requests at once with continuous batching and CUDA graphs.",
    "Hello, how are you today? I am fine, thank you. What a lovely day it is!",
    "Once upon a time there was a tiny model that learned to speak in bytes.",
    "0123456789 + - * / = ( ) [ ] { } < > | : ; , . ! ? ' \" @ # $ % ^ & _ ~",
]


@dataclass(frozen=True)
class ModelShape:
    """The architecture knobs that matter for steering and timing."""

    arch: str = "qwen3"  # one of ARCHS
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 512
    num_experts: int = 4  # mixture-of-experts archs (qwen3_moe, qwen3_next, granitemoehybrid)
    experts_per_token: int = 2  # routed per token
    sliding_window: int | None = None  # tokens a local layer attends to: gemma3's even layers (16 if None), mistral's all


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(),
    "qwen3-4b": ModelShape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936),
    "qwen3-8b": ModelShape("qwen3", 4096, 36, 32, 8, 128, 12288, 151936),
    # Qwen3-30B-A3B's layer (experts 768 wide, 8 of them routed per token) with half its 48 layers and 128 experts:
    # its decode step per layer, at a size two engines share one GPU with (7.5 B parameters, 15 GB in bf16).
    "qwen3-moe-a3b-half": ModelShape("qwen3_moe", 2048, 24, 32, 4, 128, 3072, 151936, num_experts=64,
                                     experts_per_token=8),
}

_CONFIG_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "cohere": ("CohereConfig", "CohereForCausalLM"),  # its layers return the whole stream in hidden_states
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),  # gated delta net (linear attention) + attention
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),  # Mamba2 + attention (Granite 4)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),  # experts, sliding-window and global layers, attention sinks
}
ARCHS = tuple(_CONFIG_CLASSES)
# Hybrids hotwire does not steer under vLLM 0.25.1: Qwen3-Next's layers lack the contract (refused), Granite 4
# does not load with transformers 5 (tests/integration/test_model_families.py).
UNSTEERED_ARCHS = ("qwen3_next", "granitemoehybrid")
# What vLLM 0.25.1's CPU build runs in bf16 only (gpt-oss in float32: "expected scalar type BFloat16 but found
# Float", plugin-free too).
CPU_BF16_ARCHS = ("gpt_oss",)


def _arch_kwargs(shape: ModelShape) -> dict:
    """Config fields beyond the dense decoder's: experts, layer kinds, windows (the odd layers global, or
    attention, in the interleaved archs)."""
    moe = dict(num_experts=shape.num_experts, num_experts_per_tok=shape.experts_per_token)
    local_experts = dict(num_local_experts=shape.num_experts, num_experts_per_tok=shape.experts_per_token)
    alternating = [i % 2 == 1 for i in range(shape.num_layers)]
    windowed = {"layer_types": ["full_attention" if odd else "sliding_attention" for odd in alternating],
                "sliding_window": shape.sliding_window or 16}
    if shape.arch == "qwen3_moe":
        return {**moe, "moe_intermediate_size": shape.intermediate_size // 4, "norm_topk_prob": True}
    if shape.arch == "gemma3":
        return {**windowed, "query_pre_attn_scalar": shape.head_dim}
    if shape.arch == "qwen3_next":
        kinds = ["full_attention" if odd else "linear_attention" for odd in alternating]
        return {**moe, "layer_types": kinds, "moe_intermediate_size": shape.intermediate_size // 4,
                "shared_expert_intermediate_size": shape.intermediate_size // 4, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32}
    if shape.arch == "granitemoehybrid":
        kinds = ["attention" if odd else "mamba" for odd in alternating]
        return {**local_experts, "layer_types": kinds, "shared_intermediate_size": shape.intermediate_size // 4,
                "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_d_state": 16, "mamba_chunk_size": 64}
    if shape.arch == "gpt_oss":
        return {**local_experts, **windowed}
    if shape.arch == "cohere":
        return {"logit_scale": 1.0}  # Command R's 0.0625 would leave random weights' logits nearly flat
    if shape.arch == "mistral":  # None as Mistral 7B v0.2+: on the CPU, vLLM 0.25.1's attention fails with a window
        return {"sliding_window": shape.sliding_window}
    return {}


def _write_tokenizer(path: Path, vocab_size: int, extra_specials: tuple[str, ...] = ()) -> None:
    """A byte-level BPE trained on a small corpus, the chat markers and ``extra_specials`` its first ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", *extra_specials]
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 512),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def model_config(shape: ModelShape, dtype: str = "float32"):
    """The transformers config of ``shape`` (``architectures`` and ``dtype`` set, as vLLM reads them)."""
    import transformers

    config_cls, model_cls = _CONFIG_CLASSES[shape.arch]
    kwargs = dict(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        max_position_embeddings=32768,  # room for the tests' long streams (tests/server_fixture.py)
        tie_word_embeddings=shape.arch.startswith(("gemma", "cohere")),  # vLLM requires tied embeddings for these
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    kwargs.update(_arch_kwargs(shape))
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [model_cls]
    config.dtype = dtype  # what vLLM reads (transformers deprecates the torch_dtype spelling)
    return config, model_cls


def build_model(
    path: str | Path,
    shape: ModelShape | str = "tiny",
    *,
    weights: bool = True,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """Write a loadable model folder at ``path`` and return it. Idempotent: an existing complete folder is kept."""
    import transformers

    shape = SHAPES[shape] if isinstance(shape, str) else shape
    path = Path(path)
    marker = path / ".hotwire-model.json"
    recipe = {"shape": shape.__dict__, "weights": weights, "dtype": dtype, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)

    config, model_cls = model_config(shape, dtype)
    if weights:
        import torch

        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config).to(getattr(torch, dtype))
        model.save_pretrained(str(path), safe_serialization=True)
    else:
        config.save_pretrained(str(path))
    _write_tokenizer(path, shape.vocab_size)
    marker.write_text(json.dumps(recipe))
    return path
