"""A tiny Idefics3 vision-language model folder, built offline (no hub): ``config.json`` (a Llama text decoder and a
SigLIP-style vision tower), the byte-level BPE of :mod:`hotwire_core.tiny_model` with Idefics3's image markers as
special tokens, the processor's files (so vLLM's multimodal processor runs) and real random weights
(transformers ``from_config``, 0.02 init) in safetensors.

Why Idefics3 and not Qwen2-VL / Qwen2.5-VL: on vLLM 0.25.1's CPU install (no torchvision: PyPI's is a CUDA build
that breaks transformers, ``shared/docs/cpu-vllm.md``) vLLM's ``qwen2_vl.py`` fails to import (it imports
transformers' ``image_processing_qwen2_vl``, which imports torchvision), so neither model starts, plugin-free
too; LLaVA fails the same way (through ``pixtral.py``). Idefics3's module and its processor (transformers falls back
to the PIL image processor) need no torchvision.

The text decoder is the steered part: 128 wide, 4 layers, heads of 64 (vLLM's CPU attention has no kernel for
heads of 16). The vision tower is 2 layers, 32 wide: an image is resized to 224 pixels on its longest side and
split into 112 x 112 tiles (2 x 2 for a square image) plus the whole image at 112 x 112; each of these is 64
patches of 14 pixels, pixel-shuffled 2 x 2 into 16 prompt tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from .tiny_model import CHAT_TEMPLATE, _write_tokenizer

__all__ = ["IMAGE_SIDE", "IMAGE_TOKEN", "build_vlm"]

IMAGE_TOKEN = "<image>"  # where the processor puts the image's tokens: one in the prompt text per image
# The names Idefics3Processor looks for; <end_of_utterance> ends its chat turns.
_IMAGE_MARKERS = ("<fake_token_around_image>", IMAGE_TOKEN, "<global-img>", "<end_of_utterance>",
                  *(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)))
IMAGE_SIDE = 112  # the vision tower's input: a tile, and the whole image resized
_PATCH, _SHUFFLE = 14, 2
_TEXT = dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, vocab_size=512, max_position_embeddings=4096)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               image_size=IMAGE_SIDE, patch_size=_PATCH)


def build_vlm(path: str | Path, seed: int = 0) -> Path:
    """Write the model folder at ``path`` and return it. Idempotent: an existing complete folder is kept."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    path = Path(path)
    marker = path / ".hotwire-model.json"
    recipe = {"arch": "idefics3", "text": _TEXT, "vision": _VISION, "scale_factor": _SHUFFLE, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path, _TEXT["vocab_size"], _IMAGE_MARKERS)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    config = transformers.Idefics3Config(
        text_config={**_TEXT, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "initializer_range": 0.02},
        vision_config={**_VISION, "initializer_range": 0.02},
        scale_factor=_SHUFFLE,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=0,
    )
    config.architectures = ["Idefics3ForConditionalGeneration"]
    config.dtype = "float32"
    torch.manual_seed(seed)
    transformers.Idefics3ForConditionalGeneration(config).save_pretrained(str(path), safe_serialization=True)
    # Splitting on: with it off (or an image no larger than a tile) transformers counts 0 patches, and vLLM's
    # Idefics3 processor (``get_num_patches``) then drops the image's pixels.
    processor = transformers.Idefics3Processor(
        image_processor=transformers.Idefics3ImageProcessor(size={"longest_edge": 2 * IMAGE_SIDE},
                                                            max_image_size={"longest_edge": IMAGE_SIDE},
                                                            do_image_splitting=True),
        tokenizer=tokenizer,
        image_seq_len=(IMAGE_SIDE // _PATCH) ** 2 // _SHUFFLE**2,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(path))
    marker.write_text(json.dumps(recipe))
    return path
