"""Capture and readout of the residual stream after a hooked layer (:class:`StreamReader`, a submodule named
:data:`READER_NAME`), and why they read it where they do.

After a Llama-style layer the stream is ``hidden + residual``, and vLLM's compiled graphs never store that sum as the
layer leaves it: the next layer's fused add-RMSNorm (the model's final norm after the last layer) computes it in
float32 from a chain of adds Inductor keeps unstored (a fused intermediate stays float32: Inductor does not emulate the
round trip through bf16), and stores only its ``residual`` output, which the graph split at attention needs. An op
that reads ``residual`` at the layer's output makes Inductor store that intermediate in the model dtype instead, and
every later layer of every token, batchmates and idle graphs included, sees it rounded: in bf16 graphs plain requests
stop being bit-identical to vLLM without hotwire. So:

* the stream after a layer is read where the next layer's ``input_layernorm`` returns it as ``residual``
  (``vllm_glue.layers.read_points``): the stream as the graph stores it anyway, in the model dtype, steering
  included, at no cost;
* where there is no such norm (the last layer, whose final norm's ``residual`` the model drops, so an op reading it
  would be dead code to the compiler; the last layer of a pipeline stage; a layer that keeps the whole stream in
  ``hidden_states``, which is stored anyway) :class:`~hotwire_core.steer_hook.SteerHook` calls the reader at the
  layer's output with ``residual`` upcast to a float32 copy: Inductor computes that copy from the unstored chain
  and leaves ``residual`` as it was, for one more small kernel at that layer in the graphs that steer or read.
"""

from __future__ import annotations

import torch
from torch import nn

from . import capture_op, readout_op  # noqa: F401  (define torch.ops.hotwire.capture_ and read_)

__all__ = ["READER_NAME", "StreamReader"]

READER_NAME = "hotwire_read"


class StreamReader(nn.Module):
    """Runs the capture op (``HOTWIRE_CAPTURE``) and the readout op (``HOTWIRE_READOUT``; with gates, it also decides
    the conditions the steering ops of later layers read) on the stream after global layer ``layer``. Holds the shared
    buffers as non-persistent module buffers, as :class:`~hotwire_core.steer_hook.SteerHook` does."""

    def __init__(self, buffers: dict[str, torch.Tensor], layer: int, read: bool = True):
        """``read``: the readout op runs here (``HOTWIRE_READOUT_LAYERS``), where it is compiled in."""
        super().__init__()
        for name, tensor in buffers.items():
            self.register_buffer(name, tensor, persistent=False)
        self.layer = layer
        self.capture, self.readout = "token_cap" in buffers, read and "token_read" in buffers
        self.gates = self.readout and "cfg_gate" in buffers

    def forward(self, stream: torch.Tensor, partner: torch.Tensor | None = None) -> None:
        """``stream`` (+ ``partner``, where the stream is still a sum) is the residual stream; it is only read."""
        if self.capture:
            torch.ops.hotwire.capture_(stream, partner, self.token_cap, self.layer)
        if self.gates:
            torch.ops.hotwire.read_(stream, partner, self.token_read, self.read_slot, self.bank, self.layer,
                                    self.token_pos, self.token_hit, self.gate_row, self.gate_f)
        elif self.readout:
            torch.ops.hotwire.read_(stream, partner, self.token_read, self.read_slot, self.bank, self.layer)
