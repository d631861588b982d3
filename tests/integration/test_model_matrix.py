"""Other decoder architectures than Qwen3 (Llama, Qwen2, Mistral, Gemma): hotwire finds their layers, and
steering equals a transformers forward with a hook on the same weights (CPU, float32, real random weights). The
Gemma engine hooks only layers 1-2 (``HOTWIRE_LAYERS``): the others are refused, and the hooked ones still equal
the reference. A Qwen3 engine runs ``HOTWIRE_IMPL=inductor`` (the steering as torch ops traced into the
compiled graph instead of the custom op). On the CPU the op engines run eager (start time), the inductor one
compiled."""

from __future__ import annotations

import json
import os

import pytest
import torch

import hf_reference
from engine_results import engine_kwargs, run_batches
from hotwire_core import contract

pytestmark = pytest.mark.integration
# engine -> (architecture, HOTWIRE_LAYERS, HOTWIRE_IMPL); the tiny models have 4 layers
ENGINES = {
    "llama": ("llama", "0-3", "op"),
    "qwen2": ("qwen2", "0-3", "op"),
    "mistral": ("mistral", "0-3", "op"),
    "gemma": ("gemma", "1-2", "op"),
    "qwen3-inductor": ("qwen3", "0-3", "inductor"),
}  # HOTWIRE_LAYERS per engine (the tiny models have 4 layers)


@pytest.fixture(scope="module", params=list(ENGINES))
def arch_engine(request, model_root):
    from vllm import LLM

    from hotwire_core.offline import register_vector
    from hotwire_core.tiny_model import ModelShape, build_model

    arch, layers, impl = ENGINES[request.param]
    model_dir = build_model(model_root / f"{arch}-tiny", ModelShape(arch=arch))
    env = {"HOTWIRE_LAYERS": layers, "HOTWIRE_IMPL": impl}
    saved = {k: os.environ.get(k) for k in env}  # read by the engine process at start; later modules must not inherit them
    os.environ.update(env)
    try:
        # On the CPU the op-based engines run eager (the arch's layer contract is what they check; the compiled op is
        # test_engine.py's, and on a GPU `gpu_checks.sh matrix` runs every architecture with graphs); the inductor
        # engine compiles, since its steering exists only inside the compiled graph.
        eager = not torch.cuda.is_available() and impl == "op"
        llm = LLM(str(model_dir), **engine_kwargs(), **({"enforce_eager": True} if eager else {}))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    vector = torch.randn(256, generator=torch.Generator().manual_seed(11))
    register_vector(llm, "v", vector)
    yield model_dir, llm, vector, request.param
    llm.llm_engine.engine_core.shutdown()


def test_steering_equals_transformers_hook(arch_engine):
    model_dir, llm, vector, _ = arch_engine
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir))("The quick brown fox jumps over").input_ids
    params = dict(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    steer = {"hotwire": json.dumps({"id": "v", "layer": [1, 2], "scale": 3.0})}
    plain, steered = run_batches(llm, [[{"prompt_token_ids": ids, "params": params}],
                                       [{"prompt_token_ids": ids, "params": {**params, "extra_args": steer}}]])
    hf = hf_reference.load(model_dir)
    expected_plain = hf_reference.prompt_logprobs(hf, ids)
    expected = hf_reference.prompt_logprobs(hf, ids, [(1, vector, 3.0, False), (2, vector, 3.0, False)])
    assert (torch.tensor(plain[0]["prompt_logprobs"][1:]) - expected_plain).abs().max() < 2e-3
    assert (torch.tensor(steered[0]["prompt_logprobs"][1:]) - expected).abs().max() < 2e-3
    assert (expected - expected_plain).abs().max() > 0.02, "the steering in this check is too weak to be seen"


def test_only_hotwire_layers_are_steered(arch_engine):
    from hotwire_core.offline import slot_stats
    from hotwire_core.settings import parse_layers

    _, llm, _, engine = arch_engine
    layers = ENGINES[engine][1]
    hooked = parse_layers(layers)
    assert slot_stats(llm)["model"]["layers"] == layers  # what the workers hooked
    # the traced torch ops cannot be switched off per step: an inductor engine keeps one graph set
    assert llm.collective_rpc(contract.GRAPH_SETS)[0]["split"] is (ENGINES[engine][2] == "op")
    for layer in range(4):
        result = llm.collective_rpc(contract.CHECK, args=(json.dumps({"id": "v", "layer": layer, "scale": 1.0}),))[0]
        if layer in hooked:
            assert result["ok"], result
        else:
            assert (result["ok"], result["code"]) == (False, "layer_out_of_range"), result
            assert f"steers layers {layers} (HOTWIRE_LAYERS" in result["error"]


def test_a_hotwire_layer_the_model_lacks_stops_the_engine_at_start(tiny_model, capfd):
    """HOTWIRE_LAYERS naming layer 9 of a 4-layer model is a configuration error: the engine does not start, and
    the log says what to fix (rather than refusing every request later)."""
    from vllm import LLM

    saved = os.environ.get("HOTWIRE_LAYERS")
    os.environ["HOTWIRE_LAYERS"] = "2,9"
    try:
        with pytest.raises(Exception):
            LLM(str(tiny_model), **engine_kwargs())
    finally:
        os.environ.pop("HOTWIRE_LAYERS") if saved is None else os.environ.update(HOTWIRE_LAYERS=saved)
    captured = capfd.readouterr()
    log = captured.out + captured.err  # the worker's error goes through vLLM's logger
    assert "HOTWIRE_LAYERS=2,9 names layer 9, but the model has 4 decoder layers (0-3)" in log, log[-3000:]
