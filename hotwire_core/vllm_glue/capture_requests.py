"""Capture requests (``hotwire_core.capture_admission``) as vLLM takes them: one-token ``SamplingParams`` (offline,
``hotwire_core.offline.capture_activations``), and from an API server (``hotwire_api.extraction``) through vLLM's
engine client (``AsyncLLM.generate``), scheduled like any other prefill, with the served model's tokenizer."""

from __future__ import annotations

from typing import Any

__all__ = ["capture_params", "max_model_len", "run_capture_request", "tokenizer_of"]


def capture_params(extra_args: dict[str, Any]) -> Any:
    """``SamplingParams`` of a capture request: one token (the prompt is what it is for)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, extra_args=extra_args)


def tokenizer_of(client: Any) -> Any:
    """The served model's tokenizer (``AsyncLLM.get_tokenizer``)."""
    return client.get_tokenizer()


def max_model_len(client: Any) -> int:
    """The longest sequence the engine serves (``AsyncLLM.model_config.max_model_len``)."""
    return int(client.model_config.max_model_len)


async def run_capture_request(client: Any, token_ids: list[int], extra_args: dict[str, Any], request_id: str) -> bool:
    """Run one capture request to its end; False when the engine finished it with an error (a refusal)."""
    params = capture_params(extra_args)
    last = None
    try:
        async for output in client.generate({"prompt_token_ids": token_ids}, params, request_id):
            last = output
    except ValueError:  # vLLM's own input checks, and hotwire's guard on the engine client
        raise
    except Exception:  # EngineGenerateError: the engine failed the request
        return False
    return last is not None and last.outputs[0].finish_reason != "error"
