"""Host time hotwire's worker adds to one decode step (no GPU needed; the per-step work is NumPy on the host).

Per step, a worker runs ``WorkerSteering.on_step`` (new and finished requests, read from the scheduler output by
``vllm_glue.runners.step_of``), ``step_kinds`` (the step's graph variant) and ``fill`` (``token_cfg``). This times
the three on a decode batch of B requests, on a CPU device (the device copies then are host copies too), in four
modes:

- ``idle``: nothing steered, the batch unchanged from step to step;
- ``steered``: every request steered by one vector at one layer, the batch unchanged (a steady decode step);
- ``churn``: as ``steered``, but in every step one request finishes and a new one, steered the same way, takes
  its place in the batch with its whole prompt (a server at a full batch: some request finishes in most steps);
- ``churn-distinct``: as ``churn``, each new request with a config of its own (its own vector).

With ``--capture`` the worker is built as under ``HOTWIRE_CAPTURE=1`` (capture buffers and hooks on every layer) and
nobody captures: what capture being possible adds to steps without a capture.

    python benchmarks/bench_host_step.py --batches 1,64,256 [--capture]
"""

from __future__ import annotations

import argparse
import platform
import timeit
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

from hotwire_core.controller import BINDING_KEY
from hotwire_core.runtime import WorkerSteering
from hotwire_core.settings import Settings
from hotwire_core.tiny_model import SHAPES
from hotwire_core.vllm_glue.runners import step_of

MODES = ("idle", "steered", "churn", "churn-distinct")
PROMPT = 32  # prompt tokens of every request


class _Layer(torch.nn.Module):
    """A stand-in decoder layer: the hook is attached, never run."""


def decode_step(batch: int, mode: str, shape: str, capture: bool = False) -> Callable[[], None]:
    """One step of ``mode`` on a worker holding a decode batch of ``batch`` requests (see the module doc)."""
    s = SHAPES[shape]
    layers = {i: _Layer() for i in range(s.num_layers)} if capture else {}
    w = WorkerSteering(layers, s.num_layers, s.hidden_size, torch.bfloat16, torch.device("cpu"), 8192, batch,
                       Settings(256, 4, "op", None, None, capture=capture))
    layer = s.num_layers // 2

    def request(n: int) -> SimpleNamespace:
        slot = 1 + (n % 256 if mode == "churn-distinct" else 0)
        binding = {"d": [[layer, slot, 2.0, 0.0]]}
        return SimpleNamespace(req_id=f"cmpl-{n:032x}-0", prompt_token_ids=list(range(PROMPT)),  # vLLM-like ids
                               sampling_params=SimpleNamespace(extra_args={BINDING_KEY: binding}))

    ids = [f"cmpl-{n:032x}-0" for n in range(batch)]
    if mode != "idle":
        w.on_step(step_of(SimpleNamespace(scheduled_new_reqs=[request(n) for n in range(batch)]), set()))
    scheduled, computed = np.ones(batch, np.int32), np.full(batch, PROMPT, np.int32)
    no_news = SimpleNamespace(scheduled_new_reqs=[])
    arrivals = iter(range(batch, 1 << 62))
    tokens = batch + (PROMPT - 1 if mode.startswith("churn") else 0)  # the runner's count of the step's tokens

    def step() -> None:
        computed[:] += scheduled
        scheduled[:] = 1
        if mode.startswith("churn"):
            n = next(arrivals)
            finished, ids[n % batch] = ids[n % batch], f"cmpl-{n:032x}-0"
            scheduled[n % batch], computed[n % batch] = PROMPT, 0  # the new request's prompt, in this step
            w.on_step(step_of(SimpleNamespace(scheduled_new_reqs=[request(n)]), (finished,)))
        else:
            w.on_step(step_of(no_news, ()))
        w.step_kinds(ids)
        w.fill(ids, scheduled, computed, tokens)

    step()
    step.worker = w  # type: ignore[attr-defined]  # for tests
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--shape", default="qwen3-4b")
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--capture", action="store_true", help="a worker with HOTWIRE_CAPTURE=1 (nobody captures)")
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}, shape {args.shape}"
          + (", HOTWIRE_CAPTURE=1" if args.capture else ""))
    print("| batch | " + " | ".join(f"{m} (µs/step)" for m in MODES) + " |\n|---|" + "---|" * len(MODES))
    for b in (int(x) for x in args.batches.split(",")):
        cells = [timeit.timeit(decode_step(b, m, args.shape, args.capture), number=args.steps) / args.steps * 1e6
                 for m in MODES]
        print(f"| {b} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
