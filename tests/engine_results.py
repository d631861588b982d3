"""The tests' engine arguments, and prompts through vLLM in-process or in a clean subprocess (the runner of
:mod:`hotwire_core.verify.plugin_free`, re-exported: ``run_batches``; ``summarize`` from its glue).

``run_vanilla`` runs the same batches in a fresh interpreter with ``VLLM_PLUGINS=""`` so no hotwire hook is
installed anywhere: the reference for "bit-identical to a server without hotwire"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hotwire_core.verify.plugin_free import run_batches, run_engine
from hotwire_core.vllm_glue.offline import summarize

__all__ = ["engine_kwargs", "run_batches", "run_in_subprocess", "run_vanilla", "summarize", "vllm_batch_variance"]


def engine_kwargs() -> dict[str, Any]:
    """float32 on the CPU (exact comparisons with transformers); bf16 with graphs on a GPU, with a fixed KV cache
    (no memory profiling, which miscounts when other engines share the GPU: the vanilla reference beside the
    engine under test, or other checks run at the same time) and no kernel choice left to timing (engines
    compared bit for bit compile separately: ``verify.UNTIMED_INDUCTOR``
    from ``benchmarks/gpu_checks.sh``)."""
    import torch

    from hotwire_core.verify import untimed_compilation_config

    common = dict(max_model_len=512, max_num_seqs=8, block_size=32, seed=0)
    if torch.cuda.is_available():
        return {**common, "dtype": "bfloat16", "gpu_memory_utilization": 0.05, "kv_cache_memory_bytes": 1 << 30,
                "compilation_config": untimed_compilation_config()}
    return {**common, "dtype": "float32"}


def run_in_subprocess(
    model_dir: Path,
    batches: list[list[dict]],
    workdir: Path,
    *,
    plugins: bool = False,
    vectors: dict[str, list[float]] | None = None,
    overrides: dict[str, Any] | None = None,
) -> list[list[dict]]:
    """Run ``batches`` in a fresh interpreter with this module's engine arguments (``overrides`` over them):
    plugin-free by default (the reference for "bit-identical to vLLM without hotwire"), or with hotwire and
    ``vectors`` registered first. The runner is ``verify``'s (:mod:`hotwire_core.verify.plugin_free`)."""
    engine = {"model": str(model_dir), **engine_kwargs(), **(overrides or {})}
    return run_engine(engine, batches, workdir, plugin_free=not plugins, vectors=vectors)


def run_vanilla(model_dir: Path, batches: list[list[dict]], workdir: Path) -> list[list[dict]]:
    return run_in_subprocess(model_dir, batches, workdir)


_BATCH_VARIANCE: dict[str, str | None] = {}  # model folder -> vllm_batch_variance's answer, once per process


def vllm_batch_variance(model_dir: Path, workdir: Path) -> str | None:
    """On the CPU: why plugin-free vLLM itself gives one request other logprobs beside batchmates of other contents
    (the reason a test comparing a plain batchmate of hotwire's requests with it bit for bit cannot pass), or None
    where it does not. vLLM 0.25.1's AVX2 CPU kernels (a processor without AVX-512) round a row by one float32 step
    differently with its batchmates' contents; its AVX-512 ones and the GPU's graphs (not checked: None) do not."""
    import torch

    if torch.cuda.is_available():
        return None
    if str(model_dir) not in _BATCH_VARIANCE:
        params = dict(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)
        probe = {"prompt_token_ids": list(range(100, 140)), "params": params}

        def batch(start: int) -> list[dict]:  # three batchmates of the same lengths, other tokens, then the probe
            return [*({"prompt_token_ids": list(range(start + 7 * i, start + 30 + 7 * i)), "params": params}
                      for i in range(3)), probe]  # fmt: skip

        (workdir / "batch-variance").mkdir(parents=True, exist_ok=True)
        first, second = (r[-1]["logprobs"] for r in run_in_subprocess(model_dir, [batch(200), batch(300)],
                                                                         workdir / "batch-variance"))
        _BATCH_VARIANCE[str(model_dir)] = None if first == second else (
            "plugin-free vLLM itself gives a request other logprobs beside batchmates of other contents on this "
            f"processor ({max(abs(a - b) for a, b in zip(first, second)):.1e} apart; vLLM's AVX2 CPU kernels): a "
            "plain batchmate of hotwire's requests cannot equal it bit for bit here")
    return _BATCH_VARIANCE[str(model_dir)]
