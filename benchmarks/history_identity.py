"""Does a steered request change the plain requests that follow it on the same prompt, or is that vLLM's own
dependence on request history?

Reported on an H200 (bf16, CUDA graphs, prefix caching, real random weights): a 64-token prompt run steered, then
the same prompt plain twice, and both plain runs differed from plugin-free vLLM by 8e-5 in a logprob, while
plugin-free vLLM's own uncached and cached runs of the prompt were identical (shorter prompts were identical). Here a
plugin-free engine is given the SAME history, so hotwire's plain requests are compared like for like.

Four engines, one process each (their own compile cache; all compiled with ``verify.UNTIMED_INDUCTOR`` on a GPU, so
that separately compiled engines run the same kernels), each running, for every prompt length, one after another,
greedy, ``max_tokens`` 16, ``logprobs=5``:

- ``hotwire-history``:  H = the prompt steered (a seeded random vector of norm 1, scale 40, the middle layer),
  then P1, P2 = the prompt plain, twice;
- ``vanilla-history``:  no plugin (``VLLM_PLUGINS=""``); H = the prompt plain with ``cache_salt="history"``:
  history is EMULATED by the salt, which puts the prompt's KV in other blocks, as hotwire's salt does for a
  steered request; then P1, P2 plain;
- ``hotwire-control``, ``vanilla-control``: P1, P2 only (no history).

Each length has its own prompt (seeded random token ids, so lengths are exact), so one length's history is not
another's; an engine still runs the lengths in order. Reported for every (length, P1/P2): the largest |logprob
difference| over the generated positions and their top-5 entries (positions compared up to the first differing
sampled token, entries present in both), for hotwire vs vanilla (with history, and without), vanilla with vs
without history, hotwire with vs without history, and whether the sampled tokens match; with a reading of
which of the three explanations the pattern fits:

- ``hotwire``: hotwire's plain requests change after the steered one while vanilla's do not after the same history
  (steered state or KV reaching the plain request: block reuse, graph set, cache salt);
- ``vllm``: vanilla's plain requests change with history too (vLLM's own dependence on request history);
- ``base``: hotwire differs from vanilla even with no history.

    python benchmarks/history_identity.py [--model DIR] [--dtype bfloat16] [--lengths 16,32,48,64,80,128]
        [--runner v1|v2] [--log-dir DIR] [--out FILE] [--jobs N]

Without ``--model`` it builds the built-in tiny Qwen3 with random weights (as ``hotwire_core.verify`` does). On a
GPU all four engines start at once (``--jobs``, default 4; each holds a fixed 1 GiB KV cache); on the CPU one at a
time (vLLM's CPU block size is 128, so there no prompt here reads the prefix cache). Logs, compile caches and the
results (``--out``, default ``LOG_DIR/history_identity.json``) stay in ``--log-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hotwire_core.cpu_env import with_cpu_env

ENGINES = ("vanilla-history", "hotwire-history", "vanilla-control", "hotwire-control")
VECTOR_ID = "probe"
SCALE = 40.0
MAX_TOKENS = 16
TOP = 5
HISTORY_SALT = "history"
RUNS = ("P1", "P2")
STEERING_FIRED = 1e-4  # hotwire's steered H must move a logprob by more than this (as verify's MIN_LOGPROB_DELTA)
# The four comparisons per (length, run): (name, engine a, engine b).
PAIRS = (
    ("hw~van hist", "hotwire-history", "vanilla-history"),
    ("hw~van ctrl", "hotwire-control", "vanilla-control"),
    ("van hist~ctrl", "vanilla-history", "vanilla-control"),
    ("hw hist~ctrl", "hotwire-history", "hotwire-control"),
)

# A run as the worker saves it: {"token_ids": [...], "top": [[[token, logprob], ...] per position],
# "num_cached_tokens": n, "finish_reason": str}; "top" holds the top-5 and the sampled token, in rank order.
Run = dict[str, Any]


# -- pure: prompts, comparison, reading ----------------------------------------------------------------------------


def make_prompt(length: int, vocab: Sequence[int]) -> list[int]:
    """``length`` token ids drawn from ``vocab``, seeded by the length: every length gets its own prompt."""
    rng = random.Random(f"history-identity-{length}")
    return [vocab[rng.randrange(len(vocab))] for _ in range(length)]


def parse_lengths(text: str) -> list[int]:
    lengths = [int(part) for part in text.split(",") if part.strip()]
    if not lengths or any(n < 1 for n in lengths) or len(set(lengths)) != len(lengths):
        raise ValueError(f"--lengths needs distinct positive integers, got {text!r}")
    return lengths


def _diff(x: float, y: float) -> float:
    return 0.0 if x == y else abs(x - y)  # equal infinities differ by 0, not nan


def compare_runs(a: Run, b: Run) -> dict[str, Any]:
    """How two runs of one prompt differ: ``max_abs`` (largest |logprob difference| over the top entries both hold,
    at the positions up to and including the first one whose sampled tokens differ: later ones continue different
    texts), ``first_diff`` (the first such position with any difference, None if none), ``tokens_match``,
    ``entry_sets_differ`` (positions whose top entries are different token sets), ``compared`` (entries compared)."""
    tokens_a, tokens_b = a["token_ids"], b["token_ids"]
    tokens_match = tokens_a == tokens_b
    worst, first, sets_differ, compared = 0.0, None, 0, 0
    n = min(len(a["top"]), len(b["top"]))
    for pos in range(n):
        top_a, top_b = dict(map(tuple, a["top"][pos])), dict(map(tuple, b["top"][pos]))
        common = top_a.keys() & top_b.keys()
        here = max((_diff(top_a[t], top_b[t]) for t in common), default=0.0)
        compared += len(common)
        if top_a.keys() != top_b.keys():
            sets_differ += 1
        if here > 0 or top_a.keys() != top_b.keys():
            first = pos if first is None else first
        worst = max(worst, here)
        if pos >= len(tokens_a) or pos >= len(tokens_b) or tokens_a[pos] != tokens_b[pos]:
            break
    if len(a["top"]) != len(b["top"]) and tokens_match:
        worst, first = math.inf, n if first is None else first
    return {"max_abs": worst, "first_diff": first, "tokens_match": tokens_match, "entry_sets_differ": sets_differ,
            "compared": compared}


def same(c: dict[str, Any], tolerance: float) -> bool:
    return c["tokens_match"] and c["entry_sets_differ"] == 0 and c["max_abs"] <= tolerance


def reading(cmp: dict[str, dict[str, Any]], tolerance: float) -> str:
    """Which explanation one (length, run)'s four comparisons (keyed by :data:`PAIRS` names) fit; see the module
    docstring. Several codes joined by ``+`` where several hold."""
    hv_hist, hv_ctrl = same(cmp["hw~van hist"], tolerance), same(cmp["hw~van ctrl"], tolerance)
    van_hist, hw_hist = same(cmp["van hist~ctrl"], tolerance), same(cmp["hw hist~ctrl"], tolerance)
    if hv_hist and hv_ctrl and van_hist and hw_hist:
        return "identical"
    codes = []
    if not hv_ctrl:
        codes.append("base")
    if not van_hist:
        codes.append("vllm")
    if not hv_hist and not hw_hist and van_hist:
        codes.append("hotwire")
    elif not hv_hist and not van_hist:
        codes.append("hotwire?")  # vLLM moves with history, and hotwire's history moves it otherwise
    return "+".join(codes) or "mixed"


def fmt(c: dict[str, Any]) -> str:
    """``0``, ``8e-05`` (``-``: no entry in common), with ``!tok`` when sampled tokens differ, ``!set`` when top-5
    sets differ and ``@3`` for the first position that differs."""
    if c.get("compared") == 0 and c["entry_sets_differ"]:
        text = "-"
    else:
        text = "0" if c["max_abs"] == 0 else f"{c['max_abs']:.2g}"
    if not c["tokens_match"]:
        text += "!tok"
    if c["entry_sets_differ"]:
        text += "!set"
    if c["first_diff"] is not None:
        text += f"@{c['first_diff']}"
    return text


def build_rows(results: dict[str, dict[str, dict[str, Run]]], lengths: Sequence[int], tolerance: float) -> list[dict]:
    """One row per (length, run) of every engine's results (``results[engine][str(length)][run]``)."""
    rows = []
    for length in lengths:
        for run in RUNS:
            cmp = {name: compare_runs(results[a][str(length)][run], results[b][str(length)][run])
                   for name, a, b in PAIRS}
            cached = {e: results[e][str(length)][run]["num_cached_tokens"] for e in ENGINES}
            rows.append({"length": length, "run": run, "cached_tokens": cached, "comparisons": cmp,
                         "reading": reading(cmp, tolerance)})
    return rows


def history_rows(results: dict[str, dict[str, dict[str, Run]]], lengths: Sequence[int]) -> list[dict]:
    """Per length, the history request H: how far steering moved it (hotwire H vs vanilla's salted H: must be large)
    and vanilla's salted H vs the control's P1 (the same computation in other blocks)."""
    rows = []
    for length in lengths:
        hw_h, van_h = results["hotwire-history"][str(length)]["H"], results["vanilla-history"][str(length)]["H"]
        steering = compare_runs(hw_h, van_h)
        rows.append({
            "length": length,
            "steering_effect": steering,
            "steering_fired": not steering["tokens_match"] or steering["max_abs"] > STEERING_FIRED,
            "vanilla_salted_H_vs_control_P1": compare_runs(van_h, results["vanilla-control"][str(length)]["P1"]),
            "cached_tokens": {"hotwire": hw_h["num_cached_tokens"], "vanilla": van_h["num_cached_tokens"]},
            "finish_reason": {"hotwire": hw_h["finish_reason"], "vanilla": van_h["finish_reason"]},
        })
    return rows


def format_table(rows: Sequence[dict], history: Sequence[dict]) -> str:
    names = [name for name, _, _ in PAIRS]
    head = ["len", "run", "cached vh/hh/vc/hc", *names, "reading"]
    body = []
    for row in rows:
        cached = "/".join(str(row["cached_tokens"][e]) for e in ENGINES)
        body.append([str(row["length"]), row["run"], cached, *(fmt(row["comparisons"][n]) for n in names),
                     row["reading"]])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [head, *body]]
    lines.insert(1, "-" * len(lines[0]))
    for h in history:
        lines.append(f"H at {h['length']}: steering moved it by {fmt(h['steering_effect'])} "
                     f"({'fired' if h['steering_fired'] else 'DID NOT FIRE'}; finish {h['finish_reason']['hotwire']}); "
                     f"vanilla salted H vs control P1: {fmt(h['vanilla_salted_H_vs_control_P1'])}; cached tokens "
                     f"hotwire {h['cached_tokens']['hotwire']}, vanilla {h['cached_tokens']['vanilla']}")
    return "\n".join(lines)


# -- the engines ---------------------------------------------------------------------------------------------------


def _summarize(output: Any) -> Run:
    c = output.outputs[0]
    top = [sorted(([int(t), float(lp.logprob)] for t, lp in pos.items()), key=lambda e: -e[1])
           for pos in (c.logprobs or [])]
    return {"token_ids": list(c.token_ids), "top": top, "num_cached_tokens": output.num_cached_tokens or 0,
            "finish_reason": c.finish_reason}


def worker(job_path: str, out_path: str) -> None:
    """One engine: the job's prompts, each with its history (``H``) where the job says so, then ``P1``, ``P2``."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    job = json.loads(Path(job_path).read_text())
    started = time.monotonic()
    llm = LLM(**job["engine"])
    start_s = time.monotonic() - started
    hotwire = job["engine_name"].startswith("hotwire")
    loaded = any(name.startswith("hotwire_core.vllm_glue") for name in sys.modules)
    if loaded != hotwire:
        raise SystemExit("hotwire was loaded although VLLM_PLUGINS is empty" if loaded else
                         "hotwire was not loaded: is hotwire-vllm installed and VLLM_PLUGINS unset?")
    engine = llm.llm_engine
    info: dict[str, Any] = {
        "vllm": vllm.__version__,
        "runner": "v2" if engine.vllm_config.use_v2_model_runner else "v1",
        "block_size": engine.vllm_config.cache_config.block_size,
        "prefix_caching": engine.vllm_config.cache_config.enable_prefix_caching,
        "cudagraph_mode": str(engine.vllm_config.compilation_config.cudagraph_mode),
        "dtype": str(engine.model_config.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "engine_start_s": round(start_s, 1),
    }
    steer_args = None
    if hotwire:
        import hotwire_core
        from hotwire_core.offline import register_vector, slot_stats, steer
        from hotwire_core.settings import middle_layer

        hidden = engine.model_config.get_hidden_size()
        vector = torch.randn(hidden, generator=torch.Generator().manual_seed(0))
        vector = vector / vector.norm()
        register_vector(llm, VECTOR_ID, vector)
        n_layers = engine.model_config.get_total_num_hidden_layers()  # not one pipeline stage's count
        entry = {"id": VECTOR_ID, "layer": middle_layer(slot_stats(llm)["model"]["layers"], n_layers), "scale": SCALE}
        steer_args = steer(entry)
        info.update(hotwire=hotwire_core.__version__, steering=entry, vector_norm=vector.norm().item())

    def params(extra: dict | None = None) -> Any:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP, ignore_eos=True,
                              extra_args=extra)

    def one(ids: list[int], sampling: Any, salt: str | None = None) -> Run:
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if salt is not None:
            prompt["cache_salt"] = salt
        result = _summarize(llm.generate([prompt], [sampling], use_tqdm=False)[0])
        if hotwire:  # which CUDA graph set is in place after the request (hotwire_graph_sets)
            result["graph_sets"] = llm.collective_rpc("hotwire_graph_sets")
        return result

    results: dict[str, dict[str, Run]] = {}
    for length, ids in zip(job["lengths"], job["prompts"]):
        runs: dict[str, Run] = {}
        if job["history"]:
            runs["H"] = one(ids, params(steer_args)) if hotwire else one(ids, params(), salt=HISTORY_SALT)
        runs["P1"] = one(ids, params())
        runs["P2"] = one(ids, params())
        results[str(length)] = runs
    Path(out_path).write_text(json.dumps({"info": info, "results": results}))
    engine.engine_core.shutdown()


def run_engine(name: str, job: dict, log_dir: Path, env_all: dict[str, str], timeout: float) -> dict | str:
    """``name``'s engine in a fresh process; what it saved, or why there is nothing (a string)."""
    job_path, out = log_dir / f"{name}.job.json", log_dir / f"{name}.out.json"
    job_path.write_text(json.dumps(job))
    out.unlink(missing_ok=True)  # an earlier run's results must not stand in for a failed engine
    env = {**env_all, "VLLM_CACHE_ROOT": str(log_dir / f"{name}.cache")}  # its own compile cache
    if name.startswith("hotwire"):
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""
    command = [sys.executable, os.path.abspath(__file__), "--worker", str(job_path), str(out)]
    started = time.monotonic()
    with open(log_dir / f"{name}.log", "w") as log:
        # Its own process group, so that a timeout also ends the engine core process it started.
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timed out after {timeout:.0f} s (log {log_dir / f'{name}.log'})"
    print(f"{name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
    if code != 0 or not out.exists():
        return f"exit {code}, no results (log {log_dir / f'{name}.log'})"
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder; default: the built-in tiny Qwen3 with random weights")
    parser.add_argument("--dtype", help="engine dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--lengths", default="16,32,48,64,80,128", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--runner", choices=("v1", "v2"), help="vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER)")
    parser.add_argument("--log-dir", type=Path, help="logs, caches, jobs and results (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="the JSON results (default: LOG_DIR/history_identity.json)")
    parser.add_argument("--jobs", type=int, help="engines at once (default: 4 on a GPU, 1 on the CPU)")
    parser.add_argument("--engine-timeout", type=float,
                        help="seconds per engine process (default: 420 on a GPU, 3600 on the CPU)")
    parser.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    try:
        lengths = parse_lengths(args.lengths)
    except ValueError as exc:
        parser.error(str(exc))

    import torch

    from hotwire_core import verify as v

    on_gpu = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    tolerance = 0.0 if on_gpu else v.CPU_TOLERANCE
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="hotwire-history-identity-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path = args.out or log_dir / "history_identity.json"

    env_all = dict(os.environ) if on_gpu else with_cpu_env(os.environ)
    env_all.setdefault("VLLM_NO_USAGE_STATS", "1")
    env_all.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env_all["HOTWIRE_STORE"] = "off"  # the probe vector is not kept
    if args.runner:
        env_all["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    model = args.model
    if model is None:
        from hotwire_core.tiny_model import ModelShape, build_model

        env_all["HF_HUB_OFFLINE"] = "1"
        model = str(build_model(log_dir / "tiny-model", ModelShape(arch="qwen3")))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    specials = set(tokenizer.all_special_ids)
    vocab = [t for t in range(tokenizer.vocab_size) if t not in specials]
    prompts = [make_prompt(n, vocab) for n in lengths]
    engine = v.engine_kwargs(model, dtype, 1, 1.0 if on_gpu else None, untimed=on_gpu)
    engine["max_model_len"] = max(engine["max_model_len"], max(lengths) + MAX_TOKENS)
    jobs = args.jobs or (len(ENGINES) if on_gpu else 1)
    timeout = args.engine_timeout or (420.0 if on_gpu else 3600.0)
    print(f"model {model}, dtype {dtype}, lengths {lengths}, {jobs} engine(s) at once, logs in {log_dir}\n"
          f"history: hotwire's H is steered ({VECTOR_ID!r}, norm 1, scale {SCALE:g}, middle layer); vanilla's H is "
          f"EMULATED as the prompt plain with cache_salt={HISTORY_SALT!r} (its KV in other blocks)", flush=True)

    def job(name: str) -> dict:
        return {"engine_name": name, "engine": engine, "lengths": lengths, "prompts": prompts,
                "history": name.endswith("-history")}

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = list(pool.map(lambda name: run_engine(name, job(name), log_dir, env_all, timeout), ENGINES))
    failed = {name: why for name, why in zip(ENGINES, done) if isinstance(why, str)}
    saved = {name: got for name, got in zip(ENGINES, done) if not isinstance(got, str)}
    report: dict[str, Any] = {
        "model": model, "dtype": dtype, "lengths": lengths, "prompts": prompts, "max_tokens": MAX_TOKENS,
        "logprobs": TOP, "tolerance": tolerance, "runner_forced": args.runner,
        "history_emulation": f"vanilla's H: the prompt plain with cache_salt={HISTORY_SALT!r}; hotwire's H: steered",
        "engines": {name: got["info"] for name, got in saved.items()}, "failed": failed,
        "results": {name: got["results"] for name, got in saved.items()},
    }
    if failed:
        out_path.write_text(json.dumps(report, indent=1))
        for name, why in failed.items():
            print(f"{name} failed: {why}", file=sys.stderr)
        print(f"partial results in {out_path}", file=sys.stderr)
        return 1
    results = report["results"]
    report["rows"] = build_rows(results, lengths, tolerance)
    report["history"] = history_rows(results, lengths)
    out_path.write_text(json.dumps(report, indent=1))
    for name, info in report["engines"].items():
        print(f"{name}: {json.dumps(info)}")
    print(f"\nmax |logprob diff| over {MAX_TOKENS} positions x top-{TOP} (a~b: engine a vs b; vh/hh/vc/hc: "
          f"vanilla/hotwire history/control; !tok: sampled tokens differ, !set: top-{TOP} sets differ, @k: first "
          f"differing position; tolerance {tolerance:g})")
    print(format_table(report["rows"], report["history"]))
    print(f"\nresults in {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
