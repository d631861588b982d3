"""Which decoder layers hotwire hooks and where it steers them (``vllm_glue.layers``): the lists of exceptions to the
``(hidden_states, residual)`` contract are read again from the installed vLLM's model sources, and a layer that
returns the whole stream in ``hidden_states`` is steered there, norm-relative entries by that stream's norm."""

from __future__ import annotations

import ast
import inspect
import importlib.util
from pathlib import Path

import pytest
import torch

from hotwire_core.runtime import WorkerSteering
from hotwire_core.settings import Settings
from hotwire_core.vllm_glue.layers import (
    MODEL_ADD,
    STREAM_IN_HIDDEN,
    SWAPPED_ARGS_LAYERS,
    UNSUPPORTED_LAYERS,
    adds_last_layer_itself,
    find_decoder_layers,
    is_steerable_layer,
    stream_in_hidden,
    wrap_layer_class,
)

HIDDEN = 8


def _contract_layers() -> dict[str, ast.FunctionDef]:
    """Every ``*DecoderLayer`` class of vLLM's models whose ``forward`` has the contract's arguments, by name."""
    models = Path(importlib.util.find_spec("vllm").submodule_search_locations[0]) / "model_executor" / "models"
    found = {}
    for path in sorted(models.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("DecoderLayer"):
                forward = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
                if forward and [a.arg for a in forward.args.args][1:4] == ["positions", "hidden_states", "residual"]:
                    found[node.name] = forward
    return found


def test_the_exception_lists_match_the_installed_vllm():
    layers = _contract_layers()
    assert len(layers) > 50 and "LlamaDecoderLayer" in layers  # the scan reads the models at all
    whole_stream, other_returns = set(), set()
    for name, forward in layers.items():
        body = [s for s in forward.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        returns = {ast.unparse(n.value) for n in ast.walk(forward) if isinstance(n, ast.Return) and n.value is not None}
        if any(r.count(",") != 1 for r in returns):
            other_returns.add(name)
        # The stream kept in hidden_states: the argument residual is overwritten before anything reads it, and the
        # returned residual is not None (layers returning (hidden, None) are steered whole anyway).
        if ast.unparse(body[0]) == "residual = hidden_states" and returns != {"(hidden_states, None)"}:
            whole_stream.add(name)
    assert other_returns == set(UNSUPPORTED_LAYERS)
    assert whole_stream == set(STREAM_IN_HIDDEN)


class LlamaDecoderLayer(torch.nn.Module):
    def forward(self, positions, hidden_states, residual):
        return hidden_states, residual


class PhiMoEDecoderLayer(torch.nn.Module):
    """Named as vLLM's PhiMoE layer, which returns the whole stream in hidden_states and a stale residual."""

    def forward(self, positions, hidden_states, residual):
        return hidden_states, residual


class MambaDecoderLayer(torch.nn.Module):
    def forward(self, hidden_states, residual):
        return hidden_states, residual


def test_a_hybrid_stack_lists_only_the_layers_with_the_contract():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([MambaDecoderLayer(), LlamaDecoderLayer(), MambaDecoderLayer(), PhiMoEDecoderLayer()])
    found, n_layers = find_decoder_layers(model)
    assert (sorted(found), n_layers) == ([1, 3], 4)
    assert not is_steerable_layer(MambaDecoderLayer)
    assert [stream_in_hidden(type(m)) for m in found.values()] == [False, True]


@pytest.mark.parametrize("fusion", [False, True])
def test_a_whole_stream_layer_is_steered_in_hidden_by_its_norm(fusion):
    """Norm-relative steering after a PhiMoE-style layer scales by ``|hidden|`` (not ``|hidden + residual|``), and
    goes into ``hidden`` even where others steer ``residual`` (the all-reduce + RMSNorm fusion)."""
    plain, whole = LlamaDecoderLayer(), PhiMoEDecoderLayer()
    for layer in (plain, whole):
        wrap_layer_class(type(layer))
    w = WorkerSteering({0: plain, 1: whole}, 2, HIDDEN, torch.float32, torch.device("cpu"), 4, 2,
                       Settings(16, 2, "op", None, None, norm=True), allreduce_rms_fusion=fusion, whole_stream={1})
    w.buffers["bank"][1] = torch.eye(HIDDEN)[0]
    w.buffers["inv_norm"][1] = 1.0
    w.buffers["cfg_slot"][1, :, 0] = 1
    w.buffers["cfg_rel"][1, :, 0] = 0.5  # 0.5 * |stream| * v/|v|
    w.buffers["token_cfg"][0] = 1
    w.buffers["layer_on"][:] = 1
    hidden, stale = torch.full((1, HIDDEN), 2.0), torch.full((1, HIDDEN), 7.0)
    out_hidden, out_residual = whole(None, hidden.clone(), stale.clone())
    expected = hidden.clone()
    expected[0, 0] += 0.5 * hidden.norm()
    assert torch.equal(out_residual, stale)
    torch.testing.assert_close(out_hidden, expected)
    # The same tensors through a Llama-style layer: the stream is hidden + residual, and its norm is that sum's.
    out_hidden, out_residual = plain(None, hidden.clone(), stale.clone())
    steered = out_residual if fusion else out_hidden
    assert steered[0, 0] - (stale if fusion else hidden)[0, 0] == pytest.approx(0.5 * (hidden + stale).norm().item())


def test_models_that_add_their_last_layer_themselves_are_told_apart():
    """``MODEL_ADD``: MiMo's model adds its last layer's output itself (its last layer is then steered in
    ``residual``: ``SteerHook``), Qwen2's and Llama's leave the add to their final norm (read from the installed
    vLLM); a model without a decoder stack adds nothing."""
    from vllm.model_executor.models.llama import LlamaModel
    from vllm.model_executor.models.mimo import MiMoModel
    from vllm.model_executor.models.qwen2 import Qwen2Model

    def holding_stack(cls):
        model = torch.nn.Module()
        model.inner = cls.__new__(cls)
        torch.nn.Module.__init__(model.inner)
        model.inner.layers = torch.nn.ModuleList([LlamaDecoderLayer()])
        return model

    assert adds_last_layer_itself(holding_stack(MiMoModel))
    assert not any(adds_last_layer_itself(holding_stack(cls)) for cls in (Qwen2Model, LlamaModel))
    assert not adds_last_layer_itself(torch.nn.Linear(2, 2))
    assert MODEL_ADD in inspect.getsource(MiMoModel.forward)


def test_the_last_layer_of_such_a_model_is_steered_in_residual_alone():
    """Steered in ``residual`` without a norm-relative entry, the op is handed ``residual`` alone: an op that read
    ``hidden`` would keep the down projection's GEMM apart from the model's add even so."""
    first, last = LlamaDecoderLayer(), LlamaDecoderLayer()
    wrap_layer_class(LlamaDecoderLayer)
    w = WorkerSteering({0: first, 1: last}, 2, HIDDEN, torch.float32, torch.device("cpu"), 4, 2,
                       Settings(16, 2, "op", None, None), in_residual={1})
    assert (first.hotwire_steer.target, last.hotwire_steer.target) == ("hidden", "residual")
    w.buffers["bank"][1] = torch.eye(HIDDEN)[0]
    w.buffers["cfg_slot"][1, :, 0] = 1
    w.buffers["cfg_scale"][1, :, 0] = 3.0
    w.buffers["token_cfg"][0] = 1
    w.buffers["layer_on"][:] = 1
    hidden, residual = torch.full((1, HIDDEN), 2.0), torch.full((1, HIDDEN), 7.0)
    out_hidden, out_residual = last(None, hidden.clone(), residual.clone())
    assert torch.equal(out_hidden, hidden) and out_residual[0, 0] == 10.0
    assert torch.equal(out_residual[0, 1:], residual[0, 1:])


def test_gpt_oss_blocks_take_the_contract_with_swapped_arguments():
    """vLLM's gpt-oss ``TransformerBlock``: ``(hidden_states, positions, residual) -> (output, residual)``, the
    stream their sum and handed to the next block's ``input_layernorm`` like the decoder layers' (read again from the
    installed vLLM); a block named so but with other arguments (Pixtral's vision blocks) is not hooked."""
    import inspect

    from vllm.model_executor.models.gpt_oss import TransformerBlock

    assert "TransformerBlock" in SWAPPED_ARGS_LAYERS and is_steerable_layer(TransformerBlock)
    source = inspect.getsource(TransformerBlock.forward)
    assert "hidden_states, residual = self.input_layernorm(hidden_states, residual)" in source
    assert source.rstrip().endswith("return output, residual")

    class VisionBlock(torch.nn.Module):
        def forward(self, x, mask, freqs_cis):
            return x

    VisionBlock.__name__ = "TransformerBlock"
    assert not is_steerable_layer(VisionBlock)


def test_a_model_without_the_contract_says_which_layers_it_has():
    from hotwire_core.vllm_glue.layers import why_not_steerable

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([MambaDecoderLayer(), MambaDecoderLayer()])
    assert find_decoder_layers(model) == ({}, 0)
    assert why_not_steerable(model) == ("no decoder layer with the (positions, hidden_states, residual) contract: "
                                        "MambaDecoderLayer.forward(hidden_states, residual)")
    assert why_not_steerable(torch.nn.Linear(2, 2)).endswith("contract")


class Norm(torch.nn.Module):
    def forward(self, x, residual=None):
        if residual is None:
            return x * 2
        residual = x + residual
        return residual * 2, residual


class QwenStyleDecoderLayer(torch.nn.Module):
    """Calls its first norm the way vLLM's Llama-family layers do, so its ``residual`` is the previous layer's stream."""

    def __init__(self):
        super().__init__()
        self.input_layernorm = Norm()

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return hidden_states + 1, residual


class Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, stream, partner=None):
        self.seen.append((stream.clone(), None if partner is None else partner.clone()))


def test_the_llama_family_hands_the_stream_to_the_next_layers_norm_in_the_installed_vllm():
    """read_points relies on this call in vLLM's own sources (the stream is its ``residual`` output)."""
    from hotwire_core.vllm_glue.layers import _LAYER_NORM_CALL, _calls
    from vllm.model_executor.models import gemma3, llama, qwen2, qwen3, qwen3_moe

    for cls in (llama.LlamaDecoderLayer, qwen2.Qwen2DecoderLayer, qwen3.Qwen3DecoderLayer,
                qwen3_moe.Qwen3MoeDecoderLayer, gemma3.Gemma3DecoderLayer):
        assert _calls(cls, _LAYER_NORM_CALL), cls.__name__


def test_the_stream_is_read_at_the_next_norm_and_the_last_layer_at_its_output_upcast():
    """Each layer but the last is read where the next one's norm returns it; the last at its output, residual as a
    float32 copy; a whole-stream layer at its output, hidden alone (stream_read)."""
    from hotwire_core.steer_hook import HOOK_NAME, SteerHook
    from hotwire_core.stream_read import READER_NAME
    from hotwire_core.vllm_glue.layers import read_points, wrap_norm_class

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([QwenStyleDecoderLayer() for _ in range(3)] + [PhiMoEDecoderLayer()])
    found, n_layers = find_decoder_layers(model)
    points = read_points(found)
    assert points == {0: found[1].input_layernorm, 1: found[2].input_layernorm}  # 2: next is whole-stream; 3: last
    readers = {index: Recorder() for index in found}
    buffers = {"token_cfg": torch.zeros(4, dtype=torch.int32), "layer_on": torch.zeros(4, dtype=torch.int32),
               "cfg_slot": torch.zeros(1, 4, 1, dtype=torch.int32), "cfg_scale": torch.zeros(1, 4, 1),
               "cfg_rel": torch.zeros(1, 4, 1), "bank": torch.zeros(1, HIDDEN), "inv_norm": torch.zeros(1)}
    for index, layer in found.items():
        wrap_layer_class(type(layer))
        point = points.get(index)
        if point is not None:
            wrap_norm_class(type(point))
            point.add_module(READER_NAME, readers[index])
        layer.add_module(HOOK_NAME, SteerHook(buffers, index, "op", "hidden", False, index == 3,
                                              None if point is not None else readers[index]))
    hidden = torch.arange(2 * HIDDEN, dtype=torch.bfloat16).reshape(2, HIDDEN) / 7
    outputs, residual = [], None
    for layer in model.layers:
        hidden, residual = layer(None, hidden, residual)
        outputs.append((hidden, residual))
    for index in (0, 1):  # the next norm's residual: the sum, in the model dtype
        ((stream, partner),) = readers[index].seen
        assert partner is None and torch.equal(stream, outputs[index][0] + outputs[index][1])
    ((stream, partner),) = readers[2].seen
    assert torch.equal(stream, outputs[2][0]) and partner.dtype == torch.float32
    assert torch.equal(partner, outputs[2][1].float())
    ((stream, partner),) = readers[3].seen
    assert partner is None and torch.equal(stream, outputs[3][0])
