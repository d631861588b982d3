"""The steering applied to one decoder layer's output (:class:`SteerHook`, a submodule of the layer named
:data:`HOOK_NAME`, which the layer's patched ``forward`` calls: ``vllm_glue.layers.wrap_layer_class``), and which
layers get one (:func:`select_layers`). Its ``forward`` lands in vLLM's compiled graphs."""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .settings import format_layers
from .stream_read import StreamReader

__all__ = ["HOOK_NAME", "SteerHook", "select_layers"]

HOOK_NAME = "hotwire_steer"


def select_layers(found: dict[int, nn.Module], n_layers: int, allowed: frozenset[int] | None) -> dict[int, nn.Module]:
    """The layers of ``found`` to hook: those in ``allowed`` (``HOTWIRE_LAYERS``; None: all). A layer the model
    does not have is a configuration error, raised at start rather than refused on every request."""
    if allowed is None:
        return found
    missing = sorted(layer for layer in allowed if layer >= n_layers)
    if missing:
        raise ValueError(
            f"HOTWIRE_LAYERS={format_layers(allowed)} names layer {missing[0]}, but the model has {n_layers} decoder "
            f"layers (0-{n_layers - 1}); fix HOTWIRE_LAYERS or unset it to steer every layer"
        )
    return {index: module for index, module in found.items() if index in allowed}


class SteerHook(nn.Module):
    """Applies steering to one layer's output. Holds the shared buffers as (non-persistent) module buffers so
    torch.compile lifts them as fixed-address graph inputs.

    The residual stream after a layer that returns ``(hidden, residual)`` is ``hidden + residual``, so the
    steering may go into either. Where it goes decides what the compiled graph looks like around it:

    * ``"hidden"`` (the default): the op touches only ``hidden``, a matmul output that is in
      memory anyway. ``residual`` stays a value Inductor may keep in registers, exactly as without hotwire, so
      unsteered tokens come out bit-identical to vLLM without the plugin. Norm-relative entries need ``residual``
      too; with ``HOTWIRE_NORM=1`` the op reads it, and Inductor then writes it out in the model dtype, which
      moves plain tokens by rounding. So norm mode is opt-in.
    * ``"residual"`` when vLLM's all-reduce + RMSNorm fusion pass is on (tensor parallel > 1 on Hopper or
      Blackwell with FlashInfer): keeps that fusion, whose pattern ``all_reduce(hidden) ->
      fused_add_rms_norm(hidden, residual)`` an op on ``hidden`` would break. Reading ``residual`` costs
      bit-identity (above), which that fusion gives up anyway. Also at the last layer of a model that adds
      ``hidden + residual`` itself in the model dtype (``vllm_glue.layers.MODEL_ADD``: MiMo): Inductor turns the
      layer's down projection and that add into one GEMM, which takes ``residual`` stored as it is; an op on
      ``hidden`` between them would split it.

    A layer that returns the whole stream in ``hidden`` (``whole_stream``; its ``residual`` is a stale value the
    model drops) is steered like one that returns ``(hidden, None)``.
    """

    def __init__(self, buffers: dict[str, torch.Tensor], layer: int, impl: str, target: str, norm: bool,
                 whole_stream: bool = False, reader: StreamReader | None = None):
        super().__init__()
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor, persistent=False)
        self.layer, self.impl, self.target, self.norm = layer, impl, target, norm
        self.whole_stream = whole_stream
        # Gated steering (hotwire_core.gates): the readout op decides the conditions, the steering op reads them.
        self.gates = "cfg_gate" in buffers
        # Capture and readout at the layer's output, where no norm downstream stores the stream (stream_read).
        self.reader = reader

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if residual is None or self.whole_stream:  # the whole stream is in hidden
            target, other = hidden, None
        elif self.target == "hidden":
            target, other = hidden, (residual if self.norm else None)
        else:  # hidden is read only for a norm-relative scale: an op reading it keeps the GEMM that made it apart
            target, other = residual, (hidden if self.norm else None)
        args = (self.token_cfg, self.layer_on, self.cfg_slot, self.cfg_scale, self.cfg_rel, self.bank, self.inv_norm, self.layer)
        if self.impl == "inductor":
            target = ops.steer_torch(target, other, *args, use_norm=self.norm)
        elif self.gates:
            torch.ops.hotwire.steer_(target, other, *args, self.cfg_gate, self.token_read, self.token_pos,
                                     self.token_hit, self.gate_row)
        else:
            torch.ops.hotwire.steer_(target, other, *args)
        if self.reader is not None:  # the stream is target + the other of (hidden, residual), if both come
            if residual is None or self.whole_stream:
                partner = None
            else:  # residual read as a float32 copy, so that Inductor need not store it rounded (stream_read)
                partner = residual.float() if self.target == "hidden" else hidden
            self.reader(target, partner)
        if residual is None or self.whole_stream:
            return target, residual
        return (target, residual) if self.target == "hidden" else (hidden, target)
