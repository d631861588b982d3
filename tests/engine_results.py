"""Running prompts through vLLM and summarising what came back, in-process or in a clean subprocess.

``run_vanilla`` runs the same batches in a fresh interpreter with ``VLLM_PLUGINS=""`` so no hotwire code is
loaded anywhere: the reference for "bit-identical to a server without hotwire"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


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


def summarize(output: Any) -> dict:
    """Token ids, the sampled tokens' logprobs, prompt logprobs and cache hits of one RequestOutput."""
    completion = output.outputs[0]
    prompt_lp = [None if d is None else d[t].logprob for d, t in zip(output.prompt_logprobs or [], output.prompt_token_ids)]
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": [d[t].logprob for d, t in zip(completion.logprobs or [], completion.token_ids)],
        "prompt_logprobs": prompt_lp,
        "finish_reason": completion.finish_reason,
        "num_cached_tokens": output.num_cached_tokens,
    }


def run_batches(llm: Any, batches: list[list[dict]]) -> list[list[dict]]:
    """Each batch is a list of ``{"prompt_token_ids": [...], "params": {SamplingParams kwargs}}``."""
    from vllm import SamplingParams

    results = []
    for batch in batches:
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in batch]
        params = [SamplingParams(**r["params"]) for r in batch]
        results.append([summarize(o) for o in llm.generate(prompts, params, use_tqdm=False)])
    return results


def run_in_subprocess(
    model_dir: Path,
    batches: list[list[dict]],
    workdir: Path,
    *,
    plugins: bool = False,
    vectors: dict[str, list[float]] | None = None,
    overrides: dict[str, Any] | None = None,
) -> list[list[dict]]:
    """Run ``batches`` in a fresh interpreter. ``plugins=False`` sets ``VLLM_PLUGINS=""``: no hotwire code is
    loaded anywhere (the reference for "bit-identical to vLLM without hotwire"); otherwise ``vectors`` are
    registered first. ``overrides`` change the engine arguments (e.g. the dtype)."""
    tag = "hotwire" if plugins else "vanilla"
    job, out = workdir / f"{tag}-job.json", workdir / f"{tag}-out.json"
    job.write_text(json.dumps({"model": str(model_dir), "batches": batches, "vectors": vectors or {}, "overrides": overrides or {}}))
    env = dict(os.environ)
    if plugins:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""
    proc = subprocess.run([sys.executable, __file__, str(job), str(out)], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{tag} vLLM run failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def run_vanilla(model_dir: Path, batches: list[list[dict]], workdir: Path) -> list[list[dict]]:
    return run_in_subprocess(model_dir, batches, workdir)


def _main(job_path: str, out_path: str) -> None:
    import torch
    from vllm import LLM

    job = json.loads(Path(job_path).read_text())
    llm = LLM(job["model"], **{**engine_kwargs(), **job["overrides"]})
    if job["vectors"]:
        from hotwire_core.offline import register_vector

        for name, values in job["vectors"].items():
            register_vector(llm, name, torch.tensor(values))
    Path(out_path).write_text(json.dumps(run_batches(llm, job["batches"])))


if __name__ == "__main__":
    _main(*sys.argv[1:3])
