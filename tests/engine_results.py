"""The tests' engine arguments, and prompts through vLLM in-process or in a clean subprocess (the runner of
:mod:`hotwire_core.verify.plugin_free`, re-exported: ``run_batches``; ``summarize`` from its glue).

``run_vanilla`` runs the same batches in a fresh interpreter with ``VLLM_PLUGINS=""`` so no hotwire hook is
installed anywhere: the reference for "bit-identical to a server without hotwire"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hotwire_core.verify.plugin_free import run_batches, run_engine
from hotwire_core.vllm_glue.offline import summarize

__all__ = ["CPU_REPEAT_TOLERANCE", "assert_same_result", "engine_kwargs", "max_diff", "run_batches", "run_in_subprocess",
           "run_vanilla", "same_on_repeat", "same_with_cache_hit", "summarize"]


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


def max_diff(a: list, b: list) -> float:
    """The largest difference between two lists of logprobs of equal length (positions without one skipped)."""
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b) if x is not None and y is not None), default=0.0)


# vLLM's CPU backend is not bit-reproducible between two runs of one request in one engine either (2 of 7 repeats
# of a batch differed by ~5e-7 on an earlier development VM): repeats compare to float32 rounding on every CPU.
CPU_REPEAT_TOLERANCE = 1e-5


def same_on_repeat(a: list, b: list) -> bool:
    """Two runs of one request in one engine agree: bit for bit on a GPU, within ``CPU_REPEAT_TOLERANCE`` on a CPU."""
    import torch

    return a == b if torch.cuda.is_available() else max_diff(a, b) < CPU_REPEAT_TOLERANCE


def same_with_cache_hit(hit: list, full: list) -> bool:
    """A request that read part of its prompt from the prefix cache agrees with the same request computed whole. It
    computes only the rest: on a GPU other GEMM shapes round differently (seen: 4e-6), exactly as in vLLM without
    hotwire, so within 1e-3 there; within ``CPU_REPEAT_TOLERANCE`` on a CPU."""
    import torch

    return max_diff(hit, full) < (1e-3 if torch.cuda.is_available() else CPU_REPEAT_TOLERANCE)


# vLLM's AVX2 CPU kernels are not reproducible: plugin-free vLLM gave one request logprobs 4.8e-7 apart between two
# fresh engines running the same batches (run AJ) and beside batchmates of other contents (run AI).
AVX2_TOLERANCE = 1e-5


def vllm_runs_avx2_kernels() -> bool:
    """Whether vLLM runs its AVX2 CPU kernels here: an x86 processor without AVX-512, by vLLM's own test
    (``CpuPlatform.import_kernels``)."""
    import platform

    import torch

    return not torch.cuda.is_available() and platform.machine() == "x86_64" and not torch.cpu._is_avx512_supported()


def assert_same_result(ours: dict, theirs: dict, what: str) -> None:
    """Two :func:`summarize`d results of one request are the same: the same tokens, and logprobs bit for bit; where
    vLLM runs its AVX2 CPU kernels, within ``AVX2_TOLERANCE`` (the GPU and AVX-512 CPUs compare bit for bit), still
    far below what steering, a capture or a readout leaking into a request would change. ``what`` names the pair in
    the failure: "batch 1, request 0 against vLLM without hotwire"."""
    assert ours["token_ids"] == theirs["token_ids"], f"{what}: the tokens differ"
    exact = not vllm_runs_avx2_kernels()
    for key in ("logprobs", "prompt_logprobs"):
        if exact:
            assert ours[key] == theirs[key], f"{what}: the {key} differ"
            continue
        pairs = [(a, b) for a, b in zip(ours[key] or [], theirs[key] or [], strict=True) if (a, b) != (None, None)]
        apart = max((abs(a - b) for a, b in pairs), default=0.0)
        assert apart <= AVX2_TOLERANCE, f"{what}: the {key} are {apart:.1e} apart (vLLM's AVX2 kernels)"
