"""Quantized serving: steering adds ``scale * v`` to the residual stream of a quantized model as exactly as the
format allows, and plain requests are bit-identical to a plugin-free engine of the same configuration.

- GPTQ 4-bit (``hotwire_core.tiny_gptq``: a real AutoGPTQ checkpoint with random values): the reference is
  transformers on the weights the checkpoint decodes to, so the only difference left is the kernels' own rounding
  (bf16 activations), measured on the plain request. CPU (vLLM's CPUWNA16 kernel) and GPU (Marlin).
- FP8 weights (``quantization="fp8"``, quantized when loaded) and an FP8 KV cache (``kv_cache_dtype="fp8"``):
  GPU only. Their reference is transformers on the unquantized weights; the plain request's difference to it is the
  format's error, and the steered request's must stay at that level while the steering moves logprobs far more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hf_reference
from engine_results import engine_kwargs, run_batches, run_in_subprocess

pytestmark = pytest.mark.integration
ON_GPU = torch.cuda.is_available()
LAYER, SCALE = 1, 4.0
PROMPT = "The quick brown fox jumps over the lazy dog. Steering vectors nudge the residual stream"
GREEDY = dict(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True, prompt_logprobs=0)

# name -> (engine arguments over engine_kwargs(), the checkpoint: "gptq" or "float", GPU only)
CONFIGS = {
    "gptq-4bit": ({"dtype": "bfloat16"}, "gptq", False),
    "fp8-weights": ({"quantization": "fp8"}, "float", True),
    "fp8-kv-cache": ({"kv_cache_dtype": "fp8"}, "float", True),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_model, model_root) -> dict[str, tuple[Path, Path]]:
    """checkpoint kind -> (the folder vLLM serves, the folder transformers computes the reference on)."""
    from hotwire_core.tiny_gptq import build_gptq_model

    return {"gptq": build_gptq_model(tiny_model, model_root / "qwen3-tiny-gptq"), "float": (tiny_model, tiny_model)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request, checkpoints, tmp_path_factory):
    """(config name, engine, its arguments, the reference folder, the prompt ids, the steering vector)."""
    from transformers import AutoTokenizer
    from vllm import LLM

    from hotwire_core.offline import register_vector

    overrides, kind, gpu_only = CONFIGS[request.param]
    if gpu_only and not ON_GPU:
        pytest.skip(f"{request.param} runs on the GPU (benchmarks/gpu_checks.sh quantized)")
    if kind == "gptq" and not ON_GPU and not _cpu_build_has_wna16():
        pytest.skip("vLLM's CPU build for this processor (AVX2, no AVX-512) has no 4-bit GPTQ kernel (cpu_gemm_wna16)")
    served_dir, reference_dir = checkpoints[kind]
    kwargs = {**engine_kwargs(), **overrides}
    llm = LLM(str(served_dir), **kwargs)
    vector = torch.randn(llm.llm_engine.model_config.get_hidden_size(), generator=torch.Generator().manual_seed(7))
    register_vector(llm, "v", vector)
    ids = AutoTokenizer.from_pretrained(str(served_dir))(PROMPT).input_ids
    yield request.param, llm, {"model": str(served_dir), **kwargs}, reference_dir, ids, vector
    llm.llm_engine.engine_core.shutdown()


def _cpu_build_has_wna16() -> bool:
    """Whether the vLLM CPU kernels loaded on this processor include CPUWNA16's GEMM: vLLM 0.25.1 loads its
    AVX-512 build where the CPU has AVX-512, else its AVX2 build, which lacks it."""
    import vllm._custom_ops  # noqa: F401  (loads the kernels for this processor)

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def _steer() -> dict:
    return {"hotwire": json.dumps({"id": "v", "layer": LAYER, "scale": SCALE})}


def test_steering_is_exact_within_the_formats_rounding(served):
    name, llm, _, reference_dir, ids, vector = served
    hf = hf_reference.load(reference_dir)
    expected = hf_reference.prompt_logprobs(hf, ids, [(LAYER, vector, SCALE, False)])
    plain_expected = hf_reference.prompt_logprobs(hf, ids)
    plain, steered = run_batches(llm, [[{"prompt_token_ids": ids, "params": GREEDY}],
                                       [{"prompt_token_ids": ids, "params": {**GREEDY, "extra_args": _steer()}}]])
    plain_err = (torch.tensor(plain[0]["prompt_logprobs"][1:]) - plain_expected).abs().max().item()
    steered_err = (torch.tensor(steered[0]["prompt_logprobs"][1:]) - expected).abs().max().item()
    effect = (expected - plain_expected).abs().max().item()
    tolerance = max(2e-3, 2 * plain_err)  # the format's (and the dtype's) own error, seen on the plain request
    print(f"{name}: plain error {plain_err:.3g}, steered error {steered_err:.3g}, steering effect {effect:.3g}")
    assert plain_err < 0.25, f"{name}: plain vLLM is far from the reference ({plain_err}): a wrong reference?"
    assert steered_err <= tolerance, f"{name}: steered vLLM differs from transformers + hook by {steered_err}"
    assert effect > 5 * tolerance, f"{name}: the steering is too weak to be told from the format's error ({effect})"


def test_plain_requests_equal_a_plugin_free_engine(served, tmp_path):
    """Plain requests alone and beside a steered one, against the same configuration without hotwire."""
    name, llm, kwargs, _, ids, _ = served
    other = ids[::-1]
    plain = {"params": {**GREEDY, "prompt_logprobs": None}}
    batches = [[{"prompt_token_ids": ids, **plain}, {"prompt_token_ids": other, **plain}]]
    mixed = [[{"prompt_token_ids": ids, **plain},
              {"prompt_token_ids": other, "params": {**plain["params"], "extra_args": _steer()}}]]
    (ours,) = run_batches(llm, batches)
    (beside_steered,) = run_batches(llm, mixed)
    model = kwargs.pop("model")
    (theirs,) = run_in_subprocess(Path(model), batches, tmp_path, overrides=kwargs)
    # vLLM's CPU backend jitters by an ulp between runs in float32 (test_engine.py's assert_same); bf16 hides that
    exact = ON_GPU or kwargs.get("dtype") == "bfloat16"
    for got, want, what in ((ours[0], theirs[0], "alone"), (ours[1], theirs[1], "alone, second"),
                            (beside_steered[0], theirs[0], "beside a steered request")):
        assert got["token_ids"] == want["token_ids"], f"{name}: {what}: other tokens than plugin-free vLLM"
        worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
        assert got["logprobs"] == want["logprobs"] if exact else worst < 1e-5, f"{name}: {what}: differs by {worst}"
    assert beside_steered[1]["logprobs"] != theirs[1]["logprobs"], f"{name}: the steered batchmate was not steered"
