"""The capture custom op ``torch.ops.hotwire.capture_`` (see docs/architecture.md, "Capture").

Right after the steering op, at the same point of every hooked decoder layer, it adds the residual stream of each
token that has a capture row (``token_cap[t] != 0``) into that row's float32 accumulator for the layer. Row 0 is
"no capture". It does nothing unless ``ops.GATE`` has CAPTURE on, so a step in which nobody captures replays graphs
without it (see ``ops.graph_variants``).

The accumulator (``[n_layers, rows + 1, hidden]`` float32) is not an argument: it is set once per worker
(:func:`set_accumulator`) before compile and graph capture, and never reallocated, the way vLLM's attention reaches
its KV cache. The schema names ``target`` as mutated (it is only read) so that tracing keeps the op, which returns nothing, in
place right after ``steer_``, which mutates the same tensor.
"""

from __future__ import annotations

import torch

from . import ops
from .ops import CAPTURE, GATE, define_op

OP_NAME = "capture_"
_SCHEMA = f"{OP_NAME}(Tensor(a!) target, Tensor? other, Tensor token_cap, int layer) -> ()"

_ACC: torch.Tensor | None = None


def set_accumulator(acc: torch.Tensor) -> None:
    """The worker's accumulator; set once, before the model is compiled or captured in a graph."""
    global _ACC
    _ACC = acc


def capture_torch(target: torch.Tensor, other: torch.Tensor | None, token_cap: torch.Tensor, acc: torch.Tensor,
                  layer: int) -> None:
    """``acc[layer, token_cap[t]] += stream[t]`` for every token; row 0 collects the tokens nobody captures."""
    stream = target.float() if other is None else target.float() + other.float()
    acc[layer].index_add_(0, token_cap[: target.shape[0]].long(), stream)


def _capture_cpu(target: torch.Tensor, other: torch.Tensor | None, token_cap: torch.Tensor, layer: int) -> None:
    """On the CPU the op runs as Python every step (no graphs): only the captured tokens cost anything."""
    if GATE.kinds & CAPTURE and _ACC is not None:
        rows = token_cap[: target.shape[0]]
        picked = rows.nonzero().squeeze(1)
        if picked.numel():
            capture_torch(target[picked], None if other is None else other[picked], rows[picked], _ACC, layer)


def _capture_cuda(target: torch.Tensor, other: torch.Tensor | None, token_cap: torch.Tensor, layer: int) -> None:
    if GATE.kinds & CAPTURE and _ACC is not None:
        from hotwire_core.triton_capture import capture_triton_

        capture_triton_(target, other, token_cap, _ACC, layer, pdl=ops.PDL)


def register_capture_op() -> None:
    """Register ``torch.ops.hotwire.capture_`` once per process."""
    define_op(OP_NAME, _SCHEMA, _capture_cpu, _capture_cuda)


register_capture_op()
