"""One steered and/or read completion over ``POST /v1/completions``, for the Python clients and the CLI: the
request body (the spec and the readout checked here, before anything is sent) and the typed answer.

``steer``: a spec as ``vllm_xargs.hotwire`` takes it (a JSON string, an entry or a list of entries), or the CLI's
shorthand ``ID:LAYER:SCALE``; ``read``: probes (``{"id", "layer"[, "bias"]}``, or ``ID:LAYER[:BIAS]``) read on
``tokens``. The answer's ``receipt`` names the versions that steered it; ``readout`` holds the probes' values;
``monitors`` the server's monitors' verdicts, where they read it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx

from hotwire_api.headers import RECEIPT_HEADER
from hotwire_api.models import Completion
from hotwire_core.readout_spec import READOUT_KEY, build_readout
from hotwire_core.spec import SPEC_KEY, build_spec

__all__ = ["Steering", "completion_body", "completion_of", "parse_probe", "parse_steering"]

Steering = str | dict[str, Any] | Sequence[dict[str, Any]]


def _number(text: str, what: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{what} must be a{'n integer' if kind is int else ' number'}, got {text!r}") from None


def parse_steering(text: str) -> dict[str, Any]:
    """``ID:LAYER:SCALE`` (the CLI's ``--steer``) as a spec entry."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3:
        raise ValueError(f"--steer takes ID:LAYER:SCALE (e.g. happy:10:4.0), got {text!r}")
    return {"id": parts[0], "layer": _number(parts[1], "LAYER", int), "scale": _number(parts[2], "SCALE", float)}


def parse_probe(text: str) -> dict[str, Any]:
    """``ID:LAYER[:BIAS]`` (the CLI's ``--read``) as a probe."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(f"--read takes ID:LAYER or ID:LAYER:BIAS (e.g. refusal:14:-0.5), got {text!r}")
    probe = {"id": parts[0], "layer": _number(parts[1], "LAYER", int)}
    return probe if len(parts) == 2 else {**probe, "bias": _number(parts[2], "BIAS", float)}


def completion_body(model: str | None, prompt: str | Sequence[int], max_tokens: int, steer: Steering | None,
                    read: Sequence[dict[str, Any]] | None, tokens: str, params: dict[str, Any]) -> dict[str, Any]:
    """The JSON body of the completion (``model`` None: set by the caller); raises :class:`ValueError` for a spec or
    readout that cannot be sent."""
    xargs: dict[str, str] = {}
    try:
        if steer is not None:
            if isinstance(steer, str):
                entries = json.loads(steer)
                entries = entries if isinstance(entries, list) else [entries]
            else:
                entries = [steer] if isinstance(steer, dict) else list(steer)
            xargs[SPEC_KEY] = build_spec(*entries)
        if read:
            xargs[READOUT_KEY] = build_readout(list(read), tokens)
    except json.JSONDecodeError as err:  # (a SpecError is a ValueError that names its field already)
        raise ValueError(f"steer is not a JSON spec: {err}") from None
    if "vllm_xargs" in params:
        raise ValueError("pass steering as steer= and probes as read=, not vllm_xargs")
    body = {"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt), "max_tokens": max_tokens,
            **params}
    return {**body, "vllm_xargs": xargs} if xargs else body


def completion_of(response: httpx.Response) -> Completion:
    """The typed answer to a successful completion (one choice)."""
    data = response.json()
    (choice,) = data["choices"]
    usage = data.get("usage") or {}
    return Completion(model=data["model"], text=choice["text"], finish_reason=choice.get("finish_reason"),
                      receipt=response.headers.get(RECEIPT_HEADER), readout=data.get(READOUT_KEY),
                      monitors=data.get("hotwire_monitors"), gate=data.get("hotwire_gate"),
                      prompt_tokens=usage.get("prompt_tokens", 0), completion_tokens=usage.get("completion_tokens", 0))
