"""The readout custom op ``torch.ops.hotwire.read_`` (see docs/architecture.md, "Readout").

Right after the steering op (and the capture op, where compiled in), at the same point of every hooked decoder
layer, it projects the residual stream of each token that has a readout row (``token_read[t] != 0``) onto that
row's probes for the layer (``read_slot[row, layer, k]``: bank slots; slot 0 is the bank's all-zero row) and writes
``out[layer, t, k]`` (the dot products, float32) and ``out[layer, t, K]`` (the stream's L2 norm, for cosines).
Tokens without a row, or whose row has no probe at this layer, are not written. It does nothing unless
``ops.GATE`` has READ on, so a step in which nobody reads replays graphs without it (see ``ops.graph_variants``).

The output buffer (``[n_layers, max_tokens, K + 1]`` float32) is not an argument: it is set once per worker
(:func:`set_output`) before compile and graph capture, as the capture op's accumulator is. The schema names
``target`` as mutated (it is only read) so that tracing keeps the op in place after ``steer_``.

With gates (``hotwire_core.gates``; the four gate tensors, else None) it also evaluates the condition of each read
token whose row has one at this layer (``gate_row``: layer, probe, flags, first position, prompt length;
``gate_f``: threshold, bias, the probe's inverse norm): ``token_hit[t]`` says whether it held, and a latched one
lowers the row's first position to the token's (``token_pos``) where it held.
"""

from __future__ import annotations

import torch

from . import ops
from .ops import (GATE, GATE_BELOW, GATE_COSINE, GATE_FIRST, GATE_FLAGS, GATE_LATCH, GATE_LAYER, GATE_PROBE,
                  GATE_PROMPT, GATE_PROMPT_LEN, READ, define_op)

OP_NAME = "read_"
_SCHEMA = (f"{OP_NAME}(Tensor(a!) target, Tensor? other, Tensor token_read, Tensor read_slot, Tensor bank, int layer, "
           "Tensor? token_pos=None, Tensor? token_hit=None, Tensor? gate_row=None, Tensor? gate_f=None) -> ()")

_OUT: torch.Tensor | None = None


def set_output(out: torch.Tensor) -> None:
    """The worker's output buffer; set once, before the model is compiled or captured in a graph."""
    global _OUT
    _OUT = out


def read_torch(target: torch.Tensor, other: torch.Tensor | None, rows: torch.Tensor, read_slot: torch.Tensor,
               bank: torch.Tensor, layer: int) -> torch.Tensor:
    """``[T, K + 1]``: each token's dot products with its row's probes at ``layer``, then the stream's norm."""
    stream = target.float() if other is None else target.float() + other.float()
    slots = read_slot[rows.long(), layer].long()  # [T, K]
    dots = [(stream * bank[slots[:, k]].float()).sum(-1) for k in range(slots.shape[1])]
    return torch.stack([*dots, torch.linalg.vector_norm(stream, dim=-1)], dim=1)


def gate_torch(values: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, gate_row: torch.Tensor,
               gate_f: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(evaluated, held)`` per token: whether its row's condition is at ``layer``, and whether it held, from the
    token's readout ``values`` ``[T, K + 1]``, in the Triton kernel's float32 arithmetic."""
    g, f = gate_row[rows], gate_f[rows]
    flags = g[:, GATE_FLAGS]
    dot = values.gather(1, g[:, GATE_PROBE : GATE_PROBE + 1].long().clamp_min(0)).squeeze(1)  # -1: no condition
    norm = values[:, -1]
    cosine = torch.where(norm > 0, dot * f[:, 2] / norm, torch.zeros_like(dot))
    value = torch.where((flags & GATE_COSINE) != 0, cosine, dot + f[:, 1])
    held = torch.where((flags & GATE_BELOW) != 0, value < f[:, 0], value > f[:, 0])
    held &= ((flags & GATE_PROMPT) == 0) | (positions < g[:, GATE_PROMPT_LEN])
    return g[:, GATE_LAYER] == layer, held


def _read_cpu(target: torch.Tensor, other: torch.Tensor | None, token_read: torch.Tensor, read_slot: torch.Tensor,
              bank: torch.Tensor, layer: int, token_pos: torch.Tensor | None = None,
              token_hit: torch.Tensor | None = None, gate_row: torch.Tensor | None = None,
              gate_f: torch.Tensor | None = None) -> None:
    """On the CPU the op runs as Python every step (no graphs): only the read tokens cost anything."""
    if GATE.kinds & READ and _OUT is not None:
        rows = token_read[: target.shape[0]]
        picked = rows.nonzero().squeeze(1)
        picked = picked[read_slot[rows[picked].long(), layer].any(-1)]  # rows with a probe at this layer
        if picked.numel():
            values = read_torch(target[picked], None if other is None else other[picked], rows[picked], read_slot,
                                bank, layer)
            _OUT[layer, picked] = values
            if gate_row is not None:
                positions = token_pos[picked]
                here, held = gate_torch(values, rows[picked].long(), positions, gate_row, gate_f, layer)
                token_hit[picked[here]] = held[here].to(token_hit.dtype)
                latched = here & held & ((gate_row[rows[picked].long(), GATE_FLAGS] & GATE_LATCH) != 0)
                gate_row[:, GATE_FIRST].scatter_reduce_(0, rows[picked][latched].long(), positions[latched], "amin")


def _read_cuda(target: torch.Tensor, other: torch.Tensor | None, token_read: torch.Tensor, read_slot: torch.Tensor,
               bank: torch.Tensor, layer: int, *gates: torch.Tensor | None) -> None:
    if GATE.kinds & READ and _OUT is not None:
        from hotwire_core.triton_readout import read_triton_

        read_triton_(target, other, token_read, read_slot, bank, _OUT, layer, *gates, pdl=ops.PDL)


def register_readout_op() -> None:
    """Register ``torch.ops.hotwire.read_`` once per process."""
    define_op(OP_NAME, _SCHEMA, _read_cpu, _read_cuda)


register_readout_op()
