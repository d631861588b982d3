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

    arch: str = "qwen3"  # llama | qwen2 | qwen3 | mistral | gemma
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 512


SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(),
    "qwen3-4b": ModelShape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936),
    "qwen3-8b": ModelShape("qwen3", 4096, 36, 32, 8, 128, 12288, 151936),
}

_CONFIG_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
}
ARCHS = tuple(_CONFIG_CLASSES)


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]
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
        tie_word_embeddings=shape.arch == "gemma",  # vLLM's Gemma requires tied embeddings
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    if shape.arch == "mistral":
        kwargs["sliding_window"] = None  # as Mistral 7B v0.2+; a window makes vLLM's CPU attention refuse the model
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [model_cls]
    config.torch_dtype = dtype
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
