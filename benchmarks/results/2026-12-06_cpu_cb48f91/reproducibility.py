"""Whether plugin-free vLLM 0.25.1 on the CPU gives the same results for the same batches in fresh engines.

The batches of ``tests/integration/test_lora.py``'s plugin-free reference (its mixed batch without steering, then
its two unsteered batches), run ``--runs`` times, each in a fresh plugin-free engine process with the test suite's
environment (``scripts/test.sh``: one OpenMP thread, float32); ``--no-lora``: the same prompts without the adapter
and without ``enable_lora``. Prints, per run after the first, each request's largest logprob difference from run 0.

    python benchmarks/results/2026-12-06_cpu_cb48f91/reproducibility.py --runs 3 [--no-lora]
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "integration")]
for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1", "HF_HUB_OFFLINE": "1",
                   "VLLM_NO_USAGE_STATS": "1", "VLLM_DISABLE_COMPILE_CACHE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "OMP_NUM_THREADS": "1", "HOTWIRE_STORE": "off", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}.items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import test_lora  # noqa: E402
from engine_results import run_in_subprocess  # noqa: E402
from hotwire_core.tiny_model import build_model  # noqa: E402
from lora_adapter import build_lora_adapter  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-lora", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reproducibility-"))
    model = build_model(work / "qwen3-tiny", "tiny")
    lora = None if args.no_lora else ["tiny-lora", 1, str(build_lora_adapter(model, work / "tiny-lora"))]
    tok = AutoTokenizer.from_pretrained(str(model))
    texts = {"fox": "The quick brown fox jumps over", "hello": "Hello world, this is",
             "once": "Once upon a time there was a tiny model that", "serve": "vLLM serves many requests"}
    prompts = {name: tok(text).input_ids for name, text in texts.items()}
    batches = [test_lora.mixed_batch(prompts, lora, steered=False), *test_lora.unsteered_batches(prompts, lora)]
    overrides = {} if args.no_lora else test_lora.LORA_ENGINE
    print(f"cpu avx512: {torch.cpu._is_avx512_supported()}; lora: {not args.no_lora}; "
          f"PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED')}; MKL_CBWR={os.environ.get('MKL_CBWR')}")
    runs = []
    for i in range(args.runs):
        (work / f"run{i}").mkdir()
        runs.append(run_in_subprocess(model, batches, work / f"run{i}", overrides=overrides))
        if i == 0:
            continue
        for b, batch in enumerate(runs[-1]):
            for r, result in enumerate(batch):
                first = runs[0][b][r]
                apart = max(abs(x - y) for key in ("logprobs", "prompt_logprobs")
                            for x, y in zip(result[key] or [], first[key] or []) if x is not None)
                tokens = "same tokens" if result["token_ids"] == first["token_ids"] else "OTHER TOKENS"
                print(f"run {i} batch {b} request {r}: {tokens}, logprobs {apart:.2e} from run 0", flush=True)


if __name__ == "__main__":
    main()
