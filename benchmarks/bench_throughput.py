"""Throughput at saturation, in one run: plugin-free vLLM, hotwire serving plain traffic, hotwire serving 75 %
steered traffic.

Two ``vllm serve`` of one model (three with ``--monitors``) start side by side: one without hotwire (``VLLM_PLUGINS=""``: no hotwire code is
loaded in any of its processes) and one with it. Rounds then alternate between three configurations, the order
rotated per round, so that drift of the machine falls on all of them alike:

    vanilla   the plugin-free server, plain requests
    plain     the hotwire server, plain requests
    steered   the hotwire server, ``--steered-share`` (75 %) of the requests steered, each by one of ``--ids``
              registered vectors (a [hidden] vector at the middle layer, scale drawn per request)
    monitored with ``--monitors N``: a third server, hotwire with ``HOTWIRE_READOUT=1`` and N monitors (probes on
              the registered vectors at the middle layer), plain requests: each must carry N verdicts
    salted    with ``--salted``: the plugin-free server, ``--steered-share`` of the requests with a ``cache_salt`` of
              their own and no steering. A steered request's prompt is hashed with a salt of its vector and scale
              (its KV differs from a plain one's), and the scale drawn per request makes every salt new: salted /
              vanilla is what those prefix-cache misses cost vLLM itself, the floor under steered / plain

A round drives ``--clients`` streaming clients (``--workers`` processes, asyncio + httpx, one keep-alive
connection per client) over ``/v1/completions`` and ``/v1/chat/completions`` (half each), ``max_tokens`` tokens
with ``ignore_eos`` at temperature 0, for ``--warmup`` + ``--seconds``; a configuration's throughput is the
number of requests that ended within the measured ``--seconds``, per second. Every request is checked: status
200, ``[DONE]``, ``usage.completion_tokens == max_tokens``, and a receipt naming its vector exactly when steered.
Any other outcome is a failure, and the run exits 1.

Reported: per configuration the median req/s, TTFT p50 and the API server's CPU time per completed request
(the server's main process, over the measured window: where a saturated API server spends what steering adds)
and, from vLLM's ``/metrics``, the engine's steps per completed request and generated tokens per step (each step's
outputs reach the API server as one message, so fewer requests per step cost it more CPU per request), its mean TTFT
from the engine client's ``add_request`` (the client's TTFT less this: time in the API server before the engine) and
its mean queue time in the scheduler, over rounds; per round the paired ratios steered / plain and plain / vanilla,
and their medians (the figures of the targets: ≥ 0.98 and ≥ 0.99; with monitors, monitored / plain, #39's target:
≥ 0.99) with a distribution-free 95% interval of each median (``median_interval``: single rounds have spread ±15%,
so a target is met with confidence only where the interval's low end reaches it; 3 rounds give a 75% interval, 6
a 97% one); per round the busiest client process's CPU over its wall time (near 100%: the clients, not the server, were
the limit). With ``--profile``, py-spy samples the API server over each measured window (``api_profile.py``), and
the report adds its sampled CPU per request by package and by function, plain against plugin-free and steered
against plain: where the extra time goes; the same for the engine core process (one rank on a GPU: vLLM runs the
model runner's host side there too; its CPU backend runs that in a worker process, not sampled).

Every server's API server runs on one core of its own (``--api-core``, by default the last where there are 8 or
more), the client processes on the others: only one server is loaded at a time, so each configuration's API server
finds the same core, and the engines' and clients' placement cannot favour one of them.

    # on the GPU: a small model whose API server saturates first
    python -m benchmarks.bench_throughput --clients 128 --rounds 4 --out throughput.json
    # the GPU the limit instead: a Qwen3-4B shape with dummy weights in bf16, longer answers
    python -m benchmarks.bench_throughput --shape qwen3-4b --max-tokens 128 --monitors 4 --out throughput_4b.json

The monitored server's read op runs only at the monitors' layer (``HOTWIRE_READOUT_LAYERS``), as an operator reading
one layer configures it (docs/usage.md).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from benchmarks.api_profile import Recording, compare, py_spy
from benchmarks.server_processes import cpu_s, engine_core_pid
from hotwire_core.tiny_model import SHAPES, build_model

CONFIGS = ("vanilla", "plain", "steered", "monitored", "salted")
PROMPTS = ("The quick brown fox jumps over", "Once upon a time in a land far", "The capital of France is",
           "In the beginning the universe was", "A short history of the printing press")  # fmt: skip


@dataclass(frozen=True)
class Load:
    """What each client of a round sends."""

    url: str
    model: str
    max_tokens: int
    steered_share: float
    ids: tuple[str, ...]
    layer: int
    scale: float
    monitors: int = 0  # verdicts each answer must carry (hotwire_monitors in the chunk before [DONE])
    salted_share: float = 0.0  # requests sent with a cache_salt of their own (plain ones)


@dataclass
class Tally:
    """One worker's outcome of one round."""

    completed: int = 0  # requests that ended, correctly, within the measured window
    failures: Counter = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    steered: int = 0
    busy: list[float] = field(default_factory=list)  # per client process: its CPU time over the round's wall time

    def merge(self, other: Tally) -> None:
        self.completed += other.completed
        self.failures.update(other.failures)
        self.ttft_s.extend(other.ttft_s)
        self.steered += other.steered
        self.busy.extend(other.busy)


def request_body(load: Load, chat: bool, vector_id: str | None, scale: float, prompt: str,
                 salt: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": load.model, "max_tokens": load.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if salt is not None:
        body["cache_salt"] = salt
    if vector_id is not None:
        body["vllm_xargs"] = {"hotwire": json.dumps({"id": vector_id, "layer": load.layer, "scale": scale})}
    return body


def check_stream(status: int, receipt: str | None, lines: Sequence[str], max_tokens: int, vector_id: str | None,
                 monitors: int = 0) -> str | None:  # fmt: skip
    """The failure kind of one streamed answer, or None when it is what was asked for."""
    if status != 200:
        return f"http_{status}"
    if vector_id is None and receipt is not None:
        return "receipt_on_plain"
    if vector_id is not None and (receipt is None or not receipt.startswith(f"{vector_id}@")):
        return "receipt_missing" if receipt is None else "receipt_wrong"
    data = [line[6:] for line in lines if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return "no_done"
    tokens, verdicts = None, None
    for chunk in data[:-1]:
        event = json.loads(chunk)
        if "error" in event:
            return "error_event"
        if event.get("usage"):
            tokens = event["usage"].get("completion_tokens")
        if "hotwire_monitors" in event:
            verdicts = event["hotwire_monitors"]
    if tokens != max_tokens:
        return "short" if tokens is not None else "no_usage"
    if (verdicts is not None or monitors) and len(verdicts or ()) != monitors:
        return "monitors_missing" if verdicts is None else "monitors_wrong"
    return None


async def _client(load: Load, seed: int, measure_from: float, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=load.url, timeout=httpx.Timeout(120.0),
                                 limits=httpx.Limits(max_connections=1)) as http:  # fmt: skip
        while time.monotonic() < until:
            chat = rng.random() < 0.5
            steered = bool(load.ids) and rng.random() < load.steered_share
            vector_id = rng.choice(load.ids) if steered else None
            salt = f"salt-{seed}-{rng.random()}" if rng.random() < load.salted_share else None
            body = request_body(load, chat, vector_id, load.scale * (1 + 0.5 * rng.random()), rng.choice(PROMPTS),
                                salt)
            path = "/v1/chat/completions" if chat else "/v1/completions"
            start, first, lines = time.monotonic(), None, []
            try:
                async with http.stream("POST", path, json=body) as response:
                    async for line in response.aiter_lines():
                        if first is None and line.startswith("data: "):
                            first = time.monotonic()
                        lines.append(line)
                    status, receipt = response.status_code, response.headers.get("x-hotwire-receipt")
            except httpx.HTTPError as exc:
                if time.monotonic() < until:
                    tally.failures[type(exc).__name__] += 1
                continue
            end = time.monotonic()
            if end > until:
                return  # ended after the window: neither counted nor judged
            failure = check_stream(status, receipt, lines, load.max_tokens, vector_id, load.monitors)
            if failure is not None:
                tally.failures[failure] += 1
            elif end >= measure_from:
                tally.completed += 1
                tally.steered += steered
                if start >= measure_from and first is not None:
                    tally.ttft_s.append(first - start)


def _worker(load: Load, clients: int, seed: int, start_at: float, warmup: float, seconds: float) -> Tally:
    """One process's clients for one round (``start_at`` on the shared ``time.monotonic()`` clock)."""
    tally = Tally()

    async def run() -> None:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        measure_from = start_at + warmup
        await asyncio.gather(*(_client(load, seed * 1000 + i, measure_from, measure_from + seconds, tally)
                               for i in range(clients)))  # fmt: skip

    cpu = time.process_time()
    asyncio.run(run())
    # (the clients' own work before start_at is negligible: the busy share is over the round's traffic)
    tally.busy.append((time.process_time() - cpu) / max(1e-9, time.monotonic() - start_at))
    return tally


def _keep_off(core: int | None) -> None:
    """Pool initializer: a client process runs on every core but ``core`` (the API servers')."""
    if core is not None:
        psutil.Process().cpu_affinity([c for c in psutil.Process().cpu_affinity() if c != core])


def _pin(pid: int, core: int) -> None:
    """Put the API server ``pid`` (every thread it has now; threads started later inherit their starter's) on
    ``core``."""
    for thread in psutil.Process(pid).threads():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(thread.id, [core])


def run_round(pool: Any, load: Load, clients: int, workers: int, seed: int, warmup: float, seconds: float,
              api_server_pid: int, profiled: dict[str, tuple[int, Path]] | None = None, core: int | None = None
              ) -> tuple[Tally, float | None, dict[str, float] | None, dict[str, tuple[Counter, float]]]:
    """The round's tally, the CPU seconds the API server (``api_server_pid``) spent in its measured window, the
    engine's ``ENGINE_COUNTERS`` over that window (``engine_counts``; None where /metrics did not answer) and, for
    each process of ``profiled`` (by name, its pid and a file for py-spy's output), its stacks sampled over the
    window and its CPU seconds there (py-spy kept off ``core``, the API server's)."""
    start_at = time.monotonic() + 2.0  # every worker's clients start together
    shares = [clients // workers + (i < clients % workers) for i in range(workers)]
    profiled = profiled or {}
    marks: list[tuple[float, dict[str, float] | None, dict[str, float]]] = []
    recordings: dict[str, Recording] = {}

    def mark() -> None:
        if not marks:
            recordings.update({name: Recording(pid, seconds, out, PROFILE_RATE_HZ, core)
                               for name, (pid, out) in profiled.items()})  # fmt: skip
        marks.append((cpu_s(api_server_pid), engine_counts(load.url),
                      {name: cpu_s(pid) for name, (pid, _) in profiled.items()}))

    timers = [threading.Timer(start_at + warmup + at - time.monotonic(), mark) for at in (0.0, seconds)]
    for timer in timers:
        timer.start()
    results = pool.starmap(_worker, [(load, n, seed * 100 + i, start_at, warmup, seconds) for i, n in enumerate(shares)])
    for timer in timers:
        timer.join()
    total = Tally()
    for tally in results:
        total.merge(tally)
    stacks = {name: recording.stacks() for name, recording in recordings.items()}
    if len(marks) != 2:
        return total, None, None, {}
    (cpu0, counts0, each0), (cpu1, counts1, each1) = marks
    engine = None if counts0 is None or counts1 is None else {k: counts1[k] - counts0[k] for k in counts0}
    return total, cpu1 - cpu0, engine, {name: (stacks[name], each1[name] - each0[name]) for name in stacks}


PROFILE_RATE_HZ = 250  # py-spy's samples per second: 5,000 in a 20 s window
PROFILE_PAIRS = (("plain", "vanilla"), ("steered", "plain"), ("monitored", "plain"), ("salted", "vanilla"))

ENGINE_COUNTERS = {
    "vllm:iteration_tokens_total_count": "steps",
    "vllm:generation_tokens_total": "generated_tokens",
    # from the engine client's add_request to the first token: the client's TTFT less this is the time a request
    # spent in the API server before it reached the engine (HTTP, admission, the event loop's queue)
    "vllm:time_to_first_token_seconds_sum": "engine_ttft_s",
    "vllm:time_to_first_token_seconds_count": "first_tokens",
    "vllm:request_queue_time_seconds_sum": "queued_s",  # waiting in the engine's scheduler
    "vllm:request_queue_time_seconds_count": "queued",
}


def engine_counts(url: str) -> dict[str, float] | None:
    """The engine's ``ENGINE_COUNTERS`` so far, from vLLM's own ``/metrics`` (summed over its engines): its steps
    (a step's outputs reach the API server as one message, which its CPU per request follows), generated tokens,
    time to first token and queue time. None where /metrics does not answer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    return parse_engine_counts(text)


def parse_engine_counts(text: str) -> dict[str, float]:
    """``ENGINE_COUNTERS`` from a Prometheus exposition, each summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = dict.fromkeys(ENGINE_COUNTERS.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ENGINE_COUNTERS:
                counts[ENGINE_COUNTERS[sample.name]] += sample.value
    return counts


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def median_interval(values: Sequence[float], level: float = 0.95) -> dict[str, float] | None:
    """A distribution-free interval for the median of ``values`` (independent rounds): the order statistics
    ``[x_(k), x_(n+1-k)]`` with the largest ``k`` whose coverage, ``1 - 2 P(Binomial(n, 1/2) < k)``, is at least
    ``level``; when even ``[min, max]`` covers less (3 rounds: 75%), that interval with its coverage. A target is met
    with that confidence only if the interval's low end reaches it."""
    n = len(values)
    if n < 2:
        return None
    x = sorted(values)

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= n + 1 - (k + 1) and coverage(k + 1) >= level:
        k += 1
    return {"low": x[k - 1], "high": x[n - k], "coverage": coverage(k)}


def _steps_per_request(run: dict[str, Any]) -> float | None:
    engine = run.get("engine")
    return engine["steps"] / run["completed"] if engine and run["completed"] else None


def _tokens_per_step(run: dict[str, Any]) -> float | None:
    engine = run.get("engine")
    return engine["generated_tokens"] / engine["steps"] if engine and engine["steps"] else None


def _mean_ms(run: dict[str, Any], total: str, count: str) -> float | None:
    engine = run.get("engine")
    return engine[total] * 1000 / engine[count] if engine and engine.get(count) else None


def summarize(rounds: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Per configuration the median req/s and TTFT p50; per round and overall the paired ratios."""
    by_config = {c: [r for r in rounds if r["config"] == c] for c in CONFIGS if any(r["config"] == c for r in rounds)}
    out: dict[str, Any] = {"configs": {}, "ratios": {}}
    for config, runs in by_config.items():
        out["configs"][config] = {
            "req_per_s": [r["completed"] / seconds for r in runs],
            "req_per_s_median": median([r["completed"] / seconds for r in runs]),
            "ttft_p50_ms_median": median([r["ttft_p50_ms"] for r in runs if r["ttft_p50_ms"] is not None]),
            "steered_share": median([r["steered"] / r["completed"] for r in runs if r["completed"]]),
            "api_cpu_ms_per_request_median": median([r["api_cpu_s"] * 1000 / r["completed"] for r in runs
                                                     if r.get("api_cpu_s") is not None and r["completed"]]),
            "engine_steps_per_request_median": median([x for x in map(_steps_per_request, runs) if x is not None]),
            "generated_tokens_per_step_median": median([x for x in map(_tokens_per_step, runs) if x is not None]),
            "engine_ttft_ms_median": median([x for r in runs if (x := _mean_ms(r, "engine_ttft_s", "first_tokens"))
                                             is not None]),
            "engine_queue_ms_median": median([x for r in runs if (x := _mean_ms(r, "queued_s", "queued")) is not None]),
        }
    pairs = {"steered_vs_plain": ("steered", "plain"), "plain_vs_vanilla": ("plain", "vanilla"),
             "monitored_vs_plain": ("monitored", "plain"), "salted_vs_vanilla": ("salted", "vanilla")}
    for name, (num, den) in pairs.items():
        if num not in by_config or den not in by_config:
            continue
        paired = [a["completed"] / b["completed"]
                  for a, b in zip(by_config[num], by_config[den], strict=False) if b["completed"]]  # fmt: skip
        out["ratios"][name] = {"per_round": paired, "median": median(paired), "interval": median_interval(paired)}
    return out


@contextlib.contextmanager
def servers(model: Path, extra_args: Sequence[str], workdir: Path, slots: int, monitors: int = 0,
            monitor_layer: int = 0) -> Iterator[dict[str, tuple[str, int]]]:
    """The plugin-free and the hotwire ``vllm serve`` (and with ``monitors``, a hotwire one with readout on),
    started together; by name, their URL and the pid of their API server (the main process: one API server)."""
    from hotwire_api.server_process import free_port, start_server, stop_server, vllm_serve_command, wait_until_ready

    import torch

    base = dict(os.environ)
    if not torch.cuda.is_available():  # vLLM's CPU backend: the soak's environment, short engine starts
        from hotwire_core.cpu_env import with_cpu_env

        base = with_cpu_env(base)
        extra_args = ["--enforce-eager", *extra_args]
    procs: dict[str, Any] = {}
    urls: dict[str, str] = {}
    try:
        for name in ("vanilla", "hotwire", *(("monitored",) if monitors else ())):
            port = free_port()
            env = {**base, "PYTHONUNBUFFERED": "1", "HOTWIRE_SLOTS": str(slots)}
            if name == "vanilla":
                env["VLLM_PLUGINS"] = ""
            if name == "monitored":
                env.update(HOTWIRE_READOUT="1", HOTWIRE_READOUT_PROBES=str(max(4, monitors)),
                           HOTWIRE_READOUT_LAYERS=str(monitor_layer))
            command = [*vllm_serve_command(str(model)), "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
                       *extra_args]  # fmt: skip
            procs[name] = start_server(command, env, workdir / f"server_{name}.log")
            urls[name] = f"http://127.0.0.1:{port}"
            print(f"throughput: {name} server: {' '.join(command[3:])} (log {workdir / f'server_{name}.log'})", flush=True)
        for name, proc in procs.items():
            print(f"throughput: {name} ready after {wait_until_ready(proc, urls[name], 900.0):.0f} s", flush=True)
        yield {name: (url, procs[name].pid) for name, url in urls.items()}
    finally:
        for name, proc in procs.items():
            print(f"throughput: {name} server {stop_server(proc)}", flush=True)


def register_vectors(url: str, ids: Sequence[str], hidden: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with httpx.Client(base_url=url, timeout=60) as http:
        for vector_id in ids:
            vector = rng.standard_normal(hidden).astype(np.float32)
            vector /= np.linalg.norm(vector)
            body = {"id": vector_id, "data": base64.b64encode(vector.tobytes()).decode(), "dtype": "float32",
                    "shape": [hidden]}  # fmt: skip
            response = http.post("/steer/vectors?replace=true", json=body)
            if response.status_code not in (200, 201):
                raise RuntimeError(f"registering {vector_id} failed: {response.status_code} {response.text}")


def add_monitors(url: str, ids: Sequence[str], count: int, layer: int) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        for i in range(count):
            monitor = {"id": f"m{i}", "probe": ids[i % len(ids)], "layer": layer, "threshold": 0.0}
            response = http.post("/steer/monitors?replace=true", json=monitor)
            if response.status_code not in (200, 201):
                raise RuntimeError(f"adding monitor m{i} failed: {response.status_code} {response.text}")


def model_facts(url: str) -> tuple[str, int, int]:
    """The served model's name, hidden size and number of layers (from ``/steer/slots``)."""
    with httpx.Client(base_url=url, timeout=60) as http:
        name = http.get("/v1/models").json()["data"][0]["id"]
        model = http.get("/steer/slots").json()["model"]
    return name, int(model["hidden_size"]), int(model["n_layers"])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="HF folder (default: build --shape)")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                        help="the model to build: tiny (float32, random weights) or a larger shape (bf16, dummy weights)")
    parser.add_argument("--workdir", type=Path, help="for the built model and the server logs")
    parser.add_argument("--server-arg", action="append", default=[], help="extra vllm serve argument (repeatable)")
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--workers", type=int, default=4, help="client processes")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each configuration")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of traffic before each measured window")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--steered-share", type=float, default=0.75)
    parser.add_argument("--ids", type=int, default=8, help="registered vectors the steered requests use")
    parser.add_argument("--slots", type=int, default=16, help="HOTWIRE_SLOTS of the hotwire server")
    parser.add_argument("--scale", type=float, default=4.0, help="scale of a steered entry (drawn in [s, 1.5 s])")
    parser.add_argument("--monitors", type=int, default=0, help="also run the monitored configuration with this "
                        "many monitors (a third server, HOTWIRE_READOUT=1)")
    parser.add_argument("--salted", action="store_true",
                        help="also run the salted configuration: the plugin-free server with --steered-share of the "
                        "requests salted for the prefix cache, as a new steering scale salts them")
    parser.add_argument("--api-core", type=int, default=None,
                        help="run every server's API server on this core and the clients off it, so that each "
                        "configuration's API server has the same core to itself (default: the last core, where "
                        "there are at least 8; -1: no pinning)")
    parser.add_argument("--profile", action="store_true",
                        help="sample each server's API server and engine core with py-spy over every measured window "
                        "and report their CPU per request by package and function, each configuration against its "
                        "baseline (profile in the report; py-spy beside this Python or on PATH)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("throughput.json"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hotwire-throughput-"))
    workdir.mkdir(parents=True, exist_ok=True)
    extra = list(args.server_arg)
    if args.model is None and args.shape == "tiny":
        args.model = build_model(workdir / "tiny", "tiny", weights=True)
        extra = ["--dtype", "float32", "--max-model-len", "4096", *extra]
    elif args.model is None:  # timing only: dummy weights
        args.model = build_model(workdir / args.shape, args.shape, weights=False)
        extra = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "4096", *extra]
    if args.profile:
        py_spy()  # missing: say so now, not after the servers started (a round's sampler starts in a timer thread)
    rounds: list[dict[str, Any]] = []
    failures: Counter = Counter()
    profiles: dict[str, dict[str, list[tuple[Counter, int, float]]]] = {}  # process -> config -> rounds
    configs = (*CONFIGS[:3], *(("monitored",) if args.monitors else ()), *(("salted",) if args.salted else ()))
    n_layers = json.loads((args.model / "config.json").read_text())["num_hidden_layers"]
    with servers(args.model, extra, workdir, args.slots, args.monitors, n_layers // 2) as started:
        urls = {server: url for server, (url, _) in started.items()}
        api_server = {"vanilla": started["vanilla"][1], "plain": started["hotwire"][1], "steered": started["hotwire"][1],
                      **({"monitored": started["monitored"][1]} if args.monitors else {}),
                      **({"salted": started["vanilla"][1]} if args.salted else {})}
        cores = psutil.Process().cpu_affinity()
        core = args.api_core if args.api_core is not None else (cores[-1] if len(cores) >= 8 else -1)
        core = None if core < 0 else core
        if core is not None:
            for _, pid in started.values():
                _pin(pid, core)
            print(f"throughput: the API servers run on core {core}, the clients off it", flush=True)
        profiled_pids: dict[str, dict[str, int]] = {}  # process -> config -> pid
        if args.profile:
            profiled_pids["api_server"] = api_server
            engines = {config: engine_core_pid(pid) for config, pid in api_server.items()}
            if all(engines.values()):
                profiled_pids["engine_core"] = engines
            else:
                print("throughput: no engine core process found: only the API servers are profiled", flush=True)
        name, hidden, n_layers = model_facts(urls["hotwire"])
        ids = tuple(f"tp{i}" for i in range(args.ids))
        register_vectors(urls["hotwire"], ids, hidden, args.seed)
        loads = {
            "vanilla": Load(urls["vanilla"], name, args.max_tokens, 0.0, (), n_layers // 2, args.scale),
            "plain": Load(urls["hotwire"], name, args.max_tokens, 0.0, (), n_layers // 2, args.scale),
            "steered": Load(urls["hotwire"], name, args.max_tokens, args.steered_share, ids, n_layers // 2, args.scale),
        }
        if args.salted:
            loads["salted"] = Load(urls["vanilla"], name, args.max_tokens, 0.0, (), n_layers // 2, args.scale,
                                   salted_share=args.steered_share)
        if args.monitors:
            register_vectors(urls["monitored"], ids, hidden, args.seed)
            add_monitors(urls["monitored"], ids, args.monitors, n_layers // 2)
            loads["monitored"] = Load(urls["monitored"], name, args.max_tokens, 0.0, (), n_layers // 2, args.scale,
                                      args.monitors)
        with multiprocessing.get_context("spawn").Pool(args.workers, _keep_off, (core,)) as pool:
            for r in range(args.rounds):
                order = configs[r % len(configs):] + configs[:r % len(configs)]
                for config in order:
                    profiled = {process: (pids[config], workdir / f"profile_round{r}_{config}_{process}.txt")
                                for process, pids in profiled_pids.items()}  # fmt: skip
                    tally, api_cpu_s, engine, samples = run_round(pool, loads[config], args.clients, args.workers,
                                                                  args.seed + len(rounds), args.warmup, args.seconds,
                                                                  api_server[config], profiled, core)
                    for process, (stacks, spent_s) in samples.items():
                        profiles.setdefault(process, {}).setdefault(config, []).append((stacks, tally.completed, spent_s))
                    failures.update({f"{config}:{k}": v for k, v in tally.failures.items()})
                    ttft = median(tally.ttft_s)
                    rounds.append({"round": r, "config": config, "completed": tally.completed, "steered": tally.steered,
                                   "ttft_p50_ms": None if ttft is None else ttft * 1000, "api_cpu_s": api_cpu_s,
                                   "engine": engine,
                                   "client_busy_max": max(tally.busy, default=None),
                                   "failures": dict(tally.failures)})  # fmt: skip
                    per_request = api_cpu_s * 1000 / tally.completed if api_cpu_s is not None and tally.completed else None
                    print(f"throughput: round {r} {config:8s} {tally.completed / args.seconds:8.2f} req/s"
                          f"  TTFT p50 {rounds[-1]['ttft_p50_ms'] or float('nan'):7.1f} ms"
                          f"  API server CPU {per_request or float('nan'):.3f} ms/request"
                          f"  engine steps {_steps_per_request(rounds[-1]) or float('nan'):.2f}/request"
                          f"  engine TTFT {_mean_ms(rounds[-1], 'engine_ttft_s', 'first_tokens') or float('nan'):.1f} ms"
                          f" (queued {_mean_ms(rounds[-1], 'queued_s', 'queued') or float('nan'):.1f})"
                          f"  busiest client process {max(tally.busy, default=float('nan')):.0%}"
                          f"  failures {dict(tally.failures) or 0}", flush=True)  # fmt: skip
    result = {"command": sys.argv, "args": {k: str(v) for k, v in vars(args).items()}, "api_core": core, "model": name,
              "hidden": hidden, "n_layers": n_layers, "rounds": rounds, "failures": dict(failures),
              **summarize(rounds, args.seconds)}  # fmt: skip
    if profiles:
        result["profile"] = {process: compare(runs, PROFILE_RATE_HZ, PROFILE_PAIRS) for process, runs in profiles.items()}
    with contextlib.suppress(Exception):
        import torch

        result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    with contextlib.suppress(Exception):
        import vllm

        result["vllm"] = vllm.__version__
    args.out.write_text(json.dumps(result, indent=1))
    for config, figures in result["configs"].items():
        print(f"throughput: {config:8s} median {figures['req_per_s_median']:.2f} req/s, TTFT p50 "
              f"{figures['ttft_p50_ms_median']} ms, API server CPU {figures['api_cpu_ms_per_request_median']} "
              "ms/request")  # fmt: skip
    for ratio, figures in result["ratios"].items():
        interval = figures["interval"]
        spread = (f", {interval['coverage']:.0%} interval of the median {interval['low']:.3f}-{interval['high']:.3f}"
                  if interval else "")
        print(f"throughput: {ratio}: median {figures['median']}{spread}, per round {figures['per_round']}")
    for process, report in result.get("profile", {}).items():
        for config, figures in report["configs"].items():
            packages = ", ".join(f"{p} {ms:.3f}" for p, ms in list(figures["by_package"].items())[:8])
            print(f"profile: {process} {config:8s} {figures['ms_per_request']:.3f} ms of sampled CPU per request "
                  f"({figures['sampled_of_measured'] or float('nan'):.0%} of the measured CPU); by package: {packages}")
        for pair, entry in report["differences"].items():
            print(f"profile: {process} {pair}: {entry['ms_per_request']:+.3f} ms of sampled CPU per request; most apart:")
            for kind in ("by_package", "inclusive", "self"):
                for row in entry[kind][:8]:
                    print(f"profile:   {kind:10s} {row['difference']:+.3f} ms  {row['name']}")
    print(f"throughput: failures {dict(failures) or 0}; report {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
