"""Triton kernel behind the CUDA implementation of ``torch.ops.hotwire.capture_`` (``hotwire_core.capture_op``).

One program per token: a token without a capture row returns after one int32 load, so a step in which nobody
captures (but something is steered: the gate is open) pays about what ``steer_`` pays at a switched-off layer.
Launched, like ``steer_``, as a programmatic dependent launch where the GPU has it (``ops.PDL``). A
captured token adds its stream row (``target + other``, in float32) into its accumulator row with atomic adds:
``mean`` captures sum many tokens into one row, in an order the GPU picks. The launcher reads only shapes and
strides, so it is safe to capture in a CUDA graph once compiled. Imported on the op's first CUDA call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

MAX_BLOCK_H = 4096


@triton.jit
def _capture_kernel(target_ptr, other_ptr, token_cap_ptr, acc_ptr, layer, target_stride, other_stride, acc_layer_stride,
                    H: tl.constexpr, HAS_OTHER: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    row = tl.load(token_cap_ptr + token).to(tl.int64)  # written only by copies issued before the forward
    if PDL:
        # A programmatic dependent of the kernel that wrote the stream: wait for it before reading the stream or
        # returning (the kernels after this one must see its writes too).
        gdc_wait()
    if row == 0:
        return
    offs = tl.arange(0, BLOCK_H)
    dst = acc_ptr + layer * acc_layer_stride + row * H
    for h0 in range(0, H, BLOCK_H):
        h = h0 + offs
        mask = h < H
        x = tl.load(target_ptr + token * target_stride + h, mask=mask, other=0.0).to(tl.float32)
        if HAS_OTHER:
            x += tl.load(other_ptr + token * other_stride + h, mask=mask, other=0.0).to(tl.float32)
        tl.atomic_add(dst + h, x, mask=mask)


def capture_triton_(target: torch.Tensor, other: torch.Tensor | None, token_cap: torch.Tensor, acc: torch.Tensor,
                    layer: int, pdl: bool = False) -> None:
    """``acc[layer, token_cap[t]] += target[t] (+ other[t])`` for every token with a non-zero row. ``pdl``: launch as
    a programmatic dependent launch (Hopper and later)."""
    n_tokens, hidden_size = target.shape
    if n_tokens == 0:
        return
    if target.stride(-1) != 1 or (other is not None and other.stride(-1) != 1) or not acc.is_contiguous():
        raise ValueError("hotwire.capture_: the stream needs unit stride along the hidden dim, the accumulator "
                         "must be contiguous")
    block_h = min(triton.next_power_of_2(hidden_size), MAX_BLOCK_H)
    src = target if other is None else other  # any valid pointer; HAS_OTHER=False never reads it
    _capture_kernel[(n_tokens,)](
        target, src, token_cap, acc, layer, target.stride(0), src.stride(0), acc.stride(0),
        H=hidden_size, HAS_OTHER=other is not None, BLOCK_H=block_h, PDL=pdl, num_warps=min(8, max(1, block_h // 256)),
        launch_pdl=pdl,
    )
