"""Offline Python API: register vectors on an ``vllm.LLM`` and build steering specs.

    from vllm import LLM, SamplingParams
    from hotwire_core.offline import register_vector, steer

    llm = LLM(model_dir)
    register_vector(llm, "happy", torch.randn(llm_hidden_size))
    params = SamplingParams(max_tokens=32, extra_args=steer({"id": "happy", "layer": 10, "scale": 4.0}))
    llm.generate(["Hello"], params)
"""

from __future__ import annotations

from typing import Any

import torch

from .spec import SPEC_KEY, build_spec
from .store import tensor_to_stored


class HotwireError(RuntimeError):
    """An engine-side refusal: ``status`` mirrors the HTTP status the control plane would return."""

    def __init__(self, result: dict):
        super().__init__(result.get("error", "hotwire call failed"))
        self.status: int = result.get("status", 500)
        self.code: str = result.get("code", "error")
        self.field: str | None = result.get("field")


def _call(llm: Any, method: str, *args: Any) -> dict:
    result = llm.collective_rpc(f"hotwire_{method}", args=args)[0]
    if not result.get("ok"):
        raise HotwireError(result)
    return result


def register_vector(
    llm: Any, vector_id: str, tensor: torch.Tensor, layers: list[int] | None = None, replace: bool = False
) -> dict:
    """Register ``tensor`` (``[hidden]``, ``[n_layers, hidden]`` or ``[len(layers), hidden]``); returns its metadata."""
    stored = tensor_to_stored(vector_id, tensor)
    return _call(llm, "register", vector_id, stored.data, stored.dtype, stored.shape, layers, replace)["vector"]


def unregister_vector(llm: Any, vector_id: str) -> int:
    """Delete a vector for new requests; returns how many in-flight requests still use it."""
    return _call(llm, "unregister", vector_id)["in_flight"]


def list_vectors(llm: Any) -> list[dict]:
    return _call(llm, "list")["vectors"]


def slot_stats(llm: Any) -> dict:
    return _call(llm, "stats")


def steer(*entries: dict[str, Any]) -> dict[str, str]:
    """``extra_args`` for ``SamplingParams``: ``SamplingParams(extra_args=steer({"id": ..., "layer": ..., "scale": ...}))``."""
    return {SPEC_KEY: build_spec(*entries)}
