"""Which part of a plain request's result moves under EAGLE speculation, and whether hotwire moves it: the tiny
Qwen3 (random weights) with the one-layer EAGLE head of ``tests/integration/test_speculative_eagle.py``, plain
requests only, in five fresh engines (the tests' engine arguments: bf16 and graphs on a GPU, where they run at once;
float32 on the CPU, one after the other):

    vanilla          plugin-free, no speculation
    vanilla-eagle    plugin-free, EAGLE
    hotwire-eagle    hotwire, EAGLE
    readout-eagle    hotwire with HOTWIRE_READOUT=1 and a vector registered (as the tests' engine), EAGLE
    hotwire          hotwire, no speculation

and prints, for each pair against ``vanilla-eagle`` and ``vanilla``, the largest difference in the sampled tokens'
logprobs and in the prompt logprobs, and whether the tokens are the same.

    python benchmarks/spec_probe.py --out spec_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "integration")]

# tests/speculation_cases.py's prompts
PROMPTS = (" ".join(["steering vectors nudge the residual stream"] * 4),
           "The quick brown fox jumps over the lazy dog. The quick brown fox")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--token", type=int, default=5, help="the token the EAGLE head always proposes")
    parser.add_argument("--out", type=Path, default=Path("spec_probe.json"))
    args = parser.parse_args()

    import os

    import torch
    from transformers import AutoTokenizer

    from engine_results import engine_kwargs, max_diff
    from hotwire_core.tiny_model import build_model
    from hotwire_core.verify.plugin_free import run_engine
    from test_speculative_eagle import build_eagle_head

    work = Path(tempfile.mkdtemp(prefix="hotwire-spec-probe-"))
    model = build_model(work / "qwen3-tiny", "tiny", weights=True)
    head = build_eagle_head(work / "eagle-head", model, args.token)
    tok = AutoTokenizer.from_pretrained(str(model))
    params = dict(max_tokens=24, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True)
    batches = [[{"prompt_token_ids": tok(p).input_ids, "params": params}] for p in PROMPTS]
    eagle = {"speculative_config": {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}}
    base = {"model": str(model), **engine_kwargs()}
    vector = {"v": torch.randn(256, generator=torch.Generator().manual_seed(11)).tolist()}  # (speculation_cases')
    engines = {  # name: (engine arguments, plugin-free, environment, vectors registered)
        "vanilla": (base, True, {}, None),
        "vanilla-eagle": ({**base, **eagle}, True, {}, None),
        "hotwire-eagle": ({**base, **eagle}, False, {}, None),
        "readout-eagle": ({**base, **eagle}, False, {"HOTWIRE_READOUT": "1"}, vector),
        "hotwire": (base, False, {}, None),
    }
    if not torch.cuda.is_available():
        from hotwire_core.cpu_env import with_cpu_env

        os.environ.update(with_cpu_env(os.environ))
    with ThreadPoolExecutor(len(engines) if torch.cuda.is_available() else 1) as pool:
        futures = {name: pool.submit(run_engine, kwargs, batches, work, plugin_free=free, env=env, tag=name,
                                     vectors=vectors)
                   for name, (kwargs, free, env, vectors) in engines.items()}  # fmt: skip
        results = {name: future.result() for name, future in futures.items()}
    rows = []
    for reference in ("vanilla-eagle", "vanilla"):
        for name in engines:
            if name == reference:
                continue
            for b, (ours, theirs) in enumerate(zip(results[name], results[reference])):
                got, want = ours[0], theirs[0]
                rows.append({"engine": name, "against": reference, "prompt": b,
                             "same_tokens": got["token_ids"] == want["token_ids"],
                             "logprobs": max_diff(got["logprobs"], want["logprobs"]),
                             "prompt_logprobs": max_diff(got["prompt_logprobs"], want["prompt_logprobs"])})
                print(json.dumps(rows[-1]), flush=True)
    args.out.write_text(json.dumps({"rows": rows, "results": results}, indent=1))


if __name__ == "__main__":
    main()
