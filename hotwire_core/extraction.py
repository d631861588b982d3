"""Steering vectors from contrastive examples: the arithmetic, shared by the offline ``extract_vector`` and the
API's ``POST /steer/vectors/extract``. Activations come from capture requests (``hotwire_core.capture``): one
``[len(layers), hidden]`` array per example, the residual stream after each layer at the example's last prompt
token or averaged over its prompt. Everything here is numpy in float64.

Methods (per layer):

* ``mean_diff``: mean of the positive activations minus mean of the negative ones (CAA).
* ``pca``: the first principal component of the paired differences ``positive[i] - negative[i]`` (centred, as
  repeng's ``pca_diff`` does with scikit-learn's PCA), unit length, its sign chosen so that in most pairs the
  positive example projects higher than its negative.

Per layer the result says how well the vector separates the two sets: ``separation``, the gap between the mean
projections of positives and negatives onto the unit direction in units of their pooled standard deviation
(Cohen's d; None when both sets have no spread), and ``accuracy``, the share of examples on their own side of the
midpoint between the two mean projections.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .error_codes import ErrorCode
from .errors import EngineError
from .settings import parse_layers

__all__ = ["METHODS", "ExtractionError", "check_sets", "example_token_ids", "extract", "layer_list", "mean_diff", "means_from_captures", "pca_diff",
           "separation"]

METHODS = ("mean_diff", "pca")


class ExtractionError(EngineError):
    """An extraction that cannot be done as asked (``status`` as the HTTP route answers it)."""


def layer_list(layers: Any, hooked: Iterable[int]) -> list[int]:
    """The layers to extract at: ``None`` or ``"all"`` (every hooked layer), ``"8-20,24"``, a ``range`` or a list of
    indices; each must be hooked (400 ``layer_out_of_range`` otherwise)."""
    hooked = sorted(hooked)
    if layers is None or layers == "all":
        chosen = hooked
    elif isinstance(layers, str):
        try:
            chosen = sorted(parse_layers(layers))
        except ValueError:
            raise ExtractionError(400, ErrorCode.BAD_LAYERS, f"layers {layers!r} is not 'all', a layer index or a range like "
                                  "8-20", "layers") from None
    else:
        chosen = []
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
                raise ExtractionError(400, ErrorCode.BAD_LAYERS, f"layers must be integers, got {layer!r}", "layers")
            chosen.append(int(layer))
        chosen = sorted(set(chosen))
    if not chosen:
        raise ExtractionError(400, ErrorCode.BAD_LAYERS, "layers names no layer", "layers")
    for layer in chosen:
        if layer not in hooked:
            raise ExtractionError(400, ErrorCode.LAYER_OUT_OF_RANGE, f"layer {layer} cannot be captured: this server hooks "
                                  f"layers {hooked[0]}-{hooked[-1]}" if hooked else "this model has no hooked layer",
                                  "layers")
    return chosen


def means_from_captures(answers: Sequence[Mapping[str, Any]], tags: Sequence[str], layers: Sequence[int],
                        hidden: int) -> np.ndarray:
    """``[len(tags), len(layers), hidden]`` float64 activations from every rank's ``hotwire_take_captures`` answer
    (pipeline ranks hold their own layers, tensor-parallel ranks the same ones: the first answer for a layer is
    taken)."""
    out = np.full((len(tags), len(layers), hidden), np.nan)
    position = {layer: i for i, layer in enumerate(layers)}
    for t, tag in enumerate(tags):
        found = [answer["captures"][tag] for answer in answers if tag in answer.get("captures", {})]
        if not found:
            raise ExtractionError(500, "capture_lost", f"no worker holds the capture of example {t} (tag {tag}); "
                                  "its request did not finish, or it was taken or expired")
        for capture in found:
            if "error" in capture:
                raise ExtractionError(500, "capture_failed", f"example {t}: {capture['error']}")
            sums = np.frombuffer(capture["data"], np.float32).reshape(len(capture["layers"]), hidden)
            for row, layer in zip(sums, capture["layers"]):
                if layer in position and np.isnan(out[t, position[layer], 0]):
                    out[t, position[layer]] = row.astype(np.float64) / capture["tokens"]
    missing = [layers[i] for i in range(len(layers)) if np.isnan(out[:, i, 0]).any()]
    if missing:
        raise ExtractionError(500, "capture_lost", f"no worker captured layers {missing}")
    return out


def mean_diff(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """``[n, hidden]`` x ``[m, hidden]`` -> ``[hidden]``."""
    return positive.mean(axis=0) - negative.mean(axis=0)


def pca_diff(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """The unit first principal component of the centred paired differences, positives projecting higher in most
    pairs (repeng's sign rule: flipped only when more pairs project lower than higher)."""
    diffs = positive - negative
    centred = diffs - diffs.mean(axis=0)
    direction = np.linalg.svd(centred, full_matrices=False)[2][0]
    gaps = (positive - negative) @ direction
    if np.mean(gaps < 0) > np.mean(gaps > 0):
        direction = -direction
    return direction


def separation(positive: np.ndarray, negative: np.ndarray, vector: np.ndarray) -> dict[str, Any]:
    """How well ``vector``'s direction separates the two sets (see the module docstring)."""
    norm = float(np.linalg.norm(vector))
    unit = vector / norm if norm > 0 else vector
    p, n = positive @ unit, negative @ unit
    spread = np.sqrt((p.var() + n.var()) / 2)
    gap = float(p.mean() - n.mean())
    mid = (p.mean() + n.mean()) / 2
    accuracy = (np.sum(p > mid) + np.sum(n < mid)) / (len(p) + len(n))
    return {"separation": gap / float(spread) if spread > 0 else None, "gap": gap, "accuracy": float(accuracy),
            "norm": norm}


def check_sets(n_positive: int, n_negative: int, method: str) -> None:
    """Refuse (400) what cannot be extracted, before any example runs."""
    if method not in METHODS:
        raise ExtractionError(400, "bad_method", f"method must be one of {', '.join(METHODS)}, got {method!r}", "method")
    if not n_positive or not n_negative:
        raise ExtractionError(400, "empty_examples", "positive and negative each need at least one example",
                              "positive" if not n_positive else "negative")
    if method == "pca" and (n_positive != n_negative or n_positive < 2):
        raise ExtractionError(400, "unpaired_examples", "pca takes paired examples (positive[i] with negative[i]), "
                              f"at least 2 pairs; got {n_positive} positive and {n_negative} negative", "negative")


def extract(positive: np.ndarray, negative: np.ndarray, layers: Sequence[int], method: str,
            normalize: bool = False) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """The vector (``[len(layers), hidden]`` float64) and, per layer, its separation of the sets. ``positive`` /
    ``negative``: ``[n, len(layers), hidden]`` activations; ``pca`` pairs them by index."""
    check_sets(len(positive), len(negative), method)
    vectors, report = np.zeros(positive.shape[1:]), []
    for i, layer in enumerate(layers):
        p, n = positive[:, i], negative[:, i]
        v = mean_diff(p, n) if method == "mean_diff" else pca_diff(p, n)
        if normalize:
            norm = np.linalg.norm(v)
            v = v / norm if norm > 0 else v
        vectors[i] = v
        report.append({"layer": int(layer), **separation(p, n, v)})
    return vectors, report


def example_token_ids(tokenizer: Any, example: Any) -> list[int]:
    """An example's prompt tokens: a string as vLLM tokenizes a prompt, or a chat (a list of ``{"role",
    "content"}`` messages) through the model's chat template, the last message continued if it is the assistant's
    (a CAA example ends in the answer it contrasts), else followed by the generation prompt."""
    if isinstance(example, str):
        return list(tokenizer.encode(example))
    if isinstance(example, list) and example and all(isinstance(m, Mapping) for m in example):
        ends_in_answer = example[-1].get("role") == "assistant"
        text = tokenizer.apply_chat_template([dict(m) for m in example], tokenize=False,
                                             add_generation_prompt=not ends_in_answer,
                                             continue_final_message=ends_in_answer)
        return list(tokenizer.encode(text, add_special_tokens=False))
    raise ExtractionError(400, "bad_example", "an example is a prompt string or a list of chat messages "
                          f"({{'role': ..., 'content': ...}}), got {type(example).__name__}")
