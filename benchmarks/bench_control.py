"""Control-plane cost of hotwire on a live ``vllm serve``, one GPU, one run.

Every server is ``vllm serve`` with hotwire and ``--api-server-count --api-servers``, in its own process group,
on a ``hotwire_core.tiny_model`` shape with dummy weights (bf16 on a GPU, float32 on the CPU), ready when
``/health`` answers. On the server started with ``HOTWIRE_SLOTS=--control-slots``:

- registration: ``--registrations`` times, register a fresh random float32 [n_layers, hidden] vector (multipart
  safetensors) and at once send a 1-token completion steered by it at every layer (its receipt is checked).
  ``usable`` = register time + (that completion's time - median time of the same completion steered by a vector
  already in the bank): how long until the vector can steer a request, first-use upload included.
- decode stall: ``--streams`` streamed completions (steered at every layer, ignore_eos) decode while helper
  processes timestamp every token. Meanwhile this process idles, registers ``--registrations`` vectors one at a
  time, idles, then polls ``GET /steer/slots`` ``--polls`` times fresh and ``--polls`` times with
  ``max_age_ms=1000`` (what a 1 Hz poller sends), then ``--polls`` times vLLM's own ``GET /version`` (a
  trivial route: the floor any route of this server pays under the same load). The polls share one HTTP
  connection, so with several API servers they all reach the same one, and each is timed until its body has
  arrived (no client-side parsing). Each inter-token gap is classed by what it overlapped: a registration, a
  poll, or nothing (idle). stall = p99 gap while registering - p99 idle gap.

All servers start at once. The capacity sweep, on one server per ``--slots`` value: decode ms/token of
``--batch`` streamed steered completions (8 vectors, one middle layer, so 8 rows fit every capacity): each
request's ``(last token - first token) / (N - 1)`` as this process received them, median over the batch. After
one warm-up batch per server, ``--reps`` rounds measure every server once, one at a time (the others idle), in
an order rotated per round; the cost of a capacity is the median over rounds of its ratio to the smallest
capacity in the same round (paired, so the machine's drift hits both sides of a ratio alike).

    python benchmarks/bench_control.py --shape qwen3-8b --out benchmarks/results/x.json   # also writes x.md
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import httpx
import numpy as np

from hotwire_api.headers import RECEIPT_HEADER
from hotwire_api.client import HotwireClient
from hotwire_api.models import SlotStats
from hotwire_core.cpu_env import with_cpu_env
from hotwire_api import server_process
from hotwire_core.tiny_model import SHAPES, ModelShape, build_model

from bench_decode import rotated  # beside this script: one rotation for both benchmarks

MODEL = "bench"
TARGETS = {"usable_p99_ms": 50.0, "stall_ms": 2.0, "slots_p99_ms": 10.0, "capacity_cost_pct": 2.0}
QUIET_S, REGISTER_EVERY_S, POLL_EVERY_S = 1.0, 0.1, 0.01
POLL_MAX_AGE_MS = 1000
BASELINE_ROUTE = "vLLM's GET /version (baseline)"
STREAMS_PER_WORKER = 16
START_TIMEOUT_S = 900.0

Interval = tuple[float, float]


def summarize(values: list[float]) -> dict:
    """Count, p50, p99 (linear interpolation) and max, rounded to µs when the values are ms."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    p50, p99 = np.percentile(values, [50, 99])
    return {"n": len(values), "p50": round(float(p50), 3), "p99": round(float(p99), 3), "max": round(max(values), 3)}


def _overlaps(intervals: list[Interval], starts: list[float], a: float, b: float) -> bool:
    i = bisect.bisect_left(starts, b) - 1  # the last interval starting before b; earlier ones end before it starts
    return i >= 0 and intervals[i][1] > a


def classify_gaps(streams: list[list[float]], busy: dict[str, list[Interval]], window: Interval) -> dict[str, list[float]]:
    """Inter-token gaps (ms) inside ``window``, keyed by the first kind in ``busy`` whose intervals they overlap,
    else ``idle``. The intervals of one kind are sorted and disjoint (sequential requests)."""
    starts = {kind: [s for s, _ in ivs] for kind, ivs in busy.items()}
    gaps: dict[str, list[float]] = {"idle": [], **{kind: [] for kind in busy}}
    for times in streams:
        for a, b in zip(times, times[1:]):
            if a >= window[0] and b <= window[1]:
                kind = next((k for k, ivs in busy.items() if _overlaps(ivs, starts[k], a, b)), "idle")
                gaps[kind].append((b - a) * 1e3)
    return gaps


def paired_change_pct(row: dict, base: dict) -> list[float]:
    """Per round, ``row``'s decode ms/token change (%) against ``base`` measured in the same round."""
    return [(ms / b - 1) * 100 for ms, b in zip(row["decode_ms"], base["decode_ms"], strict=True)]


def capacity_cost_pct(rows: list[dict]) -> float | None:
    """Largest change (%), by absolute value, of a capacity's paired median against the smallest capacity."""
    if len(rows) < 2:
        return None
    base, *others = sorted(rows, key=lambda r: r["slots"])
    return round(max(abs(statistics.median(paired_change_pct(r, base))) for r in others), 2)


def under_load(stall: dict) -> bool:
    """Whether the streams decoded through every phase: none ended before the stop, and each phase overlapped
    some inter-token gap (a phase outlasting ``--stream-tokens`` measures an idle server)."""
    return bool(stall) and not stall.get("streams_finished_early") and not stall.get("phases_without_load")


def judge(result: dict) -> list[dict]:
    """Each target with its limit, the measured value (None: not measured, or not under load) and pass/miss."""
    stall = result.get("decode_stall", {})
    loaded = under_load(stall)
    checks = [
        ("registration usable by the next request, p99 (ms)", "usable_p99_ms",
         result.get("registration", {}).get("usable_ms", {}).get("p99")),
        ("decode stall while registering, p99 gap - idle p99 gap (ms)", "stall_ms",
         stall.get("stall_p99_ms") if loaded else None),
        (f"GET /steer/slots?max_age_ms={POLL_MAX_AGE_MS} (a 1 Hz poller) while streams decode, p99 (ms)", "slots_p99_ms",
         result.get("slots_get_ms", {}).get(f"max_age_ms={POLL_MAX_AGE_MS}", {}).get("p99") if loaded else None),
        ("decode ms/token change across slot capacities (%)", "capacity_cost_pct", capacity_cost_pct(result["capacity"])),
    ]
    return [{"target": name, "limit": TARGETS[key], "value": value, "pass": value is not None and value <= TARGETS[key]}
            for name, key, value in checks]


def _spec(vector_id: str, layer: int | list[int]) -> str:
    return json.dumps({"id": vector_id, "layer": layer, "scale": 0.5})


def _prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(4, 256, n).tolist()  # byte tokens: in the vocabulary of every tiny_model tokenizer


def _body(prompt: list[int], spec: str, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream, "vllm_xargs": {"hotwire": spec}}
    if stream:  # every event then says how many tokens the stream holds (an event can carry several)
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def _vector(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.01).astype(np.float32)


def _ms_since(start: float) -> float:
    return (time.monotonic() - start) * 1e3


def kv_cache_bytes(shape: ModelShape, seqs: int, seq_len: int) -> int:
    """bf16 KV cache for ``seqs`` sequences of ``seq_len`` tokens, with 25% headroom."""
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
    return int(seqs * seq_len * per_token * 1.25)


@contextmanager
def serving(model: Path, shape: ModelShape, slot_counts: list[int], args: argparse.Namespace, gpu: bool,
            log_dir: Path) -> Iterator[dict[int, str]]:
    """One ``vllm serve`` per ``HOTWIRE_SLOTS`` value, started at once (on a GPU each with a fixed KV cache, so
    they share it without memory profiling); yields ``{slots: url}`` once all are healthy and stops them all."""
    max_len = args.prompt_len + max(args.stream_tokens, args.decode_tokens + 1) + 16
    procs, urls = {}, {}
    try:
        for slots in slot_counts:
            port = server_process.free_port()
            cmd = [*server_process.vllm_serve_command(str(model)), "--api-server-count", str(args.api_servers),
                   "--served-model-name", MODEL, "--load-format", "dummy", "--dtype", "bfloat16" if gpu else "float32",
                   "--max-model-len", str(max_len), "--max-num-seqs", str(max(args.streams, args.batch, 8)),
                   "--seed", "0", "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
            if gpu:
                seqs = args.streams + 2 if slots == args.control_slots else 1
                kv = max(kv_cache_bytes(shape, seqs, max_len), kv_cache_bytes(shape, args.batch, args.prompt_len + args.decode_tokens + 16))
                cmd += ["--kv-cache-memory-bytes", str(kv), "--gpu-memory-utilization", "0.05"]
            # The phases steer every layer: HOTWIRE_LAYERS must not restrict the servers.
            env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "HOTWIRE_API_KEY", "HOTWIRE_LAYERS")}
            env.update(HOTWIRE_SLOTS=str(slots), HOTWIRE_STORE="off", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                       VLLM_CACHE_ROOT=str(log_dir / f"cache-slots{slots}"))
            if not gpu:
                env = with_cpu_env(env)
            log = log_dir / f"server-slots{slots}.log"
            procs[slots] = (server_process.start_server(cmd, env, log), log)
            urls[slots] = f"http://127.0.0.1:{port}"
        for slots, (proc, log) in procs.items():
            try:
                took = server_process.wait_until_ready(proc, urls[slots], START_TIMEOUT_S)
            except server_process.ServerExited as exc:
                raise RuntimeError(f"vllm serve (slots={slots}): {exc}; {log}:\n{log.read_text(errors='replace')[-4000:]}")
            print(f"server slots={slots} healthy after {took:.0f} s", flush=True)
        yield urls
    finally:
        for proc, _ in procs.values():
            server_process.stop_server(proc, grace_s=30)


def measure_registration(hw: HotwireClient, http: httpx.Client, shape: ModelShape, n: int, prompt_len: int,
                         rng: np.random.Generator) -> dict:
    every = list(range(shape.num_layers))

    def complete(vector_id: str) -> float:
        start = time.monotonic()
        response = http.post("/v1/completions", json=_body(_prompt(rng, prompt_len), _spec(vector_id, every), 1))
        elapsed = _ms_since(start)
        response.raise_for_status()
        if not response.headers.get(RECEIPT_HEADER, "").startswith(f"{vector_id}@"):
            raise RuntimeError(f"completion naming {vector_id!r} was not steered by it: {dict(response.headers)}")
        return elapsed

    for _ in range(3):
        complete("resident")  # warm-up
    resident = [complete("resident") for _ in range(n)]
    register, first = [], []
    for i in range(n):
        vector = _vector(rng, shape.num_layers, shape.hidden_size)
        start = time.monotonic()
        hw.register(f"fresh{i}", vector)
        register.append(_ms_since(start))
        first.append(complete(f"fresh{i}"))
    base = statistics.median(resident)
    usable = [r + max(0.0, f - base) for r, f in zip(register, first)]
    return {"register_ms": summarize(register), "first_steered_response_ms": summarize(first),
            "resident_steered_response_ms": summarize(resident), "usable_ms": summarize(usable)}


async def _stream(http: httpx.AsyncClient, body: dict, times: list[float], tokens: list[int] | None = None) -> None:
    """Append the arrival time of each event of a streamed completion to ``times`` and, when ``tokens`` is given,
    the stream's token count after it (from the event's usage) to ``tokens``."""
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"stream refused: {response.status_code} {(await response.aread()).decode()[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            arrived = time.monotonic()
            if tokens is None:
                times.append(arrived)
                continue
            event = json.loads(line[len("data: "):])
            if event.get("choices"):  # not the closing usage-only event
                times.append(arrived)
                tokens.append(event["usage"]["completion_tokens"])


def per_token_ms(times: list[float], tokens: list[int]) -> float:
    """ms per token of one stream between its first and last event (an event can carry several tokens)."""
    return (times[-1] - times[0]) / (tokens[-1] - tokens[0]) * 1e3


async def stream_worker(cfg: dict) -> None:
    """Helper process: ``cfg['n']`` streams; prints READY once each has a token, stops them on a stdin line and
    prints every stream's event arrival times (``time.monotonic``, shared by the processes of one machine) and
    how many streams had ended before the stop."""
    rng = np.random.default_rng(cfg["seed"])
    times: list[list[float]] = [[] for _ in range(cfg["n"])]
    async with httpx.AsyncClient(base_url=cfg["url"], timeout=None) as http:
        tasks = [asyncio.create_task(_stream(http, _body(_prompt(rng, cfg["prompt_len"]), cfg["spec"],
                                                          cfg["max_tokens"], stream=True), t)) for t in times]
        while not all(times):
            for task, got in zip(tasks, times):
                if task.done() and not got:
                    task.result()  # raises the stream's error, if it failed
                    raise RuntimeError("a stream ended without a token")
            await asyncio.sleep(0.01)
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        ended = sum(task.done() for task in tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    print("RESULT " + json.dumps({"times": times, "ended": ended}), flush=True)


def _summarize_ms(intervals: list[Interval]) -> dict:
    """:func:`summarize` of how long each call was in flight, in ms."""
    return summarize([(end - start) * 1e3 for start, end in intervals])


def _get_ok(http: httpx.Client, path: str) -> None:
    http.get(path).raise_for_status()


def _timed(calls: list[Callable[[], object]], every_s: float) -> list[Interval]:
    """Make the calls one after the other, ``every_s`` apart; the interval each was in flight."""
    intervals = []
    for call in calls:
        start = time.monotonic()
        call()
        intervals.append((start, time.monotonic()))
        time.sleep(every_s)
    return intervals


def _read_line(proc: subprocess.Popen, prefix: str) -> str:
    line = proc.stdout.readline()
    if not line.startswith(prefix):
        proc.kill()
        raise RuntimeError(f"stream worker: expected {prefix}, got {line[:200]!r} (exit {proc.poll()})")
    return line[len(prefix):]


def measure_under_load(hw: HotwireClient, http: httpx.Client, url: str, shape: ModelShape, args: argparse.Namespace,
                       rng: np.random.Generator) -> tuple[dict, dict]:
    """Decode gaps of ``args.streams`` steered streams around registrations and slot polls; the polls' latency.
    The polls go over ``http``'s one connection (one API server), timed to the end of the body."""
    spec = _spec("resident", list(range(shape.num_layers)))
    workers = []
    for seed, first in enumerate(range(0, args.streams, STREAMS_PER_WORKER)):
        cfg = {"url": url, "n": min(STREAMS_PER_WORKER, args.streams - first), "max_tokens": args.stream_tokens,
               "prompt_len": args.prompt_len, "spec": spec, "seed": seed}
        workers.append(subprocess.Popen([sys.executable, __file__, "--stream-worker", json.dumps(cfg)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    try:
        for worker in workers:
            _read_line(worker, "READY")
        vectors = [_vector(rng, shape.num_layers, shape.hidden_size) for _ in range(args.registrations)]
        begin = time.monotonic()
        time.sleep(QUIET_S)
        busy = {"register": _timed([partial(hw.register, f"live{i}", v) for i, v in enumerate(vectors)],
                                   REGISTER_EVERY_S)}
        time.sleep(QUIET_S)
        busy["slots"] = _timed([partial(_get_ok, http, "/steer/slots")] * args.polls, POLL_EVERY_S)
        polled = _timed([partial(_get_ok, http, f"/steer/slots?max_age_ms={POLL_MAX_AGE_MS}")] * args.polls,
                        POLL_EVERY_S)
        busy["version"] = _timed([partial(_get_ok, http, "/version")] * args.polls, POLL_EVERY_S)
        end = time.monotonic()
        streams, ended = [], 0
        for worker in workers:
            worker.stdin.write("stop\n")
            worker.stdin.flush()
            got = json.loads(_read_line(worker, "RESULT "))
            streams += got["times"]
            ended += got["ended"]
            worker.wait(30)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    gaps = classify_gaps(streams, busy, (begin, end))
    stall = {kind: summarize(values) for kind, values in gaps.items()}
    for stat in ("p99", "max"):
        idle, reg = stall["idle"][stat], stall["register"][stat]
        stall[f"stall_{stat}_ms"] = None if idle is None or reg is None else round(reg - idle, 3)
    stall["streams_finished_early"] = ended
    stall["phases_without_load"] = [kind for kind in busy if not gaps[kind]]
    latency = {"fresh": _summarize_ms(busy["slots"]), f"max_age_ms={POLL_MAX_AGE_MS}": _summarize_ms(polled),
               BASELINE_ROUTE: _summarize_ms(busy["version"])}
    return stall, latency


async def _decode_batch(http: httpx.AsyncClient, specs: list[str], args: argparse.Namespace,
                        rng: np.random.Generator) -> float:
    """Decode ms/token of one batch of streamed steered completions: the median over the batch of each request's
    ms per token between its first and last event, as this process received them."""
    times: list[list[float]] = [[] for _ in specs]
    tokens: list[list[int]] = [[] for _ in specs]
    await asyncio.gather(*(_stream(http, _body(_prompt(rng, args.prompt_len), spec, 1 + args.decode_tokens,
                                               stream=True), t, n) for spec, t, n in zip(specs, times, tokens)))
    return round(statistics.median(per_token_ms(t, n) for t, n in zip(times, tokens)), 4)


async def measure_capacity(urls: dict[int, str], shape: ModelShape, args: argparse.Namespace,
                           rng: np.random.Generator) -> list[dict]:
    """Decode ms/token per server (slot capacity) and round: a warm-up batch each, then ``args.reps`` rounds
    measuring every server once, in an order rotated per round. Round ``k`` is ``decode_ms[k]`` of every row."""
    specs = [_spec(f"cap{i % 8}", shape.num_layers // 2) for i in range(args.batch)]
    limits = httpx.Limits(max_connections=args.batch)
    clients = {s: httpx.AsyncClient(base_url=url, timeout=None, limits=limits) for s, url in urls.items()}
    try:
        for http in clients.values():
            await _decode_batch(http, specs, args, rng)  # first sight of this batch
        decode: dict[int, list[float]] = {s: [] for s in urls}
        for k in range(args.reps):
            for slots in rotated(list(urls), k):
                decode[slots].append(await _decode_batch(clients[slots], specs, args, rng))
    finally:
        for http in clients.values():
            await http.aclose()
    return [{"slots": s, "decode_ms": ms} for s, ms in decode.items()]


def _table(rows: dict[str, dict]) -> list[str]:
    return ["| | n | p50 | p99 | max |", "|---|---|---|---|---|",
            *(f"| {name} | {s['n']} | {s['p50']} | {s['p99']} | {s['max']} |" for name, s in rows.items())]


def _verdict(target: dict) -> str:
    if target["value"] is None:
        return "not measured"
    return "pass" if target["pass"] else "MISS"


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = ["# hotwire control plane", "", *(f"- {k}: `{v}`" for k, v in meta.items() if k != "method"), "",
             "| target | limit | measured | |", "|---|---|---|---|",
             *(f"| {t['target']} | {t['limit']} | {t['value']} | {_verdict(t)} |" for t in result["targets"])]
    if "registration" in result:
        lines += ["", "## Registration (ms)", "", *_table(result["registration"])]
    if "decode_stall" in result:
        stall = result["decode_stall"]
        lines += ["", f"## Inter-token gaps of {meta['streams']} streams, by what they overlapped (ms)", "",
                  *_table({k: stall[k] for k in ("idle", "register", "slots", "version")}), "",
                  f"stall: p99 {stall['stall_p99_ms']} ms, max {stall['stall_max_ms']} ms; streams that ran out of "
                  f"tokens before the end: {stall['streams_finished_early']}; phases the streams did not overlap: "
                  f"{stall.get('phases_without_load') or 'none'}", "",
                  "## GET /steer/slots and a trivial vLLM route while the streams decode (ms)", "", *_table(result["slots_get_ms"])]
    if result["capacity"]:
        base = min(result["capacity"], key=lambda r: r["slots"])
        lines += ["", f"## Decode ms/token vs slot capacity (batch {meta['batch']}, {len(base['decode_ms'])} rounds)",
                  "", f"| HOTWIRE_SLOTS | median | min-max | vs {base['slots']} slots, paired (median, min..max) |",
                  "|---|---|---|---|"]
        for r in sorted(result["capacity"], key=lambda r: r["slots"]):
            change = paired_change_pct(r, base)
            paired = "—" if r is base else (f"{statistics.median(change):+.2f}% "
                                             f"({min(change):+.1f}..{max(change):+.1f})")
            lines.append(f"| {r['slots']} | {statistics.median(r['decode_ms']):.3f} | {min(r['decode_ms']):.3f}-"
                         f"{max(r['decode_ms']):.3f} | {paired} |")
    return "\n".join(lines)


def _meta(args: argparse.Namespace, gpu: bool, shape: ModelShape, log_dir: Path) -> dict:
    import torch
    import vllm

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gpu": torch.cuda.get_device_name(0) if gpu else "cpu",
            "vllm": vllm.__version__, "torch": torch.__version__,
            "shape": f"{args.shape} ({shape.num_layers} layers x {shape.hidden_size} hidden)",
            "streams": args.streams, "batch": args.batch, "control_slots": args.control_slots,
            "api_servers": args.api_servers,
            "command": " ".join(sys.argv), "server_logs": str(log_dir), "method": __doc__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-8b", help="a shape from hotwire_core.tiny_model.SHAPES")
    parser.add_argument("--streams", type=int, default=64, help="streams decoding during the stall and slots phases")
    parser.add_argument("--stream-tokens", type=int, default=4000,
                        help="max_tokens per stream: outlast the phases (prompt + this <= 4096 - 16)")
    parser.add_argument("--registrations", type=int, default=50)
    parser.add_argument("--polls", type=int, default=200)
    parser.add_argument("--slots", default="16,256,4096", help="HOTWIRE_SLOTS values of the capacity sweep")
    parser.add_argument("--control-slots", type=int, default=256,
                        help="HOTWIRE_SLOTS of the control phases' server (>= 2 x n_layers; 0: skip the phases)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10, help="rounds of the capacity sweep")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--api-servers", type=int, default=1,
                        help="vLLM's --api-server-count: API server processes sharing the port and the streams")
    parser.add_argument("--out", type=Path, help="JSON results, rewritten after each server; the summary goes to .md")
    parser.add_argument("--stream-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stream_worker:
        return asyncio.run(stream_worker(json.loads(args.stream_worker)))

    import torch

    gpu = torch.cuda.is_available()
    shape = SHAPES[args.shape]
    model = build_model(Path(tempfile.gettempdir()) / f"hotwire-bench-{args.shape}", args.shape, weights=False)
    log_dir = Path(tempfile.mkdtemp(prefix="hotwire-bench-control-"))
    sweep = [int(s) for s in args.slots.split(",")]
    rng = np.random.default_rng(0)
    result: dict = {"meta": _meta(args, gpu, shape, log_dir), "capacity": []}
    slot_counts = sweep + ([args.control_slots] if args.control_slots not in [0, *sweep] else [])

    def save() -> None:
        result["targets"] = judge(result)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
            args.out.with_suffix(".md").write_text(markdown(result) + "\n")

    with serving(model, shape, slot_counts, args, gpu, log_dir) as urls:
        if args.control_slots:
            url = urls[args.control_slots]
            with HotwireClient(url) as hw, httpx.Client(base_url=url, timeout=120.0) as http:
                hw.register("resident", _vector(rng, shape.num_layers, shape.hidden_size))
                result["registration"] = measure_registration(hw, http, shape, args.registrations, args.prompt_len, rng)
                result["decode_stall"], result["slots_get_ms"] = measure_under_load(hw, http, url, shape, args, rng)
                SlotStats.model_validate(http.get("/steer/slots").json())  # the polled route answers what it should
            save()
        for slots in sweep:
            with HotwireClient(urls[slots]) as hw:
                for k in range(8):
                    hw.register(f"cap{k}", _vector(rng, shape.hidden_size))
        result["capacity"] = asyncio.run(measure_capacity({s: urls[s] for s in sweep}, shape, args, rng))
        save()
    print(markdown(result))


if __name__ == "__main__":
    main()
