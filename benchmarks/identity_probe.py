"""Do unsteered requests come out bit-identical with and without hotwire loaded?

Runs the same plain prompts through vanilla vLLM (``VLLM_PLUGINS=""``) and through vLLM with hotwire, each in a
fresh process, under several execution modes, and prints the largest logprob difference per mode. A difference
that appears compiled but not eager points at compilation (fusion) rather than at the steering op itself.

    python benchmarks/identity_probe.py --model DIR --dtype bfloat16 --modes compiled,eager
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODES = {
    "compiled": {},
    "eager": {"enforce_eager": True},
    "compiled_nographs": {"compilation_config": {"cudagraph_mode": "NONE"}},
}


def worker(model: str, dtype: str, mode: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_model_len=512, max_num_seqs=8, seed=0, gpu_memory_utilization=0.3, **MODES[mode])
    texts = ["Hello world, this is", "The quick brown fox jumps over", "Once upon a time there was"]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    out = []
    for o in llm.generate(texts, params, use_tqdm=False):
        c = o.outputs[0]
        out.append([d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
                   + [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
    print("RESULT " + json.dumps(out), flush=True)


def run(model: str, dtype: str, mode: str, plugins: bool) -> list[list[float]]:
    env = dict(os.environ)
    if plugins:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""
    proc = subprocess.run([sys.executable, __file__, "--worker", "--model", model, "--dtype", dtype, "--modes", mode],
                          env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(proc.stderr[-3000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", default="compiled,eager")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.model, args.dtype, args.modes)
    for mode in args.modes.split(","):
        vanilla, ours = run(args.model, args.dtype, mode, False), run(args.model, args.dtype, mode, True)
        diff = max(abs(a - b) for va, oa in zip(vanilla, ours) for a, b in zip(va, oa))
        print(f"{mode}: max |logprob(vanilla) - logprob(hotwire)| over plain requests = {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
