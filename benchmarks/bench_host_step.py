"""Host time hotwire's worker adds to one decode step (no GPU needed; the per-step work is NumPy on the host).

Per step, a worker runs ``WorkerSteering.on_step`` (new and finished requests), ``steers_any`` (the step's graph
variant) and ``fill`` (``token_cfg``). This times the three on a steady decode batch of B requests, none or
every one steered (one vector at one layer), on a CPU device (the fill's device copy then is a host copy too).

    python benchmarks/bench_host_step.py --batches 1,64,256
"""

from __future__ import annotations

import argparse
import platform
import timeit
from types import SimpleNamespace

import numpy as np
import torch

from hotwire_core.controller import BINDING_KEY
from hotwire_core.runtime import WorkerSteering
from hotwire_core.settings import Settings
from hotwire_core.tiny_model import SHAPES


def per_step_us(batch: int, steered: bool, shape: str, steps: int) -> float:
    s = SHAPES[shape]
    w = WorkerSteering({}, s.num_layers, s.hidden_size, torch.bfloat16, torch.device("cpu"), 8192, batch,
                       Settings(256, 4, "op", None, None))
    ids = [f"cmpl-{i:032x}-0" for i in range(batch)]  # vLLM-like request ids
    if steered:
        binding = {"d": [[s.num_layers // 2, 1, 2.0, 0.0]]}
        new = [SimpleNamespace(req_id=r, prompt_token_ids=list(range(32)),
                               sampling_params=SimpleNamespace(extra_args={BINDING_KEY: binding})) for r in ids]
        w.on_step(SimpleNamespace(scheduled_new_reqs=new), set())
    scheduled, computed, no_news = np.ones(batch, np.int32), np.full(batch, 32, np.int32), SimpleNamespace(scheduled_new_reqs=[])
    batch_set = set(ids)

    def step() -> None:
        computed[:] += 1
        w.on_step(no_news, ())
        w.steers_any(batch_set)
        w.fill(ids, scheduled, computed, batch)

    step()
    return timeit.timeit(step, number=steps) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--shape", default="qwen3-4b")
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, shape {args.shape}")
    print("| batch | idle (µs/step) | every request steered (µs/step) |\n|---|---|---|")
    for b in (int(x) for x in args.batches.split(",")):
        print(f"| {b} | {per_step_us(b, False, args.shape, args.steps):.1f} | {per_step_us(b, True, args.shape, args.steps):.1f} |")


if __name__ == "__main__":
    main()
