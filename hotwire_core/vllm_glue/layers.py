"""Which of vLLM's decoder layers hotwire hooks, and where their output holds the residual stream.

The contract: ``forward(positions, hidden_states, residual) -> (hidden_states, residual)`` (gpt-oss: the first two
arguments swapped) where the stream after the layer is ``hidden_states + residual`` (Llama-style layers leave the add
to the next layer's fused add-RMSNorm; ``residual`` None: ``hidden_states`` alone). Two kinds of layers have the
signature but not that meaning; both were read from vLLM 0.25.1's model sources, and
``tests/unit/test_layer_contract.py`` reads the installed vLLM's again.
"""

from __future__ import annotations

import inspect

from torch import nn

from ..steer_hook import HOOK_NAME
from ..stream_read import READER_NAME

__all__ = ["MODEL_ADD", "SWAPPED_ARGS_LAYERS", "adds_last_layer_itself", "find_decoder_layers", "is_steerable_layer",
           "read_points", "stream_in_hidden", "why_not_steerable", "wrap_layer_class", "wrap_norm_class"]

_LAYER_ARGS = ["positions", "hidden_states", "residual"]
# The contract with its first two arguments swapped, and a block name: gpt-oss's ``TransformerBlock.forward
# (hidden_states, positions, residual)`` returns ``(output, residual)`` with the stream their sum, as the layers above.
SWAPPED_ARGS_LAYERS = frozenset({"TransformerBlock"})
_SWAPPED_ARGS = ["hidden_states", "positions", "residual"]
# How a layer hands the stream of the one before it to its first norm (Llama, Qwen2/3, Qwen3-MoE, Mistral, Gemma 3,
# ...): the ``residual`` that call returns is that stream.
_LAYER_NORM_CALL = "self.input_layernorm(hidden_states, residual)"
# The signature, but a return value that is not (hidden_states, residual | None): HunYuan adds its KV states.
UNSUPPORTED_LAYERS = frozenset({"HunYuanDecoderLayer"})
# The signature, but the whole stream in ``hidden_states``: these begin with ``residual = hidden_states`` and end
# with ``hidden_states = residual + ...``; the ``residual`` they return is the stream before their last block, which
# the next layer and the final norm ignore. Steering goes into ``hidden_states`` and a norm-relative scale is taken
# of it alone (``hidden + residual`` would count the stream twice, and steering ``residual`` would be dropped).
STREAM_IN_HIDDEN = frozenset({
    "ChameleonSwinDecoderLayer",
    "Cohere2MoeDecoderLayer",
    "CohereDecoderLayer",  # Command R and Cohere2 (its norm passes residual through untouched)
    "Exaone4DecoderLayer",
    "GraniteMoeHybridAttentionDecoderLayer",
    "HyperCLOVAXDecoderLayer",
    "PhiMoEDecoderLayer",
})


def is_steerable_layer(cls: type) -> bool:
    """Layers with the ``(positions, hidden_states, residual) -> (hidden_states, residual)`` contract (or, for
    ``SWAPPED_ARGS_LAYERS``, ``(hidden_states, positions, residual)``)."""
    name = cls.__name__
    if name in SWAPPED_ARGS_LAYERS:
        expected = _SWAPPED_ARGS
    elif name.endswith("DecoderLayer") and name not in UNSUPPORTED_LAYERS:
        expected = _LAYER_ARGS
    else:
        return False
    forward = getattr(cls, "_hotwire_wrapped", cls.forward)
    return list(inspect.signature(forward).parameters)[1:4] == expected


# How a model adds its last layer's ``(hidden_states, residual)`` itself, in the model dtype, where most leave it to
# their final fused add-RMSNorm (MiMo, whose forward returns the sum; HY-V3, whose norm follows). Inductor makes
# that add and the layer's down projection one GEMM (``addmm``, rounding once); an op on ``hidden_states`` between
# them splits it and moves every token by a rounding. Such a model's last layer is steered in ``residual``.
MODEL_ADD = "hidden_states = hidden_states + residual"


def adds_last_layer_itself(model: nn.Module) -> bool:
    """Whether the module that holds the decoder stack (a ``layers`` ModuleList) adds its last layer's output
    itself (see MODEL_ADD)."""
    return any(_calls(type(m), MODEL_ADD) for m in model.modules()
               if isinstance(getattr(m, "layers", None), nn.ModuleList))


def stream_in_hidden(cls: type) -> bool:
    """Whether a steerable layer returns the whole residual stream in ``hidden_states`` (see STREAM_IN_HIDDEN)."""
    return cls.__name__ in STREAM_IN_HIDDEN


def find_decoder_layers(model: nn.Module) -> tuple[dict[int, nn.Module], int]:
    """The main decoder stack: ``({global layer index: module on this rank}, total layers)``. In a hybrid stack
    only the layers with the contract are listed (Granite 4's attention layers, not its Mamba ones)."""
    best: tuple[dict[int, nn.Module], int] = ({}, 0)
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            layers = {i: m for i, m in enumerate(module) if is_steerable_layer(type(m))}
            if len(layers) > len(best[0]):
                best = (layers, len(module))
    return best


def why_not_steerable(model: nn.Module) -> str:
    """Why ``model`` has no layer to hook: its decoder layer classes and the arguments their ``forward`` takes."""
    reason = "no decoder layer with the (positions, hidden_states, residual) contract"
    seen = sorted({type(m) for m in model.modules()
                   if type(m).__name__.endswith("DecoderLayer") or type(m).__name__ in SWAPPED_ARGS_LAYERS}, key=str)
    if not seen:
        return reason
    forwards = [f"{cls.__name__}.forward({', '.join(list(inspect.signature(cls.forward).parameters)[1:])})"
                for cls in seen]
    return f"{reason}: {'; '.join(forwards)}"


def wrap_layer_class(cls: type) -> None:
    """Patch a steerable layer class's ``forward`` once so that instances carrying a hook (a submodule named
    ``HOOK_NAME``, a ``SteerHook``) apply it to their output ``(hidden_states, residual)``."""
    if "_hotwire_wrapped" in cls.__dict__:
        return
    original = cls.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        hook = self._modules.get(HOOK_NAME)
        return out if hook is None else hook(*out)

    forward.__doc__ = original.__doc__
    cls._hotwire_wrapped = original
    cls.forward = forward


def _calls(cls: type, call: str) -> bool:
    """Whether the source of ``cls.forward`` (before hotwire wrapped it) makes ``call``."""
    forward = cls.__dict__.get("_hotwire_wrapped") or getattr(cls, "forward", None)
    try:
        return call in inspect.getsource(forward)
    except (OSError, TypeError):
        return False


def read_points(found: dict[int, nn.Module]) -> dict[int, nn.Module]:
    """For each layer of ``found`` whose stream the graph stores anyway as the ``residual`` output of the next layer's
    ``input_layernorm``, that norm (see :mod:`hotwire_core.stream_read`). A layer missing here (the last of the model
    or of a pipeline stage; the whole stream in ``hidden_states``; a next layer that calls its norm otherwise) is read
    at its output."""
    points: dict[int, nn.Module] = {}
    for index, layer in found.items():
        following = found.get(index + 1)
        if stream_in_hidden(type(layer)) or following is None or not _calls(type(following), _LAYER_NORM_CALL):
            continue
        norm = getattr(following, "input_layernorm", None)
        if isinstance(norm, nn.Module):
            points[index] = norm
    return points


def wrap_norm_class(cls: type) -> None:
    """Patch a norm class's ``forward`` once so that instances carrying a reader (a submodule named ``READER_NAME``,
    a ``StreamReader``) hand it the ``residual`` they return when called with one."""
    if "_hotwire_wrapped" in cls.__dict__:
        return
    original = cls.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        reader = self._modules.get(READER_NAME)
        if reader is not None and isinstance(out, tuple):
            reader(out[1])
        return out

    forward.__doc__ = original.__doc__
    cls._hotwire_wrapped = original
    cls.forward = forward
