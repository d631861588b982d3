"""Offline Python API: register vectors on an ``vllm.LLM``, build steering specs, and read probes.

    from vllm import LLM, SamplingParams
    from hotwire_core.offline import register_vector, steer

    llm = LLM(model_dir)
    register_vector(llm, "happy", torch.randn(llm_hidden_size))
    params = SamplingParams(max_tokens=32, extra_args=steer({"id": "happy", "layer": 10, "scale": 4.0}))
    llm.generate(["Hello"], params)
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .contract import TAKE_READOUTS, rpc_name
from .error_codes import ErrorCode
from .errors import EngineError
from .readout_results import readout_of
from .readout_spec import READOUT_KEY, build_readout
from .spec import SPEC_KEY, as_index, build_spec, parse_spec
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


def read(probes: Sequence[dict[str, Any]], tokens: str = "generated") -> dict[str, str]:
    """``extra_args`` for a readout (``hotwire_core.readout_spec``); merge it with :func:`steer`'s to steer and read."""
    return {READOUT_KEY: build_readout(list(probes), tokens)}


def generate_with_readout(llm: Any, prompts: Any, params: Any, probes: Sequence[dict[str, Any]] = (),
                          tokens: str = "generated") -> list[Any]:
    """``llm.generate(prompts, params)`` reading ``probes`` (``[{"id", "layer"[, "bias"]}]``) on ``tokens``
    (``prompt``, ``generated`` or ``all``) of every request; each ``RequestOutput`` gets the readout as
    ``hotwire_readout`` (``hotwire_core.readout_results``). ``params``: one ``SamplingParams`` (its ``extra_args``
    may steer) or one per prompt. A request whose steering is gated (``when``) also gets the gate's receipt as
    ``hotwire_gate`` (its readout then spans all tokens); ``probes`` may then be empty. Raises
    :class:`HotwireError` for a refused request or a lost readout."""
    prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    tags, tagged = [], []
    for p in params:
        if getattr(p, "n", 1) != 1:
            raise ValueError("generate_with_readout reads one completion per prompt: use n=1")
        spec = (p.extra_args or {}).get(SPEC_KEY)
        when = next((e.when for e in parse_spec(spec) if e.when is not None), None) if spec is not None else None
        asked = list(probes)
        if when is not None:  # read last, over every token, as the engine evaluates it (``gates``)
            asked.append({"id": when.vector_id, "layer": when.layer, "bias": when.bias,
                          **({"version": when.version} if when.version else {})})
        if not asked:
            raise ValueError("nothing to read: name probes, or steer with a gated entry")
        readout = json.loads(read(asked, "all" if when is not None else tokens)[READOUT_KEY])
        tag = uuid.uuid4().hex
        q = copy.copy(p)
        q.extra_args = {**(p.extra_args or {}), READOUT_KEY: json.dumps({**readout, "tag": tag})}
        tags.append(tag)
        tagged.append(q)
    outputs = llm.generate(prompts, tagged, use_tqdm=False)
    answers = llm.collective_rpc(TAKE_READOUTS, args=(tags,))
    for output, tag in zip(outputs, tags):
        if output.outputs and output.outputs[0].finish_reason == "error":
            raise HotwireError(400, ErrorCode.NOT_ADMITTED, f"request {output.request_id} was refused; the engine's log says why "
                               "(check_steering and the readout's ids and layers)")
        try:
            output.hotwire_readout = readout_of(answers, tag, len(output.outputs[0].token_ids))
            if "gate" in output.hotwire_readout:
                output.hotwire_gate = output.hotwire_readout.pop("gate")
        except EngineError as exc:
            raise HotwireError(exc.status, exc.code, exc.message, exc.field) from None
    return outputs
