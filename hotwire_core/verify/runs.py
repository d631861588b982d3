"""The engine runs of ``python -m hotwire_core.verify``: the engine under test with checks a-d, and the plugin-free
engines of check e (each in a fresh interpreter with ``VLLM_PLUGINS=""``)."""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hotwire_core import contract
from hotwire_core.verify import plugin_free
from hotwire_core.verify import checks as judge
from hotwire_core.verify.checks import CPU_TOLERANCE, DECODE_BATCH, MAX_DECODE_OVERHEAD, MAX_DECODE_OVERHEAD_CPU, Check, Result
from hotwire_core.verify.plugin_free import Request
from hotwire_core.verify.report import Header, Timings, report_header
from hotwire_core.verify.setup import Setup, WithAdapter, from_args

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
DECODE_TOKENS = 64
TIMING_REPEATS = 3
MAX_MODEL_LEN = 2048

Batches = list[tuple[list[list[int]], int]]  # (prompts as token ids, max_tokens)
# One batch of a plugin-free job: (prompts, max_tokens, kept: its results are returned, read_cache: it may read the
# prefix cache); JSON carries it as a list.
Step = tuple[list[list[int]], int, bool, bool]




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
    model: str, dtype: str, tensor_parallel: int = 1, kv_cache_gib: float | None = None, untimed: bool = False,
    setup: Setup | None = None,
) -> dict[str, Any]:
    """The same arguments for the engine under test and the vanilla reference; ``untimed``: compile with
    :data:`UNTIMED_INDUCTOR` (GPU only: vLLM has no combo kernels on the CPU); ``setup``: the serving
    configuration's arguments over them."""
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
    if setup is not None:
        kwargs.update(setup.engine_kwargs())
    return kwargs


def as_result(answer: dict[str, Any]) -> Result:
    """A ``vllm_glue.offline.summarize`` answer as a :class:`Result`."""
    return Result(answer["token_ids"], answer["logprobs"], answer["num_cached_tokens"])


def params_kwargs(max_tokens: int, steer: dict | None = None, skip_cache: bool = False) -> dict[str, Any]:
    """Greedy sampling with the sampled tokens' logprobs, as ``SamplingParams`` keyword arguments; ``steer`` is
    ``extra_args``."""
    return dict(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True, extra_args=steer,
                skip_reading_prefix_cache=skip_cache)  # fmt: skip


def params(max_tokens: int, steer: dict | None = None, skip_cache: bool = False) -> Any:
    """:func:`params_kwargs` as ``SamplingParams``."""
    from hotwire_core.vllm_glue.offline import sampling_params

    return sampling_params(**params_kwargs(max_tokens, steer, skip_cache))


def generate(llm: Any, prompts: Sequence[list[int]], sampling: Sequence[Any]) -> list[Result]:
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], list(sampling), use_tqdm=False)
    from hotwire_core.vllm_glue.offline import summarize

    return [as_result(summarize(o)) for o in outputs]


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
    return judge.check_batchmates(all_plain, mixed, steered, tolerance), all_plain


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
        judge.check_no_cross_read("c. prefix cache: steered -> plain", plain_x, plain_x_uncached, tolerance),
        judge.check_no_cross_read("c. prefix cache: plain -> steered", steered_y, steered_y_uncached, tolerance),
        judge.check_cache_hit(steered_x, steered_x_again, block_size, len(x)),
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
    return [judge.check_steering_fires(plain, steered), batchmates, *prefix], [plain, *all_plain, *plain_long]


def readout_check(llm: Any, ids: list[int], entry: dict, spec: dict, vector: Any) -> Check:
    """Check (f), with ``--readout``: the steering vector read as a probe at the steered layer, on every prompt
    token of a plain and a steered request (:func:`checks.check_readout`)."""
    from hotwire_core.offline import generate_with_readout

    probe = [{"id": entry["id"], "layer": entry["layer"]}]
    plain, steered = (
        generate_with_readout(llm, [{"prompt_token_ids": ids}], params(1, extra), probe, tokens="prompt")[0]
        .hotwire_readout["probes"][0]["prompt"]["score"]
        for extra in (None, spec)
    )
    added = entry["scale"] * float(vector.double().norm()) ** 2
    return judge.check_readout(plain, steered, added, judge.MAX_READOUT_ERROR)


def gate_check(llm: Any, ids: list[int], entry: dict, tolerance: float) -> Check:
    """Check (g), with ``--readout``: the entry gated on a probe one layer below that always holds steers as the
    entry does, and gated on one that never holds does not steer; each receipt says so
    (:func:`checks.check_gates`)."""
    from hotwire_core.offline import generate_with_readout, steer
    from hotwire_core.vllm_glue.offline import summarize

    when = {"id": entry["id"], "layer": entry["layer"] - 1}
    results, receipts = [], []
    for bound in ({"above": -1e30}, {"below": -1e30}):
        out = generate_with_readout(llm, [{"prompt_token_ids": ids}],
                                    params(SHORT_TOKENS, steer({**entry, "when": {**when, **bound}})))[0]
        results.append(as_result(summarize(out)))
        receipts.append(out.hotwire_gate)
    steered, plain = (one(llm, ids, params(SHORT_TOKENS, extra, skip_cache=True)) for extra in (steer(entry), None))
    return judge.check_gates(results, receipts, steered, plain, len(ids) + SHORT_TOKENS - 1, tolerance)


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
                samples[name].append(judge.per_step_ms(t_short, t_long, DECODE_TOKENS))
    timed(llm, batch, 1 + DECODE_TOKENS, None)
    graph_sets = llm.collective_rpc(contract.GRAPH_SETS)
    limit = MAX_DECODE_OVERHEAD if torch.cuda.is_available() else MAX_DECODE_OVERHEAD_CPU
    return judge.check_decode_cost(samples["idle"], samples["steered"], limit, graph_sets)


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


def _step_batches(steps: list[Step], lora: list | None = None) -> list[list[Request]]:
    """Plain ``steps`` as :mod:`plugin_free` batches, each request with the adapter ``lora`` (or none)."""
    for step in steps:
        if len(step) != 4:
            raise ValueError(f"a job step is [prompts, max_tokens, kept, read_cache], not {json.dumps(step)[:200]}")
    adapter = {} if lora is None else {"lora": lora}
    return [[{"prompt_token_ids": ids, "params": params_kwargs(n, skip_cache=not read), **adapter} for ids in prompts]
            for prompts, n, _, read in steps]  # fmt: skip


def _kept(steps: list[Step], answers: list[list[dict[str, Any]]]) -> tuple[Batches, list[Result]]:
    """The kept steps' batches and their results, flattened in order."""
    kept = [(prompts, n, answer) for (prompts, n, keep, _), answer in zip(steps, answers, strict=True) if keep]
    return [(prompts, n) for prompts, n, _ in kept], [as_result(r) for *_, answer in kept for r in answer]


def run_vanilla(
    kwargs: dict[str, Any], steps: list[Step], workdir: Path, run: int = 0, lora: list | None = None
) -> list[Result]:
    """Run plain ``steps`` plugin-free in a fresh interpreter (:func:`plugin_free.run_engine`), with the adapter
    ``lora`` on every request if given; the kept steps' results in order, flattened. Each ``run`` > 0 compiles
    into its own cache, so it is a second, independent engine."""
    env = {"VLLM_CACHE_ROOT": str(workdir / f"vanilla-cache-{run}")} if run else {}
    batches = _step_batches(steps, lora)
    answers = plugin_free.run_engine(kwargs, batches, workdir, env=env, tag=f"vanilla-{run}", timeout_s=None)
    return _kept(steps, answers)[1]


def _vanilla_child(job_path: str, out_path: str) -> None:
    """``--vanilla-job``: run a job's plain ``steps`` (:data:`Step`) in this process and save the kept ones'
    batches and results. The engine must be plugin-free, or have hotwire loaded where the job says
    ``"plugin_free": false`` (``benchmarks/tp2_identity.py``)."""
    job = json.loads(Path(job_path).read_text())
    try:
        batches = _step_batches(job["steps"])
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    answers = plugin_free.run_here({"engine": job["engine"], "batches": batches, "plugin_free": job.get("plugin_free", True)})
    save_results(Path(out_path), *_kept(job["steps"], answers))


def vanilla_check(
    kwargs: dict[str, Any], batches: Batches, history: list[Step], ours: list[Result], tolerance: float, workdir: Path,
    lora: list | None = None,
) -> Check:
    """Check (e): ``ours`` are the plain results of ``batches`` in the engine under test (with the adapter
    ``lora`` on every request, if given). A second plugin-free engine runs only when the first one's results differ
    from ours; it runs ``history`` (:func:`plain_history`)."""
    try:
        references = [run_vanilla(kwargs, as_steps(batches), workdir, lora=lora)]
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return Check("e. vanilla vLLM", False, str(exc).splitlines()[0])
    if judge.compare(ours, references[0], tolerance)[0]:
        return judge.check_vanilla(ours, references, tolerance)
    try:
        references.append(run_vanilla(kwargs, history, workdir, run=1, lora=lora))
    except RuntimeError as exc:  # judged on the first reference alone, and the report says why
        print(exc, file=sys.stderr)
        check = judge.check_vanilla(ours, references, tolerance)
        return Check(check.name, False, f"{check.detail}; the second plugin-free engine failed: {str(exc).splitlines()[0]}")
    return judge.check_vanilla(ours, references, tolerance)


def run(args: argparse.Namespace, model: str, workdir: Path) -> tuple[Header, list[Check], Timings]:
    """Start the engine, run the checks; returns the report's header, checks and timings."""
    import torch

    from hotwire_core.offline import register_vector, slot_stats, steer
    from hotwire_core.settings import middle_layer
    from hotwire_core.vllm_glue.offline import engine_facts, shutdown, start_llm

    timings: Timings = []
    started = time.monotonic()
    untimed = (args.vanilla or args.save_plain is not None) and torch.cuda.is_available()
    setup = from_args(args)
    kwargs = engine_kwargs(model, args.dtype, args.tensor_parallel_size, args.kv_cache_gib, untimed, setup)
    llm = start_llm(**copy.deepcopy(kwargs))  # vLLM adds its objects to a speculative_config: the vanilla job is JSON
    timings.append(("engine start", time.monotonic() - started))
    lora = setup.request_lora()
    if lora is not None:
        llm = WithAdapter(llm, lora)

    facts = engine_facts(llm)
    tolerance = 0.0 if torch.cuda.is_available() else CPU_TOLERANCE
    vector = torch.randn(facts.hidden_size, generator=torch.Generator().manual_seed(0))
    register_vector(llm, VECTOR_ID, vector)
    hooked = slot_stats(llm)["model"]["layers"]  # all of them unless HOTWIRE_LAYERS says otherwise
    entry = {"id": VECTOR_ID, "layer": middle_layer(hooked, facts.n_layers), "scale": SCALE}
    spec = steer(entry)
    header = report_header(facts, model, args.runner, entry, vector.norm().item(), setup.describe())

    tokenizer = llm.get_tokenizer()
    short = [tokenizer.encode(p) for p in PROMPTS]
    block_size = facts.block_size
    x, y = (long_prompt(tokenizer, text, PREFIX_BLOCKS * block_size + block_size // 2) for text in LONG_TEXTS)

    started = time.monotonic()
    checks, ours = checks_a_to_c(llm, short, x, y, spec, block_size, tolerance)
    timings.append(("checks a-c", time.monotonic() - started))

    started = time.monotonic()
    checks.append(decode_cost_check(llm, short, spec))
    timings.append(("decode timing", time.monotonic() - started))
    if args.readout:
        started = time.monotonic()
        checks.append(readout_check(llm, x, entry, spec, vector))
        if entry["layer"] > 0:
            checks.append(gate_check(llm, short[0], entry, tolerance))
        timings.append(("readout and gates", time.monotonic() - started))
    shutdown(llm)

    batches = plain_batches(short, x, y)
    if args.save_plain is not None:
        save_results(args.save_plain, batches, ours)
    if args.vanilla:
        started = time.monotonic()
        checks.append(vanilla_check(kwargs, batches, plain_history(short, x, y), ours, tolerance, workdir, lora))
        timings.append(("plugin-free engines", time.monotonic() - started))
    return header, checks, timings
