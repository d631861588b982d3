"""Triton kernel behind the CUDA implementation of ``torch.ops.hotwire.steer_``.

One program per token. Unsteered tokens (config 0) and every token at a layer no live config steers (``layer_on``)
return after one round of loads (two independent int32 loads, issued together); steered tokens at a switched-on
layer their own config leaves alone cost K more loads. H is a compile-time constant (fixed per model), so the chunk loops have static
bounds (which also keeps them runnable in Triton's interpreter). The launcher only reads shapes and strides, never tensor data, and allocates
nothing, so it is safe to capture in a CUDA graph once the kernel has been compiled (vLLM warms up first).
Imported only when the CUDA kernel first runs (see ``hotwire_core.ops``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

MAX_BLOCK_H = 4096


@triton.jit
def _steer_kernel(
    res_ptr,
    hid_ptr,
    token_cfg_ptr,
    layer_on_ptr,
    slot_ptr,
    scale_ptr,
    rel_ptr,
    bank_ptr,
    inv_norm_ptr,
    cfg_gate_ptr,
    token_read_ptr,
    token_pos_ptr,
    token_hit_ptr,
    gate_row_ptr,
    layer,
    n_layers,
    res_stride,
    hid_stride,
    bank_stride,
    gate_row_stride,
    H: tl.constexpr,
    K: tl.constexpr,
    HAS_HIDDEN: tl.constexpr,
    HAS_GATES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # Both loads are independent, so their latencies overlap: a layer nobody steers costs one memory round trip.
    cfg = tl.load(token_cfg_ptr + token)
    on = tl.load(layer_on_ptr + layer)
    if PDL:
        # Launched as a programmatic dependent of the kernel that wrote the rows: everything above reads only
        # buffers written before the graph; wait for that kernel before touching a row (and before finishing, so
        # that the kernels after this one still see its writes).
        gdc_wait()
    if (cfg == 0) | (on == 0):
        return
    entry0 = (cfg.to(tl.int64) * n_layers + layer) * K
    # A steered token at a layer its config does not touch (all slots 0): leave the row alone.
    used = 0
    for k in tl.static_range(K):
        used += tl.load(slot_ptr + entry0 + k)
    if used == 0:
        return
    # Gates: the decision the readout op wrote at the condition's lower layer in this forward (read after the
    # PDL wait: the kernel that wrote it ran before this one). A token whose entries are all gated off keeps its bits.
    if HAS_GATES:
        gate = gate_row_ptr + tl.load(token_read_ptr + token).to(tl.int64) * gate_row_stride
        latched = (tl.load(gate + 2) & 2) != 0
        let_through = tl.where(latched, tl.load(gate + 3) <= tl.load(token_pos_ptr + token),
                               tl.load(token_hit_ptr + token) != 0)
        open_entries = 0
        for k in tl.static_range(K):
            is_open = (tl.load(slot_ptr + entry0 + k) != 0) & ((tl.load(cfg_gate_ptr + entry0 + k) == 0) | let_through)
            open_entries += is_open.to(tl.int32)
        if open_entries == 0:
            return
    res_row = res_ptr + token * res_stride
    hid_row = hid_ptr + token * hid_stride
    offs = tl.arange(0, BLOCK_H)

    # The norm costs a second read of the row: only pay it when some entry is norm-relative.
    rel_abs = 0.0
    for k in tl.static_range(K):
        rel_abs += tl.abs(tl.load(rel_ptr + entry0 + k))
    sumsq = tl.zeros([BLOCK_H], dtype=tl.float32)
    if rel_abs != 0.0:
        for h0 in range(0, H, BLOCK_H):
            h = h0 + offs
            mask = h < H
            x = tl.load(res_row + h, mask=mask, other=0.0).to(tl.float32)
            if HAS_HIDDEN:
                x += tl.load(hid_row + h, mask=mask, other=0.0).to(tl.float32)
            sumsq += x * x
    norm = tl.sqrt(tl.sum(sumsq, axis=0))

    for h0 in range(0, H, BLOCK_H):
        h = h0 + offs
        mask = h < H
        acc = tl.load(res_row + h, mask=mask, other=0.0).to(tl.float32)
        for k in tl.static_range(K):
            slot = tl.load(slot_ptr + entry0 + k).to(tl.int64)
            rel = tl.load(rel_ptr + entry0 + k)
            coef = tl.load(scale_ptr + entry0 + k) + rel * norm * tl.load(inv_norm_ptr + slot)
            if HAS_GATES:
                coef = tl.where((tl.load(cfg_gate_ptr + entry0 + k) != 0) & (let_through == 0), 0.0, coef)
            acc += coef * tl.load(bank_ptr + slot * bank_stride + h, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_row + h, acc.to(res_ptr.dtype.element_ty), mask=mask)


def _check_layout(
    residual: torch.Tensor,
    hidden: torch.Tensor | None,
    cfg_slot: torch.Tensor,
    cfg_scale: torch.Tensor,
    cfg_rel: torch.Tensor,
    bank: torch.Tensor,
) -> None:
    """The kernel assumes unit stride along H and dense config tables; metadata only, no device sync."""
    rows = [residual, bank] + ([hidden] if hidden is not None else [])
    if any(x.stride(-1) != 1 for x in rows):
        raise ValueError("hotwire.steer_: residual, hidden and bank need unit stride along the hidden dim")
    if not all(x.is_contiguous() for x in (cfg_slot, cfg_scale, cfg_rel)):
        raise ValueError("hotwire.steer_: config tables must be contiguous")


def steer_triton_(
    residual: torch.Tensor,
    hidden: torch.Tensor | None,
    token_cfg: torch.Tensor,
    layer_on: torch.Tensor,
    cfg_slot: torch.Tensor,
    cfg_scale: torch.Tensor,
    cfg_rel: torch.Tensor,
    bank: torch.Tensor,
    inv_norm: torch.Tensor,
    layer: int,
    cfg_gate: torch.Tensor | None = None,
    token_read: torch.Tensor | None = None,
    token_pos: torch.Tensor | None = None,
    token_hit: torch.Tensor | None = None,
    gate_row: torch.Tensor | None = None,
    pdl: bool = False,
) -> None:
    """Steer ``residual`` in place with the semantics of ``hotwire_core.ops.steer_torch``. ``pdl``: launch as a
    programmatic dependent launch (Hopper and later), overlapping this launch with the previous kernel's tail."""
    n_tokens, hidden_size = residual.shape
    if n_tokens == 0:
        return
    _check_layout(residual, hidden, cfg_slot, cfg_scale, cfg_rel, bank)
    block_h = min(triton.next_power_of_2(hidden_size), MAX_BLOCK_H)
    hid = residual if hidden is None else hidden  # any valid pointer; HAS_HIDDEN=False never reads it
    gates = cfg_gate is not None
    if not gates:  # any valid pointers; HAS_GATES=False never reads them
        cfg_gate = token_read = token_pos = token_hit = gate_row = token_cfg
    _steer_kernel[(n_tokens,)](
        residual,
        hid,
        token_cfg,
        layer_on,
        cfg_slot,
        cfg_scale,
        cfg_rel,
        bank,
        inv_norm,
        cfg_gate,
        token_read,
        token_pos,
        token_hit,
        gate_row,
        layer,
        cfg_slot.shape[1],
        residual.stride(0),
        hid.stride(0),
        bank.stride(0),
        gate_row.stride(0) if gates else 0,
        H=hidden_size,
        K=cfg_slot.shape[2],
        HAS_HIDDEN=hidden is not None,
        HAS_GATES=gates,
        BLOCK_H=block_h,
        PDL=pdl,
        num_warps=min(8, max(1, block_h // 256)),
        launch_pdl=pdl,
    )
