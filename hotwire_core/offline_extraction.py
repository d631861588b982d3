"""Offline vector extraction on a ``vllm.LLM`` started with ``HOTWIRE_CAPTURE=1``: the examples run as capture
requests, their activations are taken from the workers, and the vector is computed (``hotwire_core.extraction``) and
registered like any other (``hotwire_core.offline.register_vector``).

    from hotwire_core.offline_extraction import extract_vector

    result = extract_vector(llm, "joy", ["I love it"], ["I hate it"], layers="8-20", method="mean_diff")

A module of its own, above the glue: the capture requests' ``SamplingParams`` are vLLM's (``vllm_glue``), which
``hotwire_core.offline`` does not import.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from .error_codes import ErrorCode
from .capture_admission import POSITIONS, capture_args
from .contract import TAKE_CAPTURES
from .extraction import ExtractionError, check_sets, example_token_ids, extract, layer_list, means_from_captures
from .offline import HotwireError, _call, register_vector
from .settings import parse_layers
from .vllm_glue.capture_requests import capture_params

__all__ = ["capture_activations", "capture_tags", "extract_vector", "take_activations"]



def capture_tags(n: int) -> list[str]:
    """Fresh tags for ``n`` capture requests (``capture_admission.capture_args``)."""
    return [uuid.uuid4().hex for _ in range(n)]


def take_activations(llm: Any, tags: Sequence[str], layers: Sequence[int]) -> np.ndarray:
    """``[len(tags), len(layers), hidden]`` float64 activations of finished capture requests, taken from the
    workers (each capture is handed out once)."""
    answers = llm.collective_rpc(TAKE_CAPTURES, args=(list(tags),))
    hidden = _call(llm, "catalog")["model"]["hidden_size"]
    return means_from_captures(answers, tags, layers, hidden)


def capture_activations(llm: Any, examples: Sequence[Any], layers: Sequence[int], position: str = "last") -> np.ndarray:
    """The residual stream after each of ``layers`` for each example (a prompt string or chat messages), at its
    last prompt token or averaged over its prompt: ``[len(examples), len(layers), hidden]`` float64. Runs the
    examples as one-token requests, at most ``HOTWIRE_CAPTURE_ROWS`` at a time."""
    rows = _call(llm, "catalog")["model"].get("capture_rows", 0)
    if not rows:
        raise HotwireError(503, ErrorCode.CAPTURE_OFF, "activation capture is off on this engine; start it with "
                           "HOTWIRE_CAPTURE=1 to extract vectors")
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": example_token_ids(tokenizer, e)} for e in examples]
    out = []
    for start in range(0, len(prompts), rows):
        chunk = prompts[start : start + rows]
        tags = capture_tags(len(chunk))
        params = [capture_params(capture_args(tag, layers, position)) for tag in tags]
        llm.generate(chunk, params, use_tqdm=False)
        out.append(take_activations(llm, tags, layers))
    return np.concatenate(out) if out else np.zeros((0, len(layers), 0))


def extract_vector(
    llm: Any,
    vector_id: str,
    positive: Sequence[Any],
    negative: Sequence[Any],
    layers: Any = None,
    method: str = "mean_diff",
    position: str = "last",
    normalize: bool = False,
    replace: bool = False,
) -> dict:
    """Compute a steering vector from contrastive examples on this engine and register it as ``vector_id``.

    ``positive`` / ``negative``: prompt strings or chat message lists (paired by index for ``pca``); ``layers``:
    ``None`` / ``"all"`` (every hooked layer), ``"8-20"``, a range or a list; ``method``: ``mean_diff`` or ``pca``
    (:mod:`hotwire_core.extraction`); ``position``: ``last`` or ``mean``; ``normalize``: unit length per layer.
    Returns ``{"vector": <metadata>, "layers": [{"layer", "separation", "gap", "accuracy", "norm"}, ...]}``."""
    model = _call(llm, "catalog")["model"]
    if not model["steerable"]:
        raise HotwireError(503, ErrorCode.MODEL_NOT_STEERABLE, f"this model cannot be steered or captured: {model['reason']}")
    if position not in POSITIONS:
        raise HotwireError(400, ErrorCode.BAD_POSITION, f"position must be one of {', '.join(POSITIONS)}, got {position!r}",
                           "position")
    try:
        chosen = layer_list(layers, parse_layers(model["layers"]))
        check_sets(len(positive), len(negative), method)
        acts = capture_activations(llm, [*positive, *negative], chosen, position)
        vectors, report = extract(acts[: len(positive)], acts[len(positive) :], chosen, method, normalize)
    except ExtractionError as exc:
        raise HotwireError(exc.status, exc.code, exc.message, exc.field) from None
    meta = register_vector(llm, vector_id, vectors.astype(np.float32), chosen, replace)
    return {"vector": meta, "layers": report}
