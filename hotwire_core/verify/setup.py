"""The serving configuration ``python -m hotwire_core.verify`` runs under, besides the model: quantization, KV-cache
dtype, speculative decoding, pipeline parallelism, chunked-prefill budget and a LoRA adapter. Each flag is the vLLM
engine argument of the same name, given to the engine under test and the plugin-free references alike, so an
operator checks the configuration they serve before they enable steering."""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LORA_NAME", "Setup", "WithAdapter", "add_arguments", "from_args"]

LORA_NAME = "hotwire-verify-lora"


@dataclass(frozen=True)
class Setup:
    """Engine arguments beyond verify's own, and the LoRA adapter every request runs with (or None)."""

    engine: dict[str, Any] = field(default_factory=dict)
    lora_path: str | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        """What the engines get: a deep copy of :attr:`engine` (vLLM adds its own objects to a
        ``speculative_config`` dict it is given), plus LoRA enabled at the adapter's rank."""
        engine = copy.deepcopy(self.engine)
        if self.lora_path is None:
            return engine
        return {**engine, "enable_lora": True, "max_loras": 1, "max_lora_rank": _lora_rank(self.lora_path)}

    def request_lora(self) -> list | None:
        """The adapter as a plugin-free job names it per request (``plugin_free.Request``'s ``lora``)."""
        return None if self.lora_path is None else [LORA_NAME, 1, self.lora_path]

    def describe(self) -> str:
        """One line for the report's header."""
        parts = [f"{key}={json.dumps(value) if isinstance(value, dict) else value}" for key, value in self.engine.items()]
        if self.lora_path is not None:
            parts.append(f"LoRA adapter {self.lora_path} on every request")
        return ", ".join(parts) or "vLLM's defaults"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("serving configuration (vLLM engine arguments of the same names)")
    group.add_argument("--quantization", help="weight quantization, e.g. fp8 (a pre-quantized model needs none)")
    group.add_argument("--kv-cache-dtype", help="KV-cache dtype, e.g. fp8")
    group.add_argument("--speculative-config", type=_json_object, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                            '"prompt_lookup_max": 3}\'')
    group.add_argument("--pipeline-parallel-size", type=int, help="pipeline parallel ranks")
    group.add_argument("--max-num-batched-tokens", type=int,
                       help="tokens per step: a smaller budget splits long prompts into chunks")
    group.add_argument("--lora", metavar="PATH",
                       help="a LoRA adapter folder (peft format); LoRA is enabled and every request runs with it")


def from_args(args: argparse.Namespace) -> Setup:
    names = ("quantization", "kv_cache_dtype", "speculative_config", "pipeline_parallel_size", "max_num_batched_tokens")
    engine = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    lora = getattr(args, "lora", None)
    if lora is not None:
        _lora_rank(lora)  # a missing or unreadable adapter fails here, before an engine starts
    return Setup(engine, lora)


class WithAdapter:
    """An ``LLM`` whose every ``generate`` runs with one LoRA adapter; everything else is the engine's."""

    def __init__(self, llm: Any, lora: list):
        from hotwire_core.vllm_glue.offline import lora_request

        self.llm, self.adapter = llm, lora_request(*lora)

    def generate(self, prompts: Any, sampling: Any, **kwargs: Any) -> Any:
        return self.llm.generate(prompts, sampling, lora_request=self.adapter, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.llm, name)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text[:200]}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, not {text[:200]}")
    return value


def _lora_rank(path: str) -> int:
    """The rank ``r`` of a peft adapter folder (vLLM's ``max_lora_rank`` must be at least that)."""
    config = Path(path) / "adapter_config.json"
    try:
        rank = json.loads(config.read_text())["r"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"verify: --lora {path}: no readable adapter_config.json with a rank r ({exc})") from None
    return int(rank)
