"""The readout custom op ``torch.ops.hotwire.read_`` (see docs/architecture.md, "Readout").

Right after the steering op (and the capture op, where compiled in), at the same point of every hooked decoder
layer, it projects the residual stream of each token that has a readout row (``token_read[t] != 0``) onto that
row's probes for the layer (``read_slot[row, layer, k]``: bank slots; slot 0 is the bank's all-zero row) and writes
``out[layer, t, k]`` (the dot products, float32) and ``out[layer, t, K]`` (the stream's L2 norm, for cosines).
Tokens without a row are not written. Like ``steer_`` it does nothing while ``ops.GATE`` is closed, so a step in
which nobody steers, captures or reads still replays the hotwire-free idle graphs.

The output buffer (``[n_layers, max_tokens, K + 1]`` float32) is not an argument: it is set once per worker
(:func:`set_output`) before compile and graph capture, as the capture op's accumulator is. The schema names
``target`` as mutated (it is only read) so that tracing keeps the op in place after ``steer_``.
"""

from __future__ import annotations

import torch

from .ops import GATE, define_op

OP_NAME = "read_"
_SCHEMA = f"{OP_NAME}(Tensor(a!) target, Tensor? other, Tensor token_read, Tensor read_slot, Tensor bank, int layer) -> ()"

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


def _read_cpu(target: torch.Tensor, other: torch.Tensor | None, token_read: torch.Tensor, read_slot: torch.Tensor,
              bank: torch.Tensor, layer: int) -> None:
    """On the CPU the op runs as Python every step (no graphs): only the read tokens cost anything."""
    if GATE.open and _OUT is not None:
        rows = token_read[: target.shape[0]]
        picked = rows.nonzero().squeeze(1)
        if picked.numel():
            _OUT[layer, picked] = read_torch(target[picked], None if other is None else other[picked], rows[picked],
                                             read_slot, bank, layer)


def _read_cuda(target: torch.Tensor, other: torch.Tensor | None, token_read: torch.Tensor, read_slot: torch.Tensor,
               bank: torch.Tensor, layer: int) -> None:
    if GATE.open and _OUT is not None:
        from hotwire_core.triton_readout import read_triton_

        read_triton_(target, other, token_read, read_slot, bank, _OUT, layer)


def register_readout_op() -> None:
    """Register ``torch.ops.hotwire.read_`` once per process."""
    define_op(OP_NAME, _SCHEMA, _read_cpu, _read_cuda)


register_readout_op()
