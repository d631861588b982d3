"""Which numeric path does each engine take on verify's plain requests? A control for verify's check (e) at
tensor parallel 2, where plugin-free engines have disagreed with each other on a 72-token prefill.

    python benchmarks/tp2_identity.py --engines vanilla,vanilla,hotwire,verify [--runner v1] [--out DIR]

All engines start at the same time on the same GPUs (tensor parallel 2 by default), each in its own process with
its own compile cache, with no kernel choice left to timing (``verify.UNTIMED_INDUCTOR``), and run exactly the plain requests verify compares (its
short prompts, then its two 72-token prompts alone). Engine kinds:

- ``vanilla``: no plugin loaded (``VLLM_PLUGINS=""``);
- ``hotwire``: hotwire loaded, nothing ever steered;
- ``vanilla-history``, ``hotwire-history``: the same, but each compared request runs where it runs in verify,
  after verify's earlier requests (``verify.plain_history``: its steered ones here plain);
- ``verify``: ``python -m hotwire_core.verify --save-plain``: hotwire, with verify's steered requests between
  the plain ones;
- a ``+nocar`` suffix (every kind but ``verify``) turns vLLM's custom all-reduce off (``disable_custom_all_reduce``).

Prints, for every request, the groups of engines whose results are bit-identical; an engine that failed or
compared other prompts (e.g. another KV block size) is left out and named. Run on the device after
``source .gpu/env.sh``; logs and results go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from hotwire_core.cpu_env import with_cpu_env
from hotwire_core.verify import checks, runs

KINDS = ("vanilla", "hotwire", "vanilla-history", "hotwire-history", "verify")


def groups(results: list[list[checks.Result]], request: int) -> list[list[int]]:
    """Engines (indices) grouped by bit-identical results for ``request``, in order of first appearance."""
    found: list[list[int]] = []
    for engine, result in enumerate(results):
        for group in found:
            first = results[group[0]][request]
            if (first.token_ids, first.logprobs) == (result[request].token_ids, result[request].logprobs):
                group.append(engine)
                break
        else:
            found.append([engine])
    return found


def command(kind: str, job: Path, model: str, out: Path, args: argparse.Namespace, on_gpu: bool) -> list[str]:
    """The engine's command line; all but ``verify`` run ``job`` in verify's plugin-free child."""
    if kind == "verify":
        return [sys.executable, "-m", "hotwire_core.verify", "--model", model, "--dtype", args.dtype,
                "--tensor-parallel-size", str(args.tensor_parallel_size), "--runner", args.runner,
                "--save-plain", str(out), *(["--kv-cache-gib", "1"] if on_gpu else [])]
    return [sys.executable, "-m", "hotwire_core.verify", "--vanilla-job", str(job), str(out)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="vanilla,vanilla,hotwire,verify")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v1", help="vLLM's model runner (default v1)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/tp2-identity"))
    args = parser.parse_args()
    engines = args.engines.split(",")
    for name in engines:
        kind, _, variant = name.partition("+")
        if kind not in KINDS or variant not in ("", "nocar") or (kind == "verify" and variant):
            parser.error(f"unknown engine {name!r}: one of {KINDS}, with +nocar for all but verify")

    import torch
    from transformers import AutoTokenizer

    from hotwire_core.tiny_model import ModelShape, build_model

    on_gpu = torch.cuda.is_available()  # on the CPU (a smoke test) the engines take verify's CPU settings
    args.out.mkdir(parents=True, exist_ok=True)
    model = str(build_model(args.out / "model", ModelShape(arch="qwen3")))
    tokenizer = AutoTokenizer.from_pretrained(model)
    short = [tokenizer.encode(p) for p in runs.PROMPTS]
    block = 16 if on_gpu else 128  # vLLM's default block size (CUDA, CPU), which verify's engine keeps
    x, y = (runs.long_prompt(tokenizer, text, runs.PREFIX_BLOCKS * block + block // 2) for text in runs.LONG_TEXTS)
    batches = runs.plain_batches(short, x, y)
    base = runs.engine_kwargs(model, args.dtype, args.tensor_parallel_size, 1.0 if on_gpu else None, untimed=on_gpu)

    env_all = {**(dict(os.environ) if on_gpu else with_cpu_env(os.environ)), "HF_HUB_OFFLINE": "1",
               "VLLM_USE_V2_MODEL_RUNNER": "1" if args.runner == "v2" else "0"}
    procs, outs = [], [args.out / f"out{i}.json" for i in range(len(engines))]
    for i, name in enumerate(engines):
        kind, _, variant = name.partition("+")
        outs[i].unlink(missing_ok=True)  # an earlier run's results must not stand in for a failed engine
        job = args.out / f"job{i}.json"
        if kind != "verify":
            engine = {**base, **({"disable_custom_all_reduce": True} if variant == "nocar" else {})}
            steps = runs.plain_history(short, x, y) if kind.endswith("-history") else runs.as_steps(batches)
            job.write_text(json.dumps({"engine": engine, "steps": steps, "plugin_free": kind.startswith("vanilla")}))
        env = {**env_all, "VLLM_CACHE_ROOT": str(args.out / f"cache{i}")}
        if kind.startswith("vanilla"):
            env["VLLM_PLUGINS"] = ""
        else:
            env.pop("VLLM_PLUGINS", None)
        with open(args.out / f"log{i}-{name}", "w") as log:
            procs.append(subprocess.Popen(command(kind, job, model, outs[i], args, on_gpu), env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    ran, results = [], []
    for i, (name, code) in enumerate(zip(engines, codes)):
        saved = runs.load_results(outs[i]) if code == 0 and outs[i].exists() else None
        same_prompts = saved is not None and saved[0] == batches
        print(f"engine {i} {name}: exit {code}" + ("" if saved else " (no results)")
              + ("" if same_prompts or not saved else " (other prompts than the rest: left out)"))
        if same_prompts:
            ran.append(i)
            results.append(saved[1])
    names = [f"{i}:{engines[i]}" for i in ran]
    lengths = [len(prompt) for prompts, _ in batches for prompt in prompts]
    for request in range(len(results[0]) if results else 0):
        found = groups(results, request)
        parts = " | ".join("{" + ", ".join(names[e] for e in group) + "}" for group in found)
        spread = max(checks.max_abs_diff(results[g[0]][request].logprobs, results[found[0][0]][request].logprobs)
                     for g in found)
        print(f"request {request} ({lengths[request]}-token prompt): {len(found)} outcome(s) {parts}"
              + (f", max |dlogprob| to the first {spread:.3g}" if len(found) > 1 else ""))
    return 0 if len(ran) == len(engines) else 1


if __name__ == "__main__":
    sys.exit(main())
