"""Triton kernel behind the CUDA implementation of ``torch.ops.hotwire.read_`` (``hotwire_core.readout_op``).

One program per token: a token without a readout row, or whose row has no probe at this layer, returns after
loading its row and K slots, so a step in which nobody reads (but something is steered: the gate is open) pays about
what ``steer_`` pays at a switched-off layer. Launched, like ``steer_``, as a programmatic dependent launch where
the GPU has it (``ops.PDL``): it starts while the kernel before it drains and loads its row and slots meanwhile. A
read token loads its stream row (``target + other``, in float32) block by block, accumulates its dot product with
each of its row's ``K`` probes and its squared norm, and writes ``K + 1`` floats. The launcher reads only shapes and
strides, so it is safe to capture in a CUDA graph once compiled. Imported on the op's first CUDA call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

MAX_BLOCK_H = 1024


@triton.jit
def _read_kernel(target_ptr, other_ptr, token_read_ptr, read_slot_ptr, bank_ptr, out_ptr, token_pos_ptr, token_hit_ptr,
                 gate_row_ptr, gate_f_ptr, layer, target_stride, other_stride, slot_row_stride, out_layer_stride,
                 gate_row_stride, gate_f_stride, H: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr,
                 HAS_OTHER: tl.constexpr, HAS_GATES: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    # token_read and read_slot are written only by copies issued before the forward: safe to load before the wait.
    row = tl.load(token_read_ptr + token).to(tl.int64)
    ks = tl.arange(0, K_POW2)
    kmask = ks < K
    slots = tl.load(read_slot_ptr + row * slot_row_stride + layer * K + ks, mask=kmask & (row != 0),
                    other=0).to(tl.int64)
    if PDL:
        # A programmatic dependent of the kernel that wrote the stream: wait for it before reading the stream, the
        # gate rows or returning (the kernels after this one must see its writes too).
        gdc_wait()
    if tl.max(slots, axis=0) == 0:  # no readout row, or none of its probes at this layer (its condition's has one)
        return
    offs = tl.arange(0, BLOCK_H)
    dots = tl.zeros([K_POW2], dtype=tl.float32)
    squares = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + offs
        mask = h < H
        x = tl.load(target_ptr + token * target_stride + h, mask=mask, other=0.0).to(tl.float32)
        if HAS_OTHER:
            x += tl.load(other_ptr + token * other_stride + h, mask=mask, other=0.0).to(tl.float32)
        squares += x * x
        probes = tl.load(bank_ptr + slots[:, None] * H + h[None, :], mask=kmask[:, None] & mask[None, :],
                         other=0.0).to(tl.float32)
        dots += tl.sum(probes * x[None, :], axis=1)
    dst = out_ptr + layer * out_layer_stride + token * (K + 1)
    norm = tl.sqrt(tl.sum(squares, axis=0))
    tl.store(dst + ks, dots, mask=kmask)
    tl.store(dst + K, norm)
    if HAS_GATES:  # the row's condition, where it is read at this layer (hotwire_core.readout_op.gate_torch)
        gate = gate_row_ptr + row * gate_row_stride
        if tl.load(gate) == layer:
            flags = tl.load(gate + 2)
            dot = tl.sum(tl.where(ks == tl.load(gate + 1), dots, 0.0), axis=0)
            threshold = tl.load(gate_f_ptr + row * gate_f_stride)
            if (flags & 4) != 0:
                value = tl.where(norm > 0, dot * tl.load(gate_f_ptr + row * gate_f_stride + 2) / norm, 0.0)
            else:
                value = dot + tl.load(gate_f_ptr + row * gate_f_stride + 1)
            held = tl.where((flags & 1) != 0, value < threshold, value > threshold)
            position = tl.load(token_pos_ptr + token)
            held = held & (((flags & 8) == 0) | (position < tl.load(gate + 4)))
            tl.store(token_hit_ptr + token, held.to(tl.int32))
            if held & ((flags & 2) != 0):
                tl.atomic_min(gate + 3, position)


def read_triton_(target: torch.Tensor, other: torch.Tensor | None, token_read: torch.Tensor, read_slot: torch.Tensor,
                 bank: torch.Tensor, out: torch.Tensor, layer: int, token_pos: torch.Tensor | None = None,
                 token_hit: torch.Tensor | None = None, gate_row: torch.Tensor | None = None,
                 gate_f: torch.Tensor | None = None, pdl: bool = False) -> None:
    """``out[layer, t] = (stream[t] . bank[read_slot[token_read[t], layer, k]] for k, |stream[t]|)`` for every token
    with a non-zero readout row. ``pdl``: launch as a programmatic dependent launch (Hopper and later)."""
    n_tokens, hidden_size = target.shape
    if n_tokens == 0:
        return
    if (target.stride(-1) != 1 or (other is not None and other.stride(-1) != 1) or not out.is_contiguous()
            or not bank.is_contiguous() or not read_slot.is_contiguous()):
        raise ValueError("hotwire.read_: the stream needs unit stride along the hidden dim; bank, slots and output "
                         "must be contiguous")
    k = read_slot.shape[-1]
    block_h = min(triton.next_power_of_2(hidden_size), MAX_BLOCK_H)
    src = target if other is None else other  # any valid pointer; HAS_OTHER=False never reads it
    gates = gate_row is not None
    if not gates:  # any valid pointers; HAS_GATES=False never reads them
        token_pos = token_hit = gate_row = token_read
        gate_f = out
    _read_kernel[(n_tokens,)](
        target, src, token_read, read_slot, bank, out, token_pos, token_hit, gate_row, gate_f, layer, target.stride(0),
        src.stride(0), read_slot.stride(0), out.stride(0), gate_row.stride(0) if gates else 0,
        gate_f.stride(0) if gates else 0, H=hidden_size, K=k, K_POW2=triton.next_power_of_2(k),
        HAS_OTHER=other is not None, HAS_GATES=gates, BLOCK_H=block_h, PDL=pdl,
        num_warps=min(8, max(1, block_h // 256)), launch_pdl=pdl,
    )
