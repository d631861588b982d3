"""Do unsteered requests come out bit-identical with and without hotwire loaded, and is vLLM itself
reproducible between two engine starts?

Runs the same plain prompts through several fresh engines, one process each, and prints every run's largest
logprob difference to the first run. ``--runs vanilla,vanilla,hotwire`` gives a control: when two plugin-free
engines already differ, a difference to the hotwire engine is vLLM's run-to-run variation, not hotwire's. Under
several execution modes, a difference that appears compiled but not eager points at compilation (fusion) rather
than at the steering op itself. Each engine's log is kept in ``--log-dir``.

    python benchmarks/identity_probe.py [--model DIR] --dtype bfloat16 --modes compiled,eager \\
        --runs vanilla,vanilla,hotwire [--tensor-parallel-size 2] [--log-dir DIR]

Without ``--model`` it builds the built-in tiny Qwen3 model with random weights (as ``hotwire_core.verify`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = {
    "compiled": {},
    "eager": {"enforce_eager": True},
    "compiled_nographs": {"compilation_config": {"cudagraph_mode": "NONE"}},
}
KINDS = ("vanilla", "hotwire")
TEXTS = ["Hello world, this is", "The quick brown fox jumps over", "Once upon a time there was"]


def worker(model: str, dtype: str, mode: str, tensor_parallel: int) -> None:
    from vllm import LLM, SamplingParams

    # A fixed KV cache skips vLLM's memory profiling, which fails when other processes on the GPU free memory.
    llm = LLM(model, dtype=dtype, max_model_len=512, max_num_seqs=8, seed=0, kv_cache_memory_bytes=1 << 30,
              gpu_memory_utilization=0.05, tensor_parallel_size=tensor_parallel, **MODES[mode])
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    out = []
    for o in llm.generate(TEXTS, params, use_tqdm=False):
        c = o.outputs[0]
        out.append([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
                   + [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
    print("RESULT " + json.dumps(out), flush=True)


def run(args: argparse.Namespace, model: str, mode: str, kind: str, log: Path) -> list[list[float]]:
    """One engine in a fresh process; its logprobs. ``kind`` vanilla runs with ``VLLM_PLUGINS=""``."""
    # Its own compile cache: a second engine with the same config would otherwise load the first one's graphs.
    env = {**os.environ, "VLLM_CACHE_ROOT": str(log.with_suffix(".cache"))}
    if kind == "hotwire":
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""
    command = [sys.executable, __file__, "--worker", "--model", model, "--dtype", args.dtype, "--modes", mode,
               "--tensor-parallel-size", str(args.tensor_parallel_size)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{kind} engine ({mode}) failed, log in {log}:\n{proc.stderr[-3000:]}")


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder; default: the built-in tiny Qwen3 with random weights")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", default="compiled,eager", help=f"comma-separated, of {sorted(MODES)}")
    parser.add_argument("--runs", default="vanilla,hotwire",
                        help="comma-separated engines per mode, compared with the first: vanilla or hotwire")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--log-dir", help="where each engine's log goes (default: a temporary folder)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.model, args.dtype, args.modes, args.tensor_parallel_size)
    runs = args.runs.split(",")
    if len(runs) < 2 or any(kind not in KINDS for kind in runs):
        parser.error(f"--runs needs at least two of {KINDS}")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="hotwire-identity-probe-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from hotwire_core.tiny_model import ModelShape, build_model

        model = str(build_model(log_dir / "tiny-model", ModelShape(arch="qwen3")))
    print(f"model {model}, tensor parallel {args.tensor_parallel_size}, logs in {log_dir}", flush=True)
    for mode in args.modes.split(","):
        results = [run(args, model, mode, kind, log_dir / f"{mode}-{i}-{kind}.log") for i, kind in enumerate(runs)]
        for i, (kind, result) in enumerate(zip(runs[1:], results[1:]), start=1):
            print(f"{mode}: max |logprob(run 0, {runs[0]}) - logprob(run {i}, {kind})| over plain requests = "
                  f"{max_diff(results[0], result):.3g}", flush=True)


if __name__ == "__main__":
    main()
