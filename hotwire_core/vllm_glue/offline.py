"""vLLM's public offline API as hotwire's self-test (``hotwire_core.verify``) and the plugin-free runner use it: the
``LLM`` engine, ``SamplingParams``, ``LoRARequest``, what a ``RequestOutput`` holds, and the facts about a started
engine the report names. A vLLM release that moves any of them is a change here alone. Imports vLLM only when
called (``verify``'s CLI sets vLLM's environment first)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import compat

__all__ = ["EngineFacts", "engine_facts", "lora_request", "sampling_params", "shutdown", "start_llm", "summarize"]


def start_llm(**kwargs: Any) -> Any:
    """``vllm.LLM(**kwargs)``: an offline engine."""
    from vllm import LLM

    return LLM(**kwargs)


def sampling_params(**kwargs: Any) -> Any:
    """``vllm.SamplingParams(**kwargs)``."""
    from vllm import SamplingParams

    return SamplingParams(**kwargs)


def lora_request(*args: Any) -> Any:
    """``LoRARequest(name, id, path)``: a LoRA adapter for ``LLM.generate``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(*args)


def summarize(output: Any) -> dict[str, Any]:
    """Token ids, the sampled tokens' logprobs, prompt logprobs, finish reason and cache hits of one
    ``RequestOutput`` (its first completion), and the prompt's token ids (a multimodal processor's expansion of an
    image included)."""
    completion = output.outputs[0]
    prompt_lp = [None if d is None else d[t].logprob for d, t in zip(output.prompt_logprobs or [], output.prompt_token_ids)]
    return {
        "prompt_token_ids": list(output.prompt_token_ids),
        "token_ids": list(completion.token_ids),
        "logprobs": [d[t].logprob for d, t in zip(completion.logprobs or [], completion.token_ids)],
        "prompt_logprobs": prompt_lp,
        "finish_reason": completion.finish_reason,
        "num_cached_tokens": output.num_cached_tokens or 0,
    }


@dataclass(frozen=True)
class EngineFacts:
    """What a started ``LLM`` runs: the model's shape, its parallelism, the KV block size and the model runner."""

    architectures: tuple[str, ...]
    hidden_size: int
    n_layers: int  # decoder layers of the whole model (every pipeline stage)
    dtype: str  # e.g. "float32"
    tensor_parallel_size: int
    block_size: int
    runner: str  # "v1" or "v2"


def engine_facts(llm: Any) -> EngineFacts:
    engine = llm.llm_engine
    config, vllm_config = engine.model_config, engine.vllm_config
    return EngineFacts(
        architectures=tuple(config.architectures or ()),
        hidden_size=config.get_hidden_size(),
        n_layers=config.get_total_num_hidden_layers(),  # get_num_layers counts one pipeline stage's
        dtype=str(config.dtype).removeprefix("torch."),
        tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
        block_size=vllm_config.cache_config.block_size,
        runner="v2" if compat.uses_v2_model_runner(vllm_config) else "v1",
    )


def shutdown(llm: Any) -> None:
    """Stop ``llm``'s engine core (and its workers) now, rather than when the object is collected."""
    llm.llm_engine.engine_core.shutdown()
