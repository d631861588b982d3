"""Host time hotwire's hooks take inside a real vLLM engine (CPU or GPU), per engine step and per call.

``bench_host_step.py`` times the worker's per-step calls in isolation. This runs a real engine in this one
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor: engine core, scheduler and worker all
here) and times every vLLM method hotwire wraps (``vllm_glue``: engine core, scheduler, model runners, CUDA
graph wrappers) twice: the wrapper as a whole, and the vLLM method it calls (swapped into the wrapper's
closure). The difference is hotwire's own host work in that hook, the worker's ``fill`` and the controller's
admission included; it leaves out the model's forward (and on the CPU the op kernel inside it). The timing's
own calls are in the figures: a pass-through hook on vLLM methods hotwire leaves alone (``NULL_HOOKS``),
timed the same way, shows what any hook costs at that point of a step.

    python benchmarks/profile_host_step.py --batch 256            # the built-in tiny model on the CPU
    python benchmarks/profile_host_step.py --shape qwen3-4b --batch 256 --decode-tokens 128   # on a GPU

Runs on the CPU (V1 runner) and on a GPU (V2 by default; ``VLLM_USE_V2_MODEL_RUNNER=0`` selects V1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class HookTimer:
    """Seconds of hotwire's own work in one wrapper, per call: the wrapper's time less the vLLM method's inside.

    A hook may be re-entered from inside the method it wraps (V1's FULL-graph ``CUDAGraphWrapper`` runs the model,
    whose piecewise graphs have wrappers of their own): each call subtracts only the method it called itself."""

    def __init__(self, name: str):
        self.name = name
        self.step: Callable[[], int] = lambda: 0  # the engine step in progress (set by ``count_steps``)
        self.reset()

    def reset(self) -> None:
        self.own: list[float] = []
        self.steps: list[int] = []  # the engine step of each call
        self._frames: list[float] = []  # per call in progress: the time of the method it called so far

    def timed_wrapper(self, wrapper: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._frames.append(0.0)
            start = time.perf_counter()
            try:
                return wrapper(*args, **kwargs)
            finally:
                self.own.append(time.perf_counter() - start - self._frames.pop())
                self.steps.append(self.step())

        return timed

    def timed_original(self, original: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            caller = len(self._frames) - 1  # the call of the wrapper that runs this method
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if caller >= 0:
                    self._frames[caller] += time.perf_counter() - start

        return timed


def hotwire_hooks() -> Iterator[tuple[type, str, Any]]:
    """``(class, attribute, class-dict entry)`` for every method hotwire replaced in an imported vLLM module."""
    from hotwire_core.vllm_glue import PATCHES as _PATCHES

    for module_name in _PATCHES:
        module = sys.modules.get(module_name)
        for cls in vars(module).values() if module else ():
            if not isinstance(cls, type) or cls.__module__ != module_name:
                continue
            for name, entry in vars(cls).items():
                if getattr(getattr(entry, "__func__", entry), "_hotwire", False):
                    yield cls, name, entry


def time_hook(cls: type, name: str, entry: Any) -> HookTimer | None:
    """Time the hotwire hook ``entry`` (``cls.__dict__[name]``) and the vLLM method in its closure; None for a
    hook that holds the vLLM method one closure further in (graph capture's two passes: not per step)."""
    wrapper = getattr(entry, "__func__", entry)
    original = wrapper.__wrapped__
    cells = [c for c in wrapper.__closure__ or () if c.cell_contents is original]
    if len(cells) != 1:
        return None
    timer = HookTimer(f"{cls.__name__}.{name}")
    cells[0].cell_contents = timer.timed_original(original)
    timed = timer.timed_wrapper(wrapper)
    setattr(cls, name, staticmethod(timed) if isinstance(entry, staticmethod) else timed)
    return timer


def instrument() -> tuple[list[HookTimer], list[str]]:
    """Time every hotwire hook; also return the names of those left untimed."""
    timers, untimed = [], []
    for cls, name, entry in list(hotwire_hooks()):
        timer = time_hook(cls, name, entry)
        if timer is None:
            untimed.append(f"{cls.__name__}.{name}")
        else:
            timers.append(timer)
    return timers, untimed


# Parts of the worker's per-step work, each timed whole (what it calls included) inside the hooks that call it, whose
# figures hold it too: which part of a hook costs what. ``_batch_rows`` rebuilds its table only when the batch or the
# set of steered requests changed (batch 256, this development machine's CPU, warm: 2 µs unchanged, 112 µs rebuilding):
# a median near the second means it rebuilds every step, i.e. ``fill`` never reaches its steady path. The uploader's
# ``to_device`` (pinned host copy, host-to-device copy, event) runs once per table written: its calls per step count
# the uploads.
PARTS = {"WorkerSteering": ("on_step", "step_kinds", "fill", "_batch_rows"),
         "Uploader": ("to_device", "copy_", "_stage", "_record")}


def time_parts(*classes: type) -> list[HookTimer]:
    """Time the methods ``PARTS`` names for each of ``classes`` (``hotwire_core.runtime``'s and
    ``hotwire_core.uploader``'s, by class name)."""
    timers = []
    for cls in classes:
        for name in PARTS[cls.__name__]:
            timer = HookTimer(f"part: {cls.__name__}.{name}")
            setattr(cls, name, timer.timed_wrapper(vars(cls)[name]))
            timers.append(timer)
    return timers


# Per-step vLLM methods hotwire does not wrap: each gets a pass-through wrapper shaped like hotwire's hooks, timed
# the same way. Its figure is what any hook costs at that point of a step (the timing included): the floor that
# hotwire's own hooks are read against. A hook called right after the model's work finds cold caches.
NULL_HOOKS = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "update_requests"),
)


def install_null_hooks() -> list[HookTimer]:
    timers = []
    for module_name, class_name, name in NULL_HOOKS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is None or name not in vars(cls):
            continue
        timer = HookTimer(f"null: {class_name}.{name}")
        original = timer.timed_original(vars(cls)[name])

        def hook(self, *args: Any, _original: Callable = original, **kwargs: Any) -> Any:
            getattr(self, "hotwire", None)
            return _original(self, *args, **kwargs)

        setattr(cls, name, timer.timed_wrapper(hook))
        timers.append(timer)
    return timers


def count_steps(timers: list[HookTimer]) -> None:
    """Stamp every timed call with the engine step it ran in: the number of ``Scheduler.schedule`` calls so far."""
    schedule = next(t for t in timers if t.name == "Scheduler.schedule")
    for t in timers:
        t.step = lambda: len(schedule.own)


def per_step(timer: HookTimer, steps: int) -> bool:
    """Whether a hook runs once per engine step: at most once in any step, and in at least half of the ``steps``
    (not per request, nor only in the prefill step). The sum of these hooks' median calls is the steady cost of a
    decode step."""
    calls = Counter(timer.steps)
    return bool(calls) and max(calls.values()) == 1 and len(calls) >= steps / 2


DISTINCT_VECTORS = 200  # within the default 256 bank slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", help="a shape from hotwire_core.tiny_model.SHAPES")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--modes", default="plain,steered",
                        help="comma-separated: plain (nothing steered), steered (every request, one vector), distinct "
                             f"(each request its own vector, {DISTINCT_VECTORS} in turn); with -churn (plain-churn, "
                             "...): 4x the batch with lengths spread, so that requests finish and join every step")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0,
                        help="a fixed KV cache, so that several runs can share a GPU (256 x 80 tokens of Qwen3-4B: 2.8 GiB)")
    parser.add_argument("--untimed-compile", action="store_true",
                        help="compile without timing-based kernel choices (hotwire_core.verify.UNTIMED_INDUCTOR), "
                             "so that runs of different code get the same kernels")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch
    from vllm import LLM, SamplingParams

    from hotwire_core.offline import register_vector, steer
    from hotwire_core.runtime import WorkerSteering
    from hotwire_core.tiny_model import build_model
    from hotwire_core.uploader import Uploader
    from hotwire_core.verify import untimed_compilation_config

    model = build_model(Path(tempfile.gettempdir()) / f"hotwire-profile-{args.shape}", args.shape, weights=False)
    llm = LLM(str(model), load_format="dummy", max_model_len=512, max_num_seqs=args.batch, seed=0,
              distributed_executor_backend="uni", kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
              gpu_memory_utilization=0.05, **({} if torch.cuda.is_available() else {"dtype": "float32"}),
              **({"compilation_config": untimed_compilation_config()} if args.untimed_compile else {}))
    hf = llm.llm_engine.model_config.hf_config
    for i in range(DISTINCT_VECTORS):
        register_vector(llm, f"v{i}", torch.randn(hf.hidden_size) * 0.01)
    vocab = min(hf.vocab_size, 30000)
    timers, untimed = instrument()
    nulls = install_null_hooks()
    parts = time_parts(WorkerSteering, Uploader)
    count_steps(timers + nulls + parts)
    rows = []
    for mode in args.modes.split(","):
        steering, _, churn = mode.partition("-")
        if steering not in ("plain", "steered", "distinct") or churn not in ("", "churn"):
            parser.error(f"unknown mode {mode!r}")
        # churn: 4x the batch, lengths spread over 0.5-1.5x --decode-tokens: requests finish and join every step
        n = args.batch * (4 if churn else 1)
        prompts = [{"prompt_token_ids": [(7 * i + j) % (vocab - 10) + 10 for j in range(16)]} for i in range(n)]
        lengths = [args.decode_tokens // 2 + (37 * i) % args.decode_tokens if churn else args.decode_tokens for i in range(n)]
        layer = hf.num_hidden_layers // 2
        params = [
            SamplingParams(max_tokens=length, ignore_eos=True, temperature=0.0, detokenize=False,
                           extra_args=None if steering == "plain" else
                           steer({"id": f"v{i % DISTINCT_VECTORS if steering == 'distinct' else 0}", "layer": layer, "scale": 1.0}))
            for i, length in enumerate(lengths)
        ]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: these batch shapes, caches
        for t in timers + nulls + parts:
            t.reset()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        steps = next(len(t.own) for t in timers if t.name == "Scheduler.schedule")
        row = {"mode": mode, "batch": args.batch, "steps": steps, "wall_ms_per_step": wall / steps * 1e3,
               "hotwire_us_per_step": sum(sum(t.own) for t in timers) / steps * 1e6,
               "steady_us_per_step": sum(statistics.median(t.own) for t in timers if per_step(t, steps)) * 1e6,
               "steady_hooks": sum(per_step(t, steps) for t in timers),
               "null_hook_us": max((statistics.median(t.own) * 1e6 for t in nulls if t.own), default=None),
               "untimed_hooks": untimed,
               "hooks": [{"hook": t.name, "calls": len(t.own), "median_us_per_call": statistics.median(t.own) * 1e6,
                          "us_per_step": sum(t.own) / steps * 1e6} for t in timers + nulls + parts if t.own]}
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    # Other Python threads in this process compete with the step for the GIL (every torch call releases it).
    print("threads:", ", ".join(sorted(t.name for t in threading.enumerate())))
    print("| mode | batch | steps | hotwire µs/step, all calls (admissions and releases included) "
          "| hotwire µs/step, steady (median call of each per-step hook) | per-step hooks | slowest null hook µs "
          "| wall ms/step |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        null = "—" if r["null_hook_us"] is None else f"{r['null_hook_us']:.1f}"
        print(f"| {r['mode']} | {r['batch']} | {r['steps']} | {r['hotwire_us_per_step']:.1f} | "
              f"{r['steady_us_per_step']:.1f} | {r['steady_hooks']} | {null} | {r['wall_ms_per_step']:.2f} |")


if __name__ == "__main__":
    main()
