"""Admitting capture requests in the engine core: what a capture asks for, how many run at once, and their cache
salt. A capture request carries ``CAPTURE_KEY`` (``{"tag", "layers", "position"}``) instead of a steering spec;
the workers capture its residual stream (``hotwire_core.capture``) and keep it under its tag until taken.

Each capture request gets a cache salt of its own: a ``mean`` capture must compute every prompt token (a prefix
cache hit would skip some), and the KV it leaves behind is then never read by another request.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from .error_codes import ErrorCode
from .admission import Refusal, Rules
from .contract import CAPTURE_KEY
from .engine_requests import EngineRequests
from .readout_spec import READOUT_KEY
from .spec import SALT_PREFIX, SPEC_KEY, VECTOR_ID_RE

__all__ = ["POSITIONS", "CaptureRequests", "capture_args", "parse_capture"]

POSITIONS = ("last", "mean")


def capture_args(tag: str, layers: Iterable[int], position: str) -> dict[str, Any]:
    """``extra_args`` of a capture request."""
    return {CAPTURE_KEY: {"tag": tag, "layers": [int(layer) for layer in layers], "position": position}}


def parse_capture(value: Any, rules: Rules) -> dict[str, Any]:
    """The checked capture of a request (``CAPTURE_KEY``'s value), or :class:`Refusal` (400) saying what is wrong."""
    if not isinstance(value, dict) or set(value) != {"tag", "layers", "position"}:
        raise Refusal(400, ErrorCode.BAD_CAPTURE, f"{CAPTURE_KEY} must be an object with exactly tag, layers and position",
                      CAPTURE_KEY)
    tag, layers, position = value["tag"], value["layers"], value["position"]
    if not isinstance(tag, str) or not VECTOR_ID_RE.fullmatch(tag):
        raise Refusal(400, ErrorCode.BAD_CAPTURE, f"{CAPTURE_KEY}.tag must be 1-64 letters, digits, '.', '_' or '-'",
                      f"{CAPTURE_KEY}.tag")
    if position not in POSITIONS:
        raise Refusal(400, ErrorCode.BAD_CAPTURE, f"{CAPTURE_KEY}.position must be one of {', '.join(POSITIONS)}, got "
                      f"{position!r}", f"{CAPTURE_KEY}.position")
    if (not isinstance(layers, list) or not layers
            or not all(isinstance(l, int) and not isinstance(l, bool) for l in layers)):
        raise Refusal(400, ErrorCode.BAD_CAPTURE, f"{CAPTURE_KEY}.layers must be a non-empty list of layer indices",
                      f"{CAPTURE_KEY}.layers")
    for layer in layers:
        if layer not in rules.model.layers:
            raise Refusal(400, ErrorCode.LAYER_OUT_OF_RANGE, f"layer {layer} cannot be captured: this server hooks layers "
                          f"{rules.steered_layers()}", f"{CAPTURE_KEY}.layers")
    return {"tag": tag, "layers": sorted(set(layers)), "position": position}


class CaptureRequests:
    """The capture requests admitted and not yet finished, at most ``capacity`` (the workers' accumulator rows);
    ``requests`` reads and changes the engine's requests (``vllm_glue.requests.VLLM_REQUESTS``)."""

    def __init__(self, capacity: int, requests: EngineRequests):
        self.capacity, self.requests = capacity, requests
        self.live: set[str] = set()

    def requested(self, request: Any) -> bool:
        """Whether an engine request asks for a capture."""
        extra = self.requests.extra_args(request)
        return bool(extra) and CAPTURE_KEY in extra

    def admit(self, request: Any, rules: Rules) -> None:
        """Admit a request with ``CAPTURE_KEY`` in its ``extra_args``, or raise :class:`Refusal`."""
        extra = self.requests.extra_args(request)
        if not rules.model.steerable:
            raise Refusal(503, ErrorCode.MODEL_NOT_STEERABLE, f"this model cannot be steered or captured: {rules.model.reason}")
        if not self.capacity:
            raise Refusal(503, ErrorCode.CAPTURE_OFF, "activation capture is off on this server; start it with "
                          "HOTWIRE_CAPTURE=1 to extract vectors")
        if SPEC_KEY in extra or READOUT_KEY in extra:
            raise Refusal(400, ErrorCode.CAPTURE_WITH_STEERING, "a request may capture, or steer and read, not both",
                          CAPTURE_KEY)
        checked = parse_capture(extra[CAPTURE_KEY], rules)
        if len(self.live) >= self.capacity:
            raise Refusal(429, ErrorCode.CAPTURE_BUSY, f"all {self.capacity} capture rows are in use "
                          f"(HOTWIRE_CAPTURE_ROWS={self.capacity}); retry when running extractions finish")
        self.requests.set_extra(request, CAPTURE_KEY, checked)
        self.requests.set_cache_salt(request, f"{SALT_PREFIX}capture:{uuid.uuid4().hex}")
        self.live.add(self.requests.request_id(request))

    def release(self, request_id: str) -> None:
        self.live.discard(request_id)
