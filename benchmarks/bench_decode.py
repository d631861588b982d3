"""Decode cost of hotwire against plain vLLM, one GPU, one run.

Every configuration is its own engine in its own process, all started at once on the same GPU (each with a fixed
KV cache, ``--kv-cache-gib``) and then measured in turn, round-robin: for each batch size and repetition every
configuration runs a short unrecorded warm-up and then every one of its modes back to back, with the order of
configurations and of modes rotated per repetition. Slow drift of the machine (clocks, temperature, other
tenants) then hits all configurations alike, and each repetition gives a *paired* ratio against the vanilla run
of the same round. ``--cores-per-engine`` gives each engine its own CPU cores. ``--untimed`` compiles every engine with
``hotwire_core.verify.UNTIMED_INDUCTOR``: vLLM's compile otherwise picks some Inductor kernel configurations by
timing them (Qwen3's q/k RMSNorm: benchmarks/results/2026-12-01_h200_aed871d), so two separately compiled engines
can run different kernels for the same op, a difference between the engines that is not hotwire's.

Configurations: ``vanilla`` (no plugin loaded at all: ``VLLM_PLUGINS=""``), ``op`` (hotwire, opaque Triton op),
``op_1set`` (the op without idle graph variants: ``HOTWIRE_IDLE_GRAPHS=0``), ``op_8layers`` (the op hooked on
the 8 middle layers only: ``HOTWIRE_LAYERS``; it cannot run ``steered_all_layers``), ``op_nopdl`` (the op
without programmatic dependent launch: ``HOTWIRE_PDL=0``), ``op_capture`` (the op with the capture op of
``POST /steer/vectors/extract`` compiled in: ``HOTWIRE_CAPTURE=1``, nobody capturing), ``op_readout`` (the op with
the readout op compiled in: ``HOTWIRE_READOUT=1``; with ``op_readout_used`` the only ones that run the modes ``read4``,
``steered_read4`` and ``steered_gated``, every request reading 4 probes at a middle layer), ``op_readout_used``
(``op_readout`` with the read op at the two layers those modes read only: ``HOTWIRE_READOUT_LAYERS``), ``inductor`` (hotwire, torch ops fused by Inductor), ``eager`` (hotwire's op with ``enforce_eager``: no
torch.compile, no CUDA graphs, what hook-based steering tools pay). All use vLLM's default V2 model runner; a
``/v1`` suffix (``vanilla/v1``, ``op/v1``) runs the V1 runner instead, compared with ``vanilla/v1``.

The decode time per token of a request is ``(last token - first token) / (N - 1)`` on the engine core's own clock
(vLLM's per-request stats: ``RequestOutput.metrics``), for one ``generate`` call of ``N = 1 + --decode-tokens``
tokens over the batch: the step time every request sees, not throughput, with neither the prefill nor the
requests' arrival in it (wall time over the call carried both: at batch 8 and 64 its TTFT alone varied by up to
50 ms). A measurement is the median over the requests whose first token came last (their decode ran after every
prefill of the batch: ``request_times``); TTFT is the median of vLLM's first-token latency over the batch.
Reported: the median over repetitions of the paired ratio to vanilla, with its min and max, and the median
ms/token.

A second measure, ``step_ms``, is the median time between two consecutive engine steps in which every request
of the batch got a token (``full_batch_gaps``, from the engine core's timestamp on each step's outputs). It
leaves out the steps that still prefill late arrivals and the tail where early requests have finished, which
the per-request measure spans; at batch 256 the engine starts stepping before all requests have arrived, so
how many requests "started last" varies (5 to 255 in one run).

``--profile`` then runs one more ``generate`` per engine, batch and mode under vLLM's torch profiler and reports
what the GPU ran in a decode step (``gpu_trace.py``: kernels, their time, span and period of the decode graph
replay, how busy the GPU was), with the kernels that differ from the vanilla engine's idle step.

    python benchmarks/bench_decode.py --shape qwen3-4b --batches 1,8,64,256 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gpu_trace  # beside this script

MODES = {
    "plain": "no request steered (vanilla: the baseline; hotwire: loaded and idle)",
    "steered": "every request steered: one vector at one middle layer",
    "steered_faint": "every request steered as in steered, with a scale (1e-6) too small to move a bf16 stream: the "
                     "op's cost alone, where steering would change the work (a mixture of experts with dummy weights "
                     "routes a steered stream to fewer experts)",
    "steered_all_layers": "every request steered: one vector at every layer",
    "stacked": "every request steered: 4 entries on the same layer",
    "distinct": "every request its own vector (up to 256 distinct), one middle layer",
    "read4": "every request reads 4 probes at one middle layer, on its generated tokens (op_readout, op_readout_used)",
    "steered_read4": "every request steered at one middle layer and reading 4 probes there (op_readout, op_readout_used)",
    "steered_gated": "every request steered at one middle layer, gated on a probe two layers below that always "
                     "holds (per token; op_readout, op_readout_used): the cost of the gate against steered",
}
READ_MODES = ("read4", "steered_read4", "steered_gated")
CONFIGS = {
    "vanilla": "plain vLLM 0.25.1, no plugin loaded (VLLM_PLUGINS=\"\")",
    "op": "hotwire, opaque Triton op (HOTWIRE_IMPL=op), idle graph variants for unsteered steps (the default)",
    "op_1set": "hotwire's op with one graph set for steered and unsteered steps (HOTWIRE_IDLE_GRAPHS=0)",
    "op_8layers": "hotwire's op hooked on the 8 middle layers only (HOTWIRE_LAYERS=n/2-4..n/2+3)",
    "op_nopdl": "hotwire's op launched without programmatic dependent launch (HOTWIRE_PDL=0)",
    "op_capture": "hotwire's op with the capture op compiled in (HOTWIRE_CAPTURE=1), nobody capturing",
    "op_readout": "hotwire's op with the readout op compiled in (HOTWIRE_READOUT=1, 4 probes per request)",
    "op_readout_used": "op_readout with the read op only at the layers the read modes read (HOTWIRE_READOUT_LAYERS="
                       "n/2-2,n/2)",
    "inductor": "hotwire, torch ops fused by Inductor (HOTWIRE_IMPL=inductor)",
    "eager": "hotwire's op with enforce_eager=True (no torch.compile, no CUDA graphs)",
}
PROFILE_STEPS = 32  # decode steps in a profiled generate (--profile): a trace of a few MB


def _extra_args(mode: str, n_layers: int, i: int) -> dict[str, str] | None:
    """A request's ``extra_args`` in ``mode``: its spec and its readout (None: a plain request)."""
    extra = {}
    spec = _spec(mode.removesuffix("_read4") if mode.endswith("_read4") else mode, n_layers, i)
    if spec is not None:
        extra["hotwire"] = spec
    if mode in ("read4", "steered_read4"):
        probes = [{"id": f"v{k}", "layer": n_layers // 2} for k in range(4)]
        extra["hotwire_readout"] = json.dumps({"probes": probes, "tokens": "generated"})
    return extra or None


def _spec(mode: str, n_layers: int, i: int) -> str | None:
    mid = n_layers // 2
    if mode in ("plain", "read4"):
        return None
    if mode == "steered":
        return json.dumps({"id": "v0", "layer": mid, "scale": 2.0})
    if mode == "steered_faint":
        return json.dumps({"id": "v0", "layer": mid, "scale": 1e-6})
    if mode == "steered_gated":
        return json.dumps({"id": "v0", "layer": mid, "scale": 2.0, "when": {"id": "v1", "layer": mid - 2, "above": -1e30}})
    if mode == "steered_all_layers":
        return json.dumps({"id": "v0", "layer": list(range(n_layers)), "scale": 0.5})
    if mode == "stacked":
        return json.dumps([{"id": f"v{k}", "layer": mid, "scale": 0.5} for k in range(4)])
    if mode == "distinct":
        return json.dumps({"id": f"v{i % 256}", "layer": mid, "scale": 2.0})
    raise ValueError(mode)


# -- worker: one engine, answers one measurement per line on stdin ----------------------------------------------


def worker(args: argparse.Namespace) -> None:
    if args.cores:
        os.sched_setaffinity(0, args.cores)  # before vLLM starts: its engine-core process inherits the set
    import torch
    from vllm import LLM, SamplingParams

    from hotwire_core.verify import untimed_compilation_config

    kind = split_config(args.config)[0]
    llm = LLM(
        args.model, load_format="dummy", dtype="bfloat16", max_model_len=1024, max_num_seqs=args.max_batch,
        # A fixed KV cache: memory profiling miscounts while the other engines start on the same GPU.
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)), gpu_memory_utilization=0.05, seed=0, enforce_eager=kind == "eager",
        disable_log_stats=False,  # per-request timestamps (RequestOutput.metrics)
        # The worker builds its profiler on the first start_profile: until then the engine is the same as without.
        profiler_config={"profiler": "torch", "torch_profiler_dir": str(args.profile_dir), "torch_profiler_with_stack": False,
                         "torch_profiler_dump_cuda_time_total": False} if args.profile_dir else None,
        compilation_config=untimed_compilation_config() if args.untimed else None,
    )
    hf = llm.llm_engine.model_config.hf_config
    n_layers = hf.num_hidden_layers
    if kind != "vanilla":
        from hotwire_core.offline import register_vector

        g = torch.Generator().manual_seed(0)
        for k in range(args.vectors):
            register_vector(llm, f"v{k}", torch.randn(hf.hidden_size, generator=g) * 0.01)
    rng = torch.Generator().manual_seed(1)
    vocab = min(hf.vocab_size, 30000)

    def timed(batch: int, mode: str, n: int) -> dict:
        prompts = [{"prompt_token_ids": torch.randint(0, vocab, (args.prompt_len,), generator=rng).tolist()}
                   for _ in range(batch)]
        params = []
        for i in range(batch):
            # No detokenizing: frontend CPU work hotwire does not touch, which at batch 256 may bound the step.
            # Readouts are not taken: the workers keep a bounded number (Handouts) and the timing ends at the
            # last token; their copy-out runs every step all the same.
            params.append(SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False,
                                         extra_args=_extra_args(mode, n_layers, i)))
        return request_times(llm.generate(prompts, params, use_tqdm=False))

    clock = StepClock(llm.llm_engine.engine_core)
    print("READY", flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        batch, mode = job["batch"], job["mode"]
        if job.get("profile"):
            print("RESULT " + json.dumps(profiled(llm, lambda: timed(batch, mode, 1 + PROFILE_STEPS), args.profile_dir)), flush=True)
            continue
        clock.steps.clear()
        got = timed(batch, mode, 8 if job.get("warmup") else 1 + args.decode_tokens)
        got.update(step_quantiles(full_batch_gaps(clock.steps, batch)))
        print("RESULT " + json.dumps({} if job.get("warmup") else got), flush=True)


def profiled(llm: Any, run: Any, directory: Path) -> dict:
    """``run()`` under the worker's torch profiler; the summary of the trace it wrote (which is then deleted)."""
    llm.start_profile()
    try:
        run()
    finally:
        llm.stop_profile()
    trace = gpu_trace.newest_trace(directory)
    summary = gpu_trace.summarize(gpu_trace.load_events(trace))
    trace.unlink()
    return summary


class StepClock:
    """Records ``(engine core timestamp, requests that got a token)`` for every step's outputs the frontend
    receives, by wrapping the engine client's ``get_output`` (vLLM 0.25.1: one ``EngineCoreOutputs`` per engine
    step, stamped with ``time.monotonic()`` in the engine core when the step's outputs are made)."""

    def __init__(self, engine_core: Any):
        self.steps: list[tuple[float, int]] = []
        get_output = engine_core.get_output

        def recording_get_output(*args: Any, **kwargs: Any) -> Any:
            outputs = get_output(*args, **kwargs)
            emitted = sum(1 for o in outputs.outputs if o.new_token_ids)
            if emitted:
                self.steps.append((outputs.timestamp, emitted))
            return outputs

        engine_core.get_output = recording_get_output


def full_batch_gaps(steps: list[tuple[float, int]], batch: int) -> list[float]:
    """Milliseconds between consecutive steps in which all ``batch`` requests got a token."""
    return [(t - t_prev) * 1e3 for (t_prev, n_prev), (t, n) in zip(steps, steps[1:]) if n_prev == n == batch]


def step_quantiles(gaps: list[float]) -> dict:
    """``step_ms`` (the median gap) and its 10th and 90th percentiles, which tell a measurement whose every step
    was slow from one with a few slow steps; None where there are fewer than two gaps."""
    if len(gaps) < 2:
        return {"step_ms": gaps[0] if gaps else None, "step_p10_ms": None, "step_p90_ms": None}
    deciles = statistics.quantiles(gaps, n=10)
    return {"step_ms": statistics.median(gaps), "step_p10_ms": deciles[0], "step_p90_ms": deciles[-1]}


def request_times(outputs: list) -> dict:
    """Decode ms/token and TTFT (ms) of a batch, from vLLM's per-request stats (the engine core's timestamps of
    each request's first and last token; the frontend's first-token latency).

    Decode is the median over the requests whose first token came last (one step): their whole decode ran after
    every prefill of the batch (its last steps with fewer requests, as the ones that started earlier finish
    earlier). An earlier request's decode also spans the steps that prefilled later ones (at batch 256 its time
    per token varied by 0.5 ms of 7.4 within one batch)."""
    stats = []
    for out in outputs:
        m = out.metrics
        if m is None or m.num_generation_tokens < 2:
            raise RuntimeError(f"request {out.request_id}: no per-request stats (metrics={m!r})")
        stats.append(m)
    started_last = max(m.first_token_ts for m in stats)
    late = [(m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1) * 1e3
            for m in stats if m.first_token_ts == started_last]
    return {"decode_ms": statistics.median(late), "ttft_ms": statistics.median(m.first_token_latency * 1e3 for m in stats),
            "late_requests": len(late)}


class Engine:
    """A worker process and its line protocol."""

    def __init__(self, config: str, args: argparse.Namespace, model: Path, n_layers: int, cores: range | None = None):
        env = dict(os.environ)
        kind, runner = split_config(config)
        if runner == "v1":
            env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        else:
            env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        if kind == "vanilla":
            env["VLLM_PLUGINS"] = ""
        else:
            env.pop("VLLM_PLUGINS", None)
            env["HOTWIRE_IMPL"] = "inductor" if kind == "inductor" else "op"
            env["HOTWIRE_IDLE_GRAPHS"] = "0" if kind == "op_1set" else "1"
            env["HOTWIRE_PDL"] = "0" if kind == "op_nopdl" else "1"
            env["HOTWIRE_CAPTURE"] = "1" if kind == "op_capture" else "0"
            env["HOTWIRE_READOUT"] = "1" if kind.startswith("op_readout") else "0"
            env.pop("HOTWIRE_READOUT_LAYERS", None)
            if kind == "op_readout_used":
                env["HOTWIRE_READOUT_LAYERS"] = f"{n_layers // 2 - 2},{n_layers // 2}"
            env["HOTWIRE_READOUT_PROBES"] = "4"
            env.pop("HOTWIRE_LAYERS", None)
            if kind == "op_8layers":
                env["HOTWIRE_LAYERS"] = middle_layers(n_layers, 8)
        tag = config.replace("/", "-")
        # Separate compile caches: engines compiling at once must not race on one cache directory.
        env["VLLM_CACHE_ROOT"] = str(Path(tempfile.gettempdir()) / f"hotwire-bench-cache-{tag}")
        vectors = 256 if "distinct" in args.modes else 4
        cmd = [sys.executable, __file__, "--worker", config, "--model", str(model), "--max-batch",
               str(max(args.batches)), "--kv-cache-gib", str(args.kv_cache_gib), "--vectors", str(vectors),
               "--decode-tokens", str(args.decode_tokens), "--prompt-len", str(args.prompt_len)]
        if cores:
            cmd += ["--cores", f"{cores.start}-{cores.stop - 1}"]
        if args.untimed:
            cmd.append("--untimed")
        if args.profile:
            cmd += ["--profile-dir", tempfile.mkdtemp(prefix=f"hotwire-trace-{tag}-")]
        self.config = config
        self.log = open(Path(tempfile.gettempdir()) / f"hotwire-bench-{tag}.log", "w")
        # vLLM's logs go to the log file: a full stdout pipe would stall an engine until this process reads it.
        env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, start_new_session=True)

    def _line(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise RuntimeError(f"{self.config} engine exited ({self.proc.wait()}); see {self.log.name}")

    def ready(self) -> None:
        self._line("READY")

    def measure(self, batch: int, mode: str, warmup: bool = False, profile: bool = False) -> dict:
        self.proc.stdin.write(json.dumps({"batch": batch, "mode": mode, "warmup": warmup, "profile": profile}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line("RESULT "))

    def close(self, finished: bool) -> None:
        """Let a finished engine shut down cleanly; kill one that is still starting or measuring."""
        if self.proc.poll() is not None:
            return
        if finished:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
                return
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine's own processes too
        self.proc.wait()


def parse_cores(text: str) -> list[int]:
    """``"4-7"`` -> ``[4, 5, 6, 7]``."""
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def engine_cores(n_engines: int, per_engine: int, available: list[int]) -> list[range | None]:
    """Disjoint core ranges, one per engine, taken in order from ``available`` (which must hold them as runs of
    consecutive cores); ``per_engine == 0`` pins nothing."""
    if per_engine <= 0:
        return [None] * n_engines
    if n_engines * per_engine > len(available):
        raise ValueError(f"--cores-per-engine {per_engine} needs {n_engines * per_engine} cores for {n_engines} "
                         f"engines; this process may use {len(available)}")
    sets = [available[i * per_engine:(i + 1) * per_engine] for i in range(n_engines)]
    if any(s[-1] - s[0] != per_engine - 1 for s in sets):
        raise ValueError(f"--cores-per-engine needs consecutive cores; this process may use {available}")
    return [range(s[0], s[-1] + 1) for s in sets]


def middle_layers(n_layers: int, count: int) -> str:
    """``HOTWIRE_LAYERS`` for ``count`` layers centred on ``n_layers // 2`` (the layer the steered modes use)."""
    first = max(0, n_layers // 2 - count // 2)
    return f"{first}-{min(n_layers, first + count) - 1}"


_CAPTURE_LINE = re.compile(r"Graph capturing finished in ([\d.]+) secs, took ([\d.]+) GiB")


def graph_capture(log: str) -> dict | None:
    """What vLLM logged about CUDA graph capture: seconds and GiB (None when it logged nothing, e.g. eager)."""
    found = _CAPTURE_LINE.findall(log)
    if not found:
        return None
    secs, gib = found[-1]
    return {"seconds": float(secs), "gib": float(gib)}


def split_config(config: str) -> tuple[str, str]:
    """``"op/v1"`` -> ``("op", "v1")``; no suffix means the default V2 runner."""
    kind, _, runner = config.partition("/")
    return kind, runner or "v2"


def baseline_of(config: str) -> str:
    """The vanilla engine a configuration is paired with: the one on the same runner."""
    return "vanilla" + ("/v1" if split_config(config)[1] == "v1" else "")


def modes_of(config: str, modes: list[str]) -> list[str]:
    kind = split_config(config)[0]
    if not kind.startswith("op_readout"):
        modes = [m for m in modes if m not in READ_MODES]
    if kind == "vanilla":
        return ["plain"]
    if kind == "eager":
        return [m for m in modes if m in ("plain", "steered")]
    if kind == "op_8layers":
        return [m for m in modes if m != "steered_all_layers"]
    return modes


def rotated(items: list, rep: int) -> list:
    """``items`` starting at position ``rep`` (mod its length): repetition ``rep``'s measuring order."""
    shift = rep % len(items)
    return items[shift:] + items[:shift]


def measure(engines: list[Engine], args: argparse.Namespace) -> list[dict]:
    """Every repetition runs every engine's modes, engines and each engine's modes in an order rotated per
    repetition, and each engine first runs an unrecorded short warm-up: no mode is always the first to run after
    another engine (which may leave caches and clocks in another state; before 75e724b ``plain`` always was,
    while steered modes never were, which could favour them)."""
    rows: list[dict] = []
    for batch in args.batches:
        for e in engines:
            for mode in modes_of(e.config, args.modes):
                e.measure(batch, mode, warmup=True)  # first sight of these batch shapes
        for rep in range(args.reps):
            for e in rotated(engines, rep):
                modes = rotated(modes_of(e.config, args.modes), rep)
                e.measure(batch, modes[0], warmup=True)
                for mode in modes:
                    got = e.measure(batch, mode)
                    rows.append({"config": e.config, "mode": mode, "batch": batch, "rep": rep, **got})
                    print("RESULT " + json.dumps(rows[-1]), flush=True)
    return rows


def profile(engines: list[Engine], args: argparse.Namespace) -> list[dict]:
    """One profiled ``generate`` per engine, batch and mode (after ``measure``'s warm-ups): what the GPU ran."""
    profiles = []
    for batch in args.batches:
        for e in engines:
            for mode in modes_of(e.config, args.modes):
                profiles.append({"config": e.config, "mode": mode, "batch": batch, **e.measure(batch, mode, profile=True)})
                print("PROFILE " + json.dumps({k: v for k, v in profiles[-1].items() if k != "by_name"}), flush=True)
    return profiles


def profile_table(profiles: list[dict]) -> str:
    """Per engine, mode and batch: the decode graph replay's kernels, their summed time, span and period, how busy
    the GPU was, and the kernels that differ from the vanilla engine's (same runner, same batch)."""
    base = {(p["config"], p["batch"]): p for p in profiles if p["mode"] == "plain"}
    lines = ["| config | mode | batch | replays | kernels | kernel µs | span µs | period µs | GPU busy | kernels unlike vanilla's "
             "(count, µs per replay: vanilla → this) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in profiles:
        if not p["replays"]:
            lines.append(f"| {p['config']} | {p['mode']} | {p['batch']} | 0 | — | — | — | — | — | no graph replay traced |")
            continue
        vanilla = base.get((baseline_of(p["config"]), p["batch"]))
        diff = "—" if vanilla is None or vanilla is p else "; ".join(
            f"`{d['name'][:60]}` {d['count'][0]:g}→{d['count'][1]:g}, {d['us'][0]:.1f}→{d['us'][1]:.1f}"
            for d in gpu_trace.kernel_diff(vanilla, p)[:4]) or "none"
        period = "—" if p["period_us"] is None else f"{p['period_us']:.1f}"
        lines.append(f"| {p['config']} | {p['mode']} | {p['batch']} | {p['replays']} | {p['kernels']} | "
                     f"{p['kernel_us']:.1f} | {p['span_us']:.1f} | {period} | {p['busy'] * 100:.1f}% | {diff} |")
    return "\n".join(lines)


def _median_min_max(xs: list[float]) -> tuple[float | None, float | None, float | None]:
    return (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)


def _paired(rows: list[dict], base: dict[tuple, float | None], metric: str, prefix: str) -> dict:
    """Median, min and max of ``metric`` over ``rows`` (one cell's repetitions) and of its ratio to the vanilla run
    of the same round (``base``: the vanilla rows' ``metric`` by (config, batch, rep)); rows without the metric
    (None, or absent in older files) are left out."""
    values, ratios = [], []
    for r in rows:
        if r.get(metric) is None:
            continue
        values.append(r[metric])
        vanilla = base.get((baseline_of(r["config"]), r["batch"], r["rep"]))
        if vanilla is not None:
            ratios.append(r[metric] / vanilla - 1)
    (med, lo, hi), (rel, rel_lo, rel_hi) = _median_min_max(values), _median_min_max(ratios)
    return {metric: med, f"{metric}_min": lo, f"{metric}_max": hi,
            prefix: rel, f"{prefix}_min": rel_lo, f"{prefix}_max": rel_hi}


def summarize(rows: list[dict]) -> list[dict]:
    """Per (config, mode, batch): median ms/token, full-batch step ms and TTFT, and each one's paired ratio to
    vanilla per repetition."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["mode"], r["batch"]), []).append(r)
    vanilla = [r for r in rows if split_config(r["config"])[0] == "vanilla"]
    base = {metric: {(r["config"], r["batch"], r["rep"]): r.get(metric) for r in vanilla}
            for metric in ("decode_ms", "step_ms")}
    return [{"config": config, "mode": mode, "batch": batch, "reps": len(rs),
             **_paired(rs, base["decode_ms"], "decode_ms", "vs_vanilla"),
             **_paired(rs, base["step_ms"], "step_ms", "vs_vanilla_step"),
             "ttft_ms": statistics.median(r["ttft_ms"] for r in rs)}
            for (config, mode, batch), rs in groups.items()]


def _cell(s: dict, metric: str, prefix: str) -> tuple[str, str]:
    """``(ms (min-max), ratio (min..max))`` for the table; a dash where there is nothing to show."""
    if s[metric] is None:
        return "—", "—"
    ms = f"{s[metric]:.3f} ({s[f'{metric}_min']:.3f}-{s[f'{metric}_max']:.3f})"
    if split_config(s["config"])[0] == "vanilla" or s[prefix] is None:
        return ms, "—"
    return ms, f"{s[prefix] * 100:+.2f}% ({s[f'{prefix}_min'] * 100:+.1f}..{s[f'{prefix}_max'] * 100:+.1f})"


def table(summary: list[dict]) -> str:
    lines = ["| config | mode | batch | decode ms/token (median, min-max) | vs vanilla, paired (median, min..max) "
             "| full-batch step ms | vs vanilla, per step | TTFT ms |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        decode, rel = _cell(s, "decode_ms", "vs_vanilla")
        step, step_rel = _cell(s, "step_ms", "vs_vanilla_step")
        lines.append(f"| {s['config']} | {s['mode']} | {s['batch']} | {decode} | {rel} | {step} | {step_rel} "
                     f"| {s['ttft_ms']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-4b", help="a shape from hotwire_core.tiny_model.SHAPES")
    parser.add_argument("--configs", default="vanilla,op,inductor", help=",".join(CONFIGS))
    parser.add_argument("--modes", default="plain,steered", help=",".join(MODES))
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--kv-cache-gib", type=float, default=12.0, help="KV cache of each engine")
    parser.add_argument("--one-by-one", action="store_true",
                        help="start each engine once the previous one is ready (slower start; the graph capture "
                             "time and memory vLLM logs are then each engine's own)")
    parser.add_argument("--cores-per-engine", type=int, default=0,
                        help="give engine i (in --configs order) the CPU cores [i*N, (i+1)*N) of this process's "
                             "own set, so that engines never share a core; 0 (default): no pinning")
    parser.add_argument("--untimed", action="store_true",
                        help="compile every engine with no Inductor kernel choice left to timing "
                             "(hotwire_core.verify.UNTIMED_INDUCTOR), so that all engines run the same kernels")
    parser.add_argument("--profile", action="store_true",
                        help=f"after the repetitions (--reps 0: none), one generate of {PROFILE_STEPS} decode steps per "
                             "engine, batch and mode under vLLM's torch profiler: the decode step's kernels")
    parser.add_argument("--out", type=Path, required=False)
    parser.add_argument("--worker", dest="config", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--max-batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--vectors", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cores", type=parse_cores, help=argparse.SUPPRESS)
    parser.add_argument("--profile-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.modes = args.modes.split(",")
    if args.config:
        return worker(args)
    configs = args.configs.split(",")
    unknown = [c for c in configs if split_config(c)[0] not in CONFIGS or split_config(c)[1] not in ("v1", "v2")]
    unknown += [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown configs/modes {unknown}")
    missing = {baseline_of(c) for c in configs} - set(configs)
    if missing:
        parser.error(f"--configs needs the baselines {sorted(missing)}")
    try:
        core_sets = engine_cores(len(configs), args.cores_per_engine, sorted(os.sched_getaffinity(0)))
    except ValueError as e:
        parser.error(str(e))

    from hotwire_core.tiny_model import SHAPES, build_model

    model = build_model(Path(tempfile.gettempdir()) / f"hotwire-bench-{args.shape}", args.shape, weights=False)
    start = time.time()
    engines: list[Engine] = []
    finished = False
    try:
        for config, cores in zip(configs, core_sets):
            engines.append(Engine(config, args, model, SHAPES[args.shape].num_layers, cores))
            if args.one_by_one:
                engines[-1].ready()
        if not args.one_by_one:
            for e in engines:
                e.ready()
        print(f"{len(engines)} engines ready in {time.time() - start:.0f} s", flush=True)
        capture = {e.config: graph_capture(Path(e.log.name).read_text(errors="replace")) for e in engines}
        for config, logged in capture.items():
            print(f"{config}: graph capture {logged}", flush=True)
        rows = measure(engines, args)
        profiles = profile(engines, args) if args.profile else []
        finished = True
    finally:
        for e in engines:
            e.close(finished)
    summary = summarize(rows)
    print(table(summary))
    if profiles:
        print(profile_table(profiles))
    if args.out:
        _write(args, rows, summary, capture, profiles)


def _write(args: argparse.Namespace, rows: list[dict], summary: list[dict], capture: dict, profiles: list[dict]) -> None:
    import torch
    import vllm

    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "shape": args.shape,
        "command": " ".join(sys.argv),
        "inductor": "UNTIMED_INDUCTOR (no kernel choice by timing)" if args.untimed else "vLLM's default compile",
        "method": "decode ms/token per request = (last token - first token) / (N - 1) on the engine core's clock "
                  "(RequestOutput.metrics), median over the requests whose first token came last; step_ms = median "
                  "engine-core time between consecutive steps in which every request got a token; engines side by "
                  "side, round-robin, rotated order; ratios paired per round with vanilla; medians over reps",
        "configs": {c: CONFIGS[split_config(c)[0]] + ("; V1 model runner" if split_config(c)[1] == "v1" else "")
                    for c in args.configs.split(",")},
        "modes": {m: MODES[m] for m in args.modes},
    }
    meta["graph_capture"] = {"engines_started": "one by one" if args.one_by_one else "side by side", **capture}
    out = {"meta": meta, "summary": summary, "table": table(summary), "rows": rows}
    if profiles:
        out.update(profile_table=profile_table(profiles), profiles=profiles)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
