"""Offline Python API: register vectors on an ``vllm.LLM`` and build steering specs.

    from vllm import LLM, SamplingParams
    from hotwire_core.offline import register_vector, steer

    llm = LLM(model_dir)
    register_vector(llm, "happy", torch.randn(llm_hidden_size))
    params = SamplingParams(max_tokens=32, extra_args=steer({"id": "happy", "layer": 10, "scale": 4.0}))
    llm.generate(["Hello"], params)
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .capture_admission import POSITIONS, capture_args
from .contract import TAKE_CAPTURES, rpc_name
from .errors import EngineError
from .extraction import ExtractionError, check_sets, example_token_ids, extract, layer_list, means_from_captures
from .settings import parse_layers
from .vllm_glue.capture_requests import capture_params
from .spec import SPEC_KEY, as_index, build_spec
from .store import tensor_to_stored


class HotwireError(EngineError, RuntimeError):
    """An engine-side refusal: ``status`` mirrors the HTTP status the control plane would return."""


def _call(llm: Any, method: str, *args: Any) -> dict:
    result = llm.collective_rpc(rpc_name(method), args=args)[0]
    if not result.get("ok"):
        raise HotwireError.from_result(result)
    return result


def _layer_list(layers: Any) -> list[int] | None:
    """``layers`` as plain ints: numpy / torch integers (or an array of them) do not cross vLLM's RPC as ints."""
    if layers is None:
        return None
    if isinstance(layers, (np.ndarray, torch.Tensor)):
        layers = layers.tolist()
    if not isinstance(layers, (list, tuple, range)):  # a set or dict would lose the order rows are given in
        raise TypeError(f"layers must be a list of layer indices (one per row, in order), got {type(layers).__name__}")
    out = []
    for layer in layers:
        value = as_index(layer)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"layers must be integers, got {layer!r}")
        out.append(int(value))  # an int subclass (IntEnum) as a plain int for vLLM's RPC
    return out


def _as_vector(tensor: Any) -> torch.Tensor:
    """A torch tensor of real numbers with at least one dimension (numpy arrays are taken as they are)."""
    if not isinstance(tensor, torch.Tensor):
        if not hasattr(tensor, "__array__"):
            raise TypeError(f"the vector must be a torch tensor or numpy array, got {type(tensor).__name__}")
        array = np.asarray(tensor)
        if array.dtype.kind not in "fiu":
            raise TypeError(f"the vector must hold real numbers, got {array.dtype}")
        native = array.dtype.newbyteorder("=")
        # torch takes float16/32 as they are (any byte order or stride once copied); other kinds go via float64
        array = array.astype(native if native in (np.float16, np.float32) else np.float64, copy=False)
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    if tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"the vector must hold real numbers, got {tensor.dtype}")
    if tensor.dim() == 0:
        raise ValueError("the vector must be [hidden], [n_layers, hidden] or [len(layers), hidden], got a scalar")
    if tensor.dtype == torch.float64 and bool((tensor.abs() > torch.finfo(torch.float32).max).any()):
        raise ValueError("the vector holds values outside float32's range (it is sent as float32): scale it down")
    return tensor


def register_vector(
    llm: Any, vector_id: str, tensor: torch.Tensor, layers: Sequence[int] | None = None, replace: bool = False
) -> dict:
    """Register ``tensor`` (``[hidden]``, ``[n_layers, hidden]`` or ``[len(layers), hidden]``; a torch tensor or
    numpy array of real numbers, sent as float32 unless it is float16 / bfloat16); returns its metadata.
    ``layers`` may be a list, tuple, numpy array or tensor of integers."""
    stored = tensor_to_stored(vector_id, _as_vector(tensor))
    return _call(llm, "register", vector_id, stored.data, stored.dtype, stored.shape, _layer_list(layers), replace)["vector"]


def unregister_vector(llm: Any, vector_id: str) -> int:
    """Delete a vector for new requests; returns how many in-flight requests still use it."""
    return _call(llm, "unregister", vector_id)["in_flight"]


def list_vectors(llm: Any) -> list[dict]:
    return _call(llm, "list")["vectors"]


def slot_stats(llm: Any) -> dict:
    return _call(llm, "stats")


def check_steering(llm: Any, extra_args: dict[str, Any] | str) -> dict:
    """Would a request steered by ``extra_args`` (what :func:`steer` returns, or a spec string) be admitted now?
    Returns the receipt and the bank rows it would load; raises :class:`HotwireError` saying why not (an offline
    ``generate`` reports a refused request only as ``finish_reason="error"``, with the reason in the log)."""
    spec = extra_args.get(SPEC_KEY) if isinstance(extra_args, dict) else extra_args
    if spec is None:
        raise ValueError(f"extra_args has no {SPEC_KEY!r} key: build it with steer(...)")
    return _call(llm, "check", spec)


def steer(*entries: dict[str, Any]) -> dict[str, str]:
    """``extra_args`` for ``SamplingParams``: ``SamplingParams(extra_args=steer({"id": ..., "layer": ..., "scale": ...}))``."""
    return {SPEC_KEY: build_spec(*entries)}


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
        raise HotwireError(503, "capture_off", "activation capture is off on this engine; start it with "
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
        raise HotwireError(503, "model_not_steerable", f"this model cannot be steered or captured: {model['reason']}")
    if position not in POSITIONS:
        raise HotwireError(400, "bad_position", f"position must be one of {', '.join(POSITIONS)}, got {position!r}",
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
