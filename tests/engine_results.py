"""The tests' engine arguments, and prompts through vLLM in-process or in a clean subprocess (the runner of
:mod:`hotwire_core.verify.plugin_free`, re-exported: ``run_batches``; ``summarize`` from its glue).

``run_vanilla`` runs the same batches in a fresh interpreter with ``VLLM_PLUGINS=""`` so no hotwire hook is
installed anywhere: the reference for "bit-identical to a server without hotwire"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hotwire_core.verify.plugin_free import run_batches, run_engine
from hotwire_core.vllm_glue.offline import summarize

__all__ = ["engine_kwargs", "run_batches", "run_in_subprocess", "run_vanilla", "summarize"]


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
