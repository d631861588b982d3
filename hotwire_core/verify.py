"""Self-test of hotwire on your own hardware, in one offline vLLM engine:

    python -m hotwire_core.verify [--model PATH_OR_ID | --arch ARCH] [--dtype DTYPE] [--runner v1|v2] [--vanilla]
                                  [--tensor-parallel-size N] [--kv-cache-gib G] [--save-plain FILE]

Without ``--model`` it builds the built-in tiny model (random weights, architecture ``--arch``, default qwen3) in
a temporary folder; that also runs on a CPU, slowly. A random vector sized to the model is registered and these are checked:

a. steering fires: steered logprobs differ from plain ones;
b. batchmates: plain requests batched with steered ones are bit-identical to the same plain requests in an
   all-plain batch of the same shape;
c. prefix cache, both directions, on prompts of at least 4 KV blocks: a plain request after a steered one (and a
   steered one after a plain one) reads no cached tokens and equals the same request with
   ``skip_reading_prefix_cache``; an identical steered request does hit the cache;
d. decode cost: time per decode step of a batch of 8, idle (hotwire loaded, nothing steered) vs all steered (steered
   may cost at most +50% on a GPU, +100% on the CPU: a guard against gross regressions, not the speed target); with
   CUDA graphs on, every rank must have its hotwire-free graphs (the idle variants) in place after an unsteered step;
e. with ``--vanilla``: the plain requests again, in a subprocess with no plugin at all (``VLLM_PLUGINS=""``),
   compared bit for bit. On a GPU both engines then compile with :data:`UNTIMED_INDUCTOR`: Inductor's
   deterministic mode patched into vLLM's compile (``TORCHINDUCTOR_DETERMINISTIC=1`` does not reach it: Dynamo
   resets the setting after every trace), vLLM's combo kernels always fused (``benchmark_combo_kernel`` off: vLLM turns it on, and deterministic mode
   refuses that timing) and one configuration per pointwise kernel (``triton.autotune_pointwise`` off: a combo
   kernel holding a reduction is emitted as a pointwise one, whose configurations deterministic mode still times).
   Inductor otherwise picks some kernel configurations by timing them, and two compiles on a busy GPU may pick
   differently and differ in the last bits (seen on the H200: tiny Qwen3's q/k RMSNorm, 0.0039 or 4e-5 in a
   logprob). When the plain requests differ, a second plugin-free engine runs
   them too, this time in the order this engine ran them, after the same earlier requests (their steering left
   out), and each request passes if it equals either engine's: at tensor parallel 2 on the V1 runner, plugin-free
   engines running the same requests have disagreed with each other on a 72-token prefill (by 0.0038 or 1.1e-4,
   on the H200: ``benchmarks/tp2_identity.py``), so one reference cannot tell vLLM's own variation from
   hotwire's. The report says where the two references differ.

``--save-plain FILE`` writes the plain results that (e) compares as JSON (compiling as (e) does), so that
engines elsewhere can be compared with this one (``benchmarks/tp2_identity.py``).

"Bit-identical" is exact on a GPU; on the CPU, whose backend jitters by an ulp even between identical batches,
it is within ``CPU_TOLERANCE`` and the report gives the largest difference.

It prints a report and exits 1 when a check fails (2 when hotwire refuses the test vector or steering).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hotwire_core import contract
from hotwire_core.tiny_model import ARCHS

VECTOR_ID = "hotwire-verify"
SCALE = 4.0
PROMPTS = ["The quick brown fox", "Hello world, this is", "Once upon a time there was", "Steering vectors nudge the"]
LONG_TEXTS = (
    "steering vectors nudge the residual stream of a language model",
    "continuous batching serves many requests at once",
)
SHORT_TOKENS = 8
PREFIX_TOKENS = 4
PREFIX_BLOCKS = 4
DECODE_BATCH = 8
DECODE_TOKENS = 64
TIMING_REPEATS = 3
MIN_LOGPROB_DELTA = 1e-4  # below this a logprob change is numerical noise, not steering
MAX_DECODE_OVERHEAD = 0.5  # steered decode may cost at most this much more than idle decode (on a GPU)
# On the CPU the op runs as plain torch ops beside a tiny model's few-ms step: steered came out +22% to +55% on a
# 2-core machine (the top while the test suite's other engines ran), so only a gross regression should fail there.
MAX_DECODE_OVERHEAD_CPU = 1.0
# vLLM's CPU backend is not bit-reproducible, not even between identical batches in one engine (its logprobs jitter
# by an ulp, 5e-7), so on the CPU "identical" means within this; on a GPU it means bit for bit.
CPU_TOLERANCE = 1e-5
MAX_MODEL_LEN = 2048
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1"}


Header = list[tuple[str, str]]  # report fields: (name, value)
Timings = list[tuple[str, float]]  # (what, seconds)
Batches = list[tuple[list[list[int]], int]]  # (prompts as token ids, max_tokens)
# One batch of a plugin-free job: (prompts, max_tokens, kept: its results are returned, read_cache: it may read the
# prefix cache); JSON carries it as a list.
Step = tuple[list[list[int]], int, bool, bool]


@dataclass(frozen=True)
class Result:
    """What one request produced: sampled token ids, their logprobs and how many prompt tokens came from cache."""

    token_ids: list[int]
    logprobs: list[float]
    num_cached_tokens: int


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


# -- judging and formatting (pure) -----------------------------------------------------------------------------


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest elementwise difference; infinite when the lengths differ."""
    if len(a) != len(b):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def compare(ours: Sequence[Result], theirs: Sequence[Result], tolerance: float) -> tuple[bool, str]:
    """Whether two lists of results match (same tokens; logprobs bit-identical, or within ``tolerance`` where the
    backend is not bit-reproducible) and how closely, in words."""
    tokens = len(ours) == len(theirs) and all(a.token_ids == b.token_ids for a, b in zip(ours, theirs))
    worst = max((max_abs_diff(a.logprobs, b.logprobs) for a, b in zip(ours, theirs)), default=0.0)
    if tokens and all(a.logprobs == b.logprobs for a, b in zip(ours, theirs)):
        return True, "bit-identical"
    words = f"max |delta| {worst:.3g}" + (f" (CPU tolerance {tolerance:g})" if tolerance > 0 else "")
    return tokens and worst <= tolerance, words if tokens else f"different tokens, {words}"


def differs(plain: Result, steered: Result) -> bool:
    return plain.token_ids != steered.token_ids or max_abs_diff(plain.logprobs, steered.logprobs) > MIN_LOGPROB_DELTA


def check_steering_fires(plain: Result, steered: Result) -> Check:
    changed = sum(a != b for a, b in zip(plain.token_ids, steered.token_ids))
    detail = (
        f"max |logprob delta| {max_abs_diff(plain.logprobs, steered.logprobs):.4g}, "
        f"{changed}/{len(plain.token_ids)} tokens differ"
    )
    return Check("a. steering fires", differs(plain, steered), detail)


def check_batchmates(
    all_plain: Sequence[Result], mixed: Sequence[Result], steered: Sequence[int], tolerance: float
) -> Check:
    """Plain requests of ``mixed`` must match ``all_plain`` (see :func:`compare`); those at ``steered`` must
    differ."""
    plain_idx = [i for i in range(len(mixed)) if i not in steered]
    same, words = compare([mixed[i] for i in plain_idx], [all_plain[i] for i in plain_idx], tolerance)
    fired = all(differs(all_plain[i], mixed[i]) for i in steered)
    detail = (
        f"{len(plain_idx)} plain beside {len(steered)} steered in a batch of {len(mixed)}: "
        f"{words} to an all-plain batch" + ("" if fired else "; a steered mate was not steered")
    )
    return Check("b. batchmates", same and fired, detail)


def check_no_cross_read(name: str, after: Result, uncached: Result, tolerance: float) -> Check:
    """``after`` followed a request with other steering on the same prompt: it must read no cached tokens and
    match ``uncached`` (the same request with ``skip_reading_prefix_cache``)."""
    same, words = compare([after], [uncached], tolerance)
    detail = f"{after.num_cached_tokens} cached tokens read; {words} to an uncached run"
    return Check(name, after.num_cached_tokens == 0 and same, detail)


def check_cache_hit(first: Result, repeat: Result, block_size: int, prompt_len: int) -> Check:
    """An identical steered request must read at least one full block from the prefix cache."""
    detail = (
        f"{repeat.num_cached_tokens}/{prompt_len} prompt tokens from cache (block {block_size}); "
        f"max |delta| to the first run {max_abs_diff(first.logprobs, repeat.logprobs):.3g}"
    )
    return Check("c. prefix cache: steered hit", repeat.num_cached_tokens >= block_size, detail)


def per_step_ms(short_s: float, long_s: float, extra_tokens: int) -> float:
    """Milliseconds per decode step from two runs that differ only by ``extra_tokens`` generated tokens."""
    return (long_s - short_s) / extra_tokens * 1000.0


def idle_graphs_in_place(ranks: Sequence[dict]) -> tuple[bool, str]:
    """Whether every rank had its hotwire-free CUDA graphs in place right after an unsteered step
    (``hotwire_graph_sets`` of each rank): the idle figure of check (d) rests on it."""
    holders = sum(rank.get("holders", 0) for rank in ranks)
    if holders == 0 or not all(rank["split"] for rank in ranks):
        return True, "one graph set (no CUDA graphs, or HOTWIRE_IDLE_GRAPHS=0)"
    serving = sum(rank["serving_idle"] for rank in ranks)
    return serving == holders, f"after an unsteered step {serving} of {holders} graph holders had their hotwire-free set in place"


def check_decode_cost(
    idle_ms: Sequence[float], steered_ms: Sequence[float], max_overhead: float, graph_sets: Sequence[dict]
) -> Check:
    idle, steered = statistics.median(idle_ms), statistics.median(steered_ms)
    overhead = steered / idle - 1.0 if idle > 0 else math.inf
    graphs_ok, graphs = idle_graphs_in_place(graph_sets)
    detail = (
        f"batch {DECODE_BATCH}: idle {idle:.3f} ms/step, steered {steered:.3f} ms/step "
        f"({overhead:+.1%}, limit {max_overhead:+.0%}; median of {len(idle_ms)}); {graphs}"
    )
    return Check("d. decode cost", overhead <= max_overhead and graphs_ok, detail)


def first_differences(ours: Sequence[Result], theirs: Sequence[Result], tolerance: float) -> list[tuple[int, int]]:
    """``(request, token)`` for every request that differs by more than ``tolerance``: its index and the first
    generated token where it does (0: the prompt's processing already differs)."""
    found = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        pairs = list(zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs))
        first = next((j for j, (x, y, p, q) in enumerate(pairs) if x != y or abs(p - q) > tolerance), None)
        if first is None and (len(a.token_ids) != len(b.token_ids) or len(a.logprobs) != len(b.logprobs)):
            first = len(pairs)
        if first is not None:
            found.append((i, first))
    return found


def describe(differences: Sequence[tuple[int, int]]) -> str:
    """``"#4 from token 0, #6 from token 2"`` for :func:`first_differences`' pairs."""
    return ", ".join(f"#{request} from token {token}" for request, token in differences)


def check_vanilla(ours: Sequence[Result], references: Sequence[Sequence[Result]], tolerance: float) -> Check:
    """Plain results against one or two plugin-free engines (see :func:`compare`): each request must equal at
    least one engine's. A failure names the requests that match none (numbered in the order they ran) and where
    they first differ; with two references the detail also says whether those two agree with each other."""
    name, first = "e. vanilla vLLM", references[0]
    counts = [len(ref) for ref in references]
    if any(count != len(ours) for count in counts):  # a reference that ran other requests cannot be compared
        return Check(name, False, f"{len(ours)} plain requests, but the plugin-free engines returned {counts}")
    same, words = compare(ours, first, tolerance)
    if same or len(references) == 1:
        detail = f"{len(ours)} plain requests: {words}"
        if not same:
            detail += f" (requests {describe(first_differences(ours, first, tolerance))})"
        return Check(name, same, detail)
    unmatched = [
        i for i in range(len(ours)) if not any(compare([ours[i]], [ref[i]], tolerance)[0] for ref in references)
    ]
    refs_same, refs_words = compare(references[0], references[1], tolerance)
    if refs_same:
        between = "which agree with each other"
    else:
        where = describe(first_differences(references[0], references[1], tolerance))
        between = f"which differ from each other ({refs_words}; requests {where}): vLLM's own engine-to-engine variation"
    if not unmatched:
        return Check(name, True, f"{len(ours)} plain requests: each equals one of two plugin-free engines, {between}")
    # Where each unmatched request first departs from the references: the earlier of the two positions.
    starts = [dict(first_differences(ours, ref, tolerance)) for ref in references]
    listed = describe([(i, min(start[i] for start in starts)) for i in unmatched])
    if any(ours[i].token_ids != ref[i].token_ids for i in unmatched for ref in references):
        how = "different tokens"
    else:
        worst = max(min(max_abs_diff(ours[i].logprobs, ref[i].logprobs) for ref in references) for i in unmatched)
        how = f"max |delta| to the nearer {worst:.3g}"
    detail = f"{len(ours)} plain requests: {listed} match neither of two plugin-free engines ({how}), {between}"
    return Check(name, False, detail)


def format_report(header: Header, checks: Sequence[Check], timings: Timings) -> str:
    """The report block: header fields, one line per check, timings and the verdict."""
    rule = "=" * 78
    lines = [rule, "hotwire verify", rule]
    lines += [f"{key:<11}{value}" for key, value in header]
    lines.append("-" * 78)
    width = max((len(c.name) for c in checks), default=0)
    lines += [f"{'PASS' if c.passed else 'FAIL'}  {c.name:<{width}}  {c.detail}" for c in checks]
    lines.append("-" * 78)
    lines.append("timings    " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timings))
    failed = [c.name for c in checks if not c.passed]
    verdict = f"PASS ({len(checks)}/{len(checks)} checks)" if not failed else f"FAIL ({', '.join(failed)})"
    lines += [f"{'result':<11}{verdict}", rule]
    return "\n".join(lines)


def exit_status(checks: Sequence[Check]) -> int:
    return 0 if checks and all(c.passed for c in checks) else 1


# -- the engine ----------------------------------------------------------------------------------------------------


# Inductor settings that leave no kernel choice to timing, with vLLM's combo kernels kept (see check e).
# ``deterministic`` must be a config patch: TORCHINDUCTOR_DETERMINISTIC=1 sets it at import, but every Dynamo trace
# ends with torch.use_deterministic_algorithms(<the previous ATen flag>), which writes that flag (False) into
# Inductor's setting, so vLLM's compile ran without it (the H200, 2026-12-01: benchmarks/diag_qwen3_kernels.sh).
UNTIMED_INDUCTOR = {
    "combo_kernels": True,
    "benchmark_combo_kernel": False,
    "deterministic": True,
    "triton.autotune_pointwise": False,
}


def untimed_compilation_config() -> dict[str, Any]:
    """vLLM's ``compilation_config`` argument for :data:`UNTIMED_INDUCTOR` (a fresh dict per engine)."""
    return {"inductor_compile_config": dict(UNTIMED_INDUCTOR)}


def engine_kwargs(
    model: str, dtype: str, tensor_parallel: int = 1, kv_cache_gib: float | None = None, untimed: bool = False
) -> dict[str, Any]:
    """The same arguments for the engine under test and the vanilla reference; ``untimed``: compile with
    :data:`UNTIMED_INDUCTOR` (GPU only: vLLM has no combo kernels on the CPU)."""
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype=dtype,
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=DECODE_BATCH,
        enable_prefix_caching=True,
        tensor_parallel_size=tensor_parallel,
    )
    if untimed:
        kwargs["compilation_config"] = untimed_compilation_config()
    if kv_cache_gib is not None:
        # A fixed KV cache skips vLLM's memory profiling, which miscounts when other engines share the GPU; the
        # utilisation then only gates the start-up check that this much memory is free.
        kwargs.update(kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)), gpu_memory_utilization=0.05)
    return kwargs


def summarize(output: Any) -> Result:
    completion = output.outputs[0]
    logprobs = [d[t].logprob for d, t in zip(completion.logprobs or [], completion.token_ids)]
    return Result(list(completion.token_ids), logprobs, output.num_cached_tokens or 0)


def params(max_tokens: int, steer: dict | None = None, skip_cache: bool = False) -> Any:
    """Greedy sampling with the sampled tokens' logprobs; ``steer`` is ``extra_args``."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=0,
        ignore_eos=True,
        extra_args=steer,
        skip_reading_prefix_cache=skip_cache,
    )


def generate(llm: Any, prompts: Sequence[list[int]], sampling: Sequence[Any]) -> list[Result]:
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], list(sampling), use_tqdm=False)
    return [summarize(o) for o in outputs]


def one(llm: Any, ids: list[int], sampling: Any) -> Result:
    return generate(llm, [ids], [sampling])[0]


def long_prompt(tokenizer: Any, text: str, n_tokens: int) -> list[int]:
    """``text`` repeated and cut to exactly ``n_tokens`` token ids."""
    ids = tokenizer.encode(text + " ", add_special_tokens=False)
    return (ids * (n_tokens // len(ids) + 1))[:n_tokens]


def batchmate_check(llm: Any, short: list[list[int]], steer: dict, tolerance: float) -> tuple[Check, list[Result]]:
    """Check (b); returns the all-plain batch too (a vanilla reference)."""
    steered = [1, 3]
    plain_params = [params(SHORT_TOKENS, skip_cache=True) for _ in short]
    mixed_params = [params(SHORT_TOKENS, steer if i in steered else None, skip_cache=True) for i in range(len(short))]
    all_plain = generate(llm, short, plain_params)
    mixed = generate(llm, short, mixed_params)
    return check_batchmates(all_plain, mixed, steered, tolerance), all_plain


def prefix_checks(
    llm: Any, x: list[int], y: list[int], steer: dict, block_size: int, tolerance: float
) -> tuple[list[Check], list[Result]]:
    """Check (c) on two fresh long prompts; returns the plain results that read no cache (vanilla references)."""
    steered_x = one(llm, x, params(PREFIX_TOKENS, steer))
    plain_x = one(llm, x, params(PREFIX_TOKENS))
    plain_x_uncached = one(llm, x, params(PREFIX_TOKENS, skip_cache=True))
    steered_x_again = one(llm, x, params(PREFIX_TOKENS, steer))
    plain_y = one(llm, y, params(PREFIX_TOKENS))
    steered_y = one(llm, y, params(PREFIX_TOKENS, steer))
    steered_y_uncached = one(llm, y, params(PREFIX_TOKENS, steer, skip_cache=True))
    checks = [
        check_no_cross_read("c. prefix cache: steered -> plain", plain_x, plain_x_uncached, tolerance),
        check_no_cross_read("c. prefix cache: plain -> steered", steered_y, steered_y_uncached, tolerance),
        check_cache_hit(steered_x, steered_x_again, block_size, len(x)),
    ]
    return checks, [plain_x_uncached, plain_y]


def checks_a_to_c(
    llm: Any, short: list[list[int]], x: list[int], y: list[int], spec: dict, block_size: int, tolerance: float
) -> tuple[list[Check], list[Result]]:
    """Checks (a)-(c), and the plain results that (e) compares, in the order of :func:`plain_batches` (the
    requests are sent in the order :func:`plain_history` repeats)."""
    plain = one(llm, short[0], params(SHORT_TOKENS, skip_cache=True))
    steered = one(llm, short[0], params(SHORT_TOKENS, spec, skip_cache=True))
    batchmates, all_plain = batchmate_check(llm, short, spec, tolerance)
    prefix, plain_long = prefix_checks(llm, x, y, spec, block_size, tolerance)
    return [check_steering_fires(plain, steered), batchmates, *prefix], [plain, *all_plain, *plain_long]


def timed(llm: Any, prompts: Sequence[list[int]], max_tokens: int, steer: dict | None) -> float:
    sampling = [params(max_tokens, steer, skip_cache=True) for _ in prompts]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids in prompts], sampling, use_tqdm=False)
    return time.perf_counter() - start


def decode_cost_check(llm: Any, short: list[list[int]], steer: dict) -> Check:
    """Check (d): (t(1 + N tokens) - t(1 token)) / N for a batch of 8, idle and all steered, interleaved."""
    import torch

    batch = [short[i % len(short)] for i in range(DECODE_BATCH)]
    samples: dict[str, list[float]] = {"idle": [], "steered": []}
    for repeat in range(TIMING_REPEATS + 1):  # the first round warms up
        for name, spec in (("idle", None), ("steered", steer)):
            t_short = timed(llm, batch, 1, spec)
            t_long = timed(llm, batch, 1 + DECODE_TOKENS, spec)
            if repeat:
                samples[name].append(per_step_ms(t_short, t_long, DECODE_TOKENS))
    timed(llm, batch, 1 + DECODE_TOKENS, None)
    graph_sets = llm.collective_rpc(contract.GRAPH_SETS)
    limit = MAX_DECODE_OVERHEAD if torch.cuda.is_available() else MAX_DECODE_OVERHEAD_CPU
    return check_decode_cost(samples["idle"], samples["steered"], limit, graph_sets)


def plain_batches(short: list[list[int]], x: list[int], y: list[int]) -> Batches:
    """The batches of the plain results that (e) compares, ``(prompts, max_tokens)``, in :func:`run`'s order."""
    return [(short[:1], SHORT_TOKENS), (short, SHORT_TOKENS), ([x], PREFIX_TOKENS), ([y], PREFIX_TOKENS)]


def plain_history(short: list[list[int]], x: list[int], y: list[int]) -> list[Step]:
    """The requests :func:`checks_a_to_c` sends, in its order, up to the last plain one that (e) compares, all of
    them plain: kept where (e) compares the results (they come out in the order of :func:`plain_batches`), and
    reading the prefix cache only where the engine under test reads it (its repeated steered request on ``x``;
    every other request there reads nothing, by ``skip_reading_prefix_cache`` or a different cache salt)."""
    s, p = SHORT_TOKENS, PREFIX_TOKENS
    return [(short[:1], s, True, False), (short[:1], s, False, False),  # a: plain, steered
            (short, s, True, False), (short, s, False, False),  # b: all plain, mixed
            ([x], p, False, False), ([x], p, False, False), ([x], p, True, False),  # c: steered, plain, uncached x
            ([x], p, False, True), ([y], p, True, False)]  # c: steered x again (a cache hit), plain y


def as_steps(batches: Batches) -> list[Step]:
    """``batches`` as job steps: every result kept, no cache read."""
    return [(prompts, max_tokens, True, False) for prompts, max_tokens in batches]


def save_results(path: Path, batches: Batches, results: Sequence[Result]) -> None:
    """Write ``results`` with the ``batches`` that produced them, so that a reader can check it compares the same
    requests (``--save-plain``, the vanilla child)."""
    path.write_text(json.dumps({"batches": batches, "results": [asdict(r) for r in results]}))


def load_results(path: Path) -> tuple[Batches, list[Result]]:
    """What :func:`save_results` wrote: the batches (as lists) and the results."""
    saved = json.loads(path.read_text())
    return [(prompts, n) for prompts, n in saved["batches"]], [Result(**r) for r in saved["results"]]


def run_vanilla(kwargs: dict[str, Any], steps: list[Step], workdir: Path, run: int = 0) -> list[Result]:
    """Run plain ``steps`` (see :func:`_vanilla_child`) in a fresh interpreter with ``VLLM_PLUGINS=""``; the kept
    steps' results in order, flattened. Each ``run`` > 0 compiles into its own cache, so it is a second,
    independent engine."""
    job, out = workdir / f"vanilla-job-{run}.json", workdir / f"vanilla-out-{run}.json"
    job.write_text(json.dumps({"engine": kwargs, "steps": steps}))
    env = {**os.environ, "VLLM_PLUGINS": ""}
    if run:
        env["VLLM_CACHE_ROOT"] = str(workdir / f"vanilla-cache-{run}")
    command = [sys.executable, "-m", "hotwire_core.verify", "--vanilla-job", str(job), str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the vanilla engine failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return load_results(out)[1]


def _vanilla_child(job_path: str, out_path: str) -> None:
    """Run a job's plain ``steps`` (:data:`Step`) and save the kept ones' batches and results. The engine must be
    plugin-free, or have hotwire loaded where the job says ``"plugin_free": false`` (``benchmarks/tp2_identity.py``)."""
    from vllm import LLM

    job = json.loads(Path(job_path).read_text())
    llm = LLM(**job["engine"])
    loaded = any(name.startswith("hotwire_core.vllm_glue") for name in sys.modules)
    if loaded == job.get("plugin_free", True):
        raise SystemExit("hotwire was loaded although VLLM_PLUGINS is empty" if loaded else
                         "hotwire was not loaded: is hotwire-vllm installed and VLLM_PLUGINS unset?")
    kept: Batches = []
    results: list[Result] = []
    for step in job["steps"]:
        if len(step) != 4:
            raise SystemExit(f"a job step is [prompts, max_tokens, kept, read_cache], not {json.dumps(step)[:200]}")
        prompts, max_tokens, keep, read_cache = step
        done = generate(llm, prompts, [params(max_tokens, skip_cache=not read_cache) for _ in prompts])
        if keep:
            kept.append((prompts, max_tokens))
            results += done
    save_results(Path(out_path), kept, results)


def vanilla_check(
    kwargs: dict[str, Any], batches: Batches, history: list[Step], ours: list[Result], tolerance: float, workdir: Path
) -> Check:
    """Check (e): ``ours`` are the plain results of ``batches`` in the engine under test. A second plugin-free
    engine runs only when the first one's results differ from ours; it runs ``history`` (:func:`plain_history`)."""
    try:
        references = [run_vanilla(kwargs, as_steps(batches), workdir)]
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return Check("e. vanilla vLLM", False, str(exc).splitlines()[0])
    if compare(ours, references[0], tolerance)[0]:
        return check_vanilla(ours, references, tolerance)
    try:
        references.append(run_vanilla(kwargs, history, workdir, run=1))
    except RuntimeError as exc:  # judged on the first reference alone, and the report says why
        print(exc, file=sys.stderr)
        check = check_vanilla(ours, references, tolerance)
        return Check(check.name, False, f"{check.detail}; the second plugin-free engine failed: {str(exc).splitlines()[0]}")
    return check_vanilla(ours, references, tolerance)


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"GPU: {torch.cuda.get_device_name(0)}"
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {name} ({os.cpu_count()} cores)"


def runner_name(llm: Any, forced: str | None) -> str:
    used = "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"
    return f"{used} ({'--runner ' + forced if forced else 'vLLM default'})"


def report_header(llm: Any, model: str, runner: str | None, entry: dict, vector_norm: float) -> Header:
    import vllm

    import hotwire_core

    config = llm.llm_engine.model_config
    n_layers = config.get_num_layers(llm.llm_engine.vllm_config.parallel_config)
    arch = ",".join(config.architectures or ())
    tp = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    return [
        ("model", f"{model} ({arch}, hidden {config.get_hidden_size()}, {n_layers} layers, tensor parallel {tp})"),
        ("dtype", str(config.dtype).removeprefix("torch.")),
        ("device", device_name()),
        ("vLLM", f"{vllm.__version__}, hotwire {hotwire_core.__version__}, runner {runner_name(llm, runner)}"),
        ("steering", f"{json.dumps(entry)}, random normal vector (norm {vector_norm:.1f})"),
    ]


def run(args: argparse.Namespace, model: str, workdir: Path) -> tuple[Header, list[Check], Timings]:
    """Start the engine, run the checks; returns the report's header, checks and timings."""
    import torch
    from vllm import LLM

    from hotwire_core.offline import register_vector, slot_stats, steer
    from hotwire_core.settings import middle_layer

    timings: Timings = []
    started = time.monotonic()
    untimed = (args.vanilla or args.save_plain is not None) and torch.cuda.is_available()
    kwargs = engine_kwargs(model, args.dtype, args.tensor_parallel_size, args.kv_cache_gib, untimed=untimed)
    llm = LLM(**kwargs)
    timings.append(("engine start", time.monotonic() - started))

    engine = llm.llm_engine
    tolerance = 0.0 if torch.cuda.is_available() else CPU_TOLERANCE
    vector = torch.randn(engine.model_config.get_hidden_size(), generator=torch.Generator().manual_seed(0))
    register_vector(llm, VECTOR_ID, vector)
    n_layers = engine.model_config.get_num_layers(engine.vllm_config.parallel_config)
    hooked = slot_stats(llm)["model"]["layers"]  # all of them unless HOTWIRE_LAYERS says otherwise
    entry = {"id": VECTOR_ID, "layer": middle_layer(hooked, n_layers), "scale": SCALE}
    spec = steer(entry)
    header = report_header(llm, model, args.runner, entry, vector.norm().item())

    tokenizer = llm.get_tokenizer()
    short = [tokenizer.encode(p) for p in PROMPTS]
    block_size = engine.vllm_config.cache_config.block_size
    x, y = (long_prompt(tokenizer, text, PREFIX_BLOCKS * block_size + block_size // 2) for text in LONG_TEXTS)

    started = time.monotonic()
    checks, ours = checks_a_to_c(llm, short, x, y, spec, block_size, tolerance)
    timings.append(("checks a-c", time.monotonic() - started))

    started = time.monotonic()
    checks.append(decode_cost_check(llm, short, spec))
    timings.append(("decode timing", time.monotonic() - started))
    engine.engine_core.shutdown()

    batches = plain_batches(short, x, y)
    if args.save_plain is not None:
        save_results(args.save_plain, batches, ours)
    if args.vanilla:
        started = time.monotonic()
        checks.append(vanilla_check(kwargs, batches, plain_history(short, x, y), ours, tolerance, workdir))
        timings.append(("plugin-free engines", time.monotonic() - started))
    return header, checks, timings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hotwire_core.verify", description="Self-test hotwire in one vLLM engine."
    )
    parser.add_argument("--model", help="model to test (path or hub id); default: the built-in tiny model")
    parser.add_argument("--arch", default="qwen3", choices=ARCHS,
                        help="architecture of the built-in tiny model (ignored with --model)")
    parser.add_argument("--dtype", help="engine dtype (default: auto on a GPU, float32 on the CPU)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="tensor parallel ranks (GPUs)")
    parser.add_argument("--kv-cache-gib", type=float,
                        help="a fixed KV cache size instead of vLLM's memory profiling (lets engines share a GPU)")
    parser.add_argument("--runner", choices=("v1", "v2"), help="force vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER)")
    parser.add_argument("--vanilla", action="store_true", help="also compare plain requests with a plugin-free engine")
    parser.add_argument("--save-plain", type=Path, metavar="FILE",
                        help="write the plain requests' results (those --vanilla compares) to FILE as JSON")
    parser.add_argument("--vanilla-job", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    return parser


def _set_environment(args: argparse.Namespace, on_gpu: bool) -> None:
    """Before vLLM is imported: the runner, CPU-backend settings, and no vector store (the test vector is not
    kept)."""
    if args.runner:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    if not on_gpu:
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
    if not args.model:
        os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ["HOTWIRE_STORE"] = "off"
    # This process may touch CUDA before vLLM starts its engine; a forked engine could then not use the GPU.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.vanilla_job:
        _vanilla_child(*args.vanilla_job)
        return 0
    import torch

    from hotwire_core.offline import HotwireError

    on_gpu = torch.cuda.is_available()
    args.dtype = args.dtype or ("auto" if on_gpu else "float32")
    _set_environment(args, on_gpu)
    total = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hotwire-verify-") as tmp:
        workdir = Path(tmp)
        if args.model:
            model = args.model
        else:
            from hotwire_core.tiny_model import ModelShape, build_model

            model = str(build_model(workdir / "tiny-model", ModelShape(arch=args.arch)))
        try:
            header, checks, timings = run(args, model, workdir)
        except HotwireError as exc:
            print(f"verify: hotwire refused ({exc.status} {exc.code}): {exc}", file=sys.stderr)
            return 2
    print(format_report(header, checks, [*timings, ("total", time.monotonic() - total)]), flush=True)
    return exit_status(checks)


if __name__ == "__main__":
    sys.exit(main())
