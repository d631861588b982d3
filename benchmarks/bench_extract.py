"""Extraction under load: how long ``POST /steer/vectors/extract`` takes while the server decodes other streams,
and how much it slows those streams against the same prompts sent as ordinary requests.

One ``vllm serve`` with ``HOTWIRE_CAPTURE=1`` (dummy weights, graphs on). Each round starts ``--streams`` streaming
completions (``max_tokens`` long, ``ignore_eos``, usage on every chunk) from ``--client-procs`` processes, waits
``--settle`` seconds and then runs one of three bursts, the order rotated per round:

    none        nothing: the streams' undisturbed pace
    extract     one extraction: ``--pairs`` positive and as many negative prompts of ``--prompt-tokens`` tokens,
                ``--layers`` middle layers, ``mean_diff`` at the last token
    ordinary    the same number of prompts of the same length as ordinary one-token completions, all at once

A stream's pace is measured over a fixed ``--window`` from the burst's start (longer than either burst, so both put
all their work in it): the time between its first chunk at or after the start and its last chunk at or before the
window's end, over the tokens between them (``usage.completion_tokens`` on each chunk); a round's figure is the
median over streams. The clients speak plain HTTP and skip loading CA certificates (``verify=False``), which took
up to minutes on a loaded development CPU. A fixed window charges each burst for all the decode time it took from the streams, however
fast it ended. Every burst uses fresh prompts (random words), so neither is served from the prefix cache.

Reported per round and as medians: the burst's wall time, the streams' ms/token over the window, and the ratio of
the extraction's stream pace to the ordinary burst's (the target: extraction under 2 s, ratio at most 1.05).

    python benchmarks/bench_extract.py --shape qwen3-4b --rounds 3 --out extract.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

WORDS = ("river stone light paper window garden music silver morning quiet engine letter bridge autumn coffee "
         "mountain signal cloud harbor pencil shadow velvet thunder lantern meadow copper whisper canvas orbit "
         "ember glacier compass feather harvest marble").split()


def prompts(tokenizer: Any, n: int, length: int, rng: random.Random) -> list[str]:
    """``n`` prompts of random words, each the shortest such text with at least ``length`` tokens."""
    out = []
    for _ in range(n):
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words))) < length:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words))
    return out


async def _streams(url: str, model: str, n: int, max_tokens: int, until: float) -> list[list[tuple[float, int]]]:
    """``n`` streaming completions; per stream its chunks' (arrival time, completion tokens so far)."""
    body = {"model": model, "prompt": "the quiet river", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    async def one(client: httpx.AsyncClient) -> list[tuple[float, int]]:
        seen: list[tuple[float, int]] = []
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"stream answered {response.status_code}: {await response.aread()!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    seen.append((time.time(), usage["completion_tokens"]))
                if time.time() > until:
                    break  # the round is over: closing the stream aborts the request
        return seen

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, verify=False) as client:
        return list(await asyncio.gather(*(one(client) for _ in range(n))))


def _stream_proc(args: tuple[str, str, int, int, float]) -> list[list[tuple[float, int]]]:
    return asyncio.run(_streams(*args))


def pace_ms(stream: list[tuple[float, int]], start: float, end: float) -> float | None:
    inside = [(t, k) for t, k in stream if start <= t <= end]
    if len(inside) < 2 or inside[-1][1] == inside[0][1]:
        return None
    return 1000 * (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1])


async def _extract(url: str, pos: list[str], neg: list[str], layers: list[int], vector_id: str) -> dict[str, Any]:
    body = {"id": vector_id, "positive": pos, "negative": neg, "layers": layers, "method": "mean_diff",
            "position": "last", "replace": True}
    async with httpx.AsyncClient(base_url=url, timeout=600, verify=False) as client:
        response = await client.post("/steer/vectors/extract", json=body)
    if response.status_code not in (200, 201):
        raise RuntimeError(f"extraction answered {response.status_code}: {response.text}")
    return response.json()


async def _ordinary(url: str, model: str, texts: list[str]) -> None:
    limits = httpx.Limits(max_connections=len(texts), max_keepalive_connections=len(texts))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, verify=False) as client:
        answers = await asyncio.gather(*(client.post("/v1/completions", json={
            "model": model, "prompt": text, "max_tokens": 1, "temperature": 0.0}) for text in texts))
    bad = [a.status_code for a in answers if a.status_code != 200 or a.json()["usage"]["completion_tokens"] != 1]
    if bad:
        raise RuntimeError(f"{len(bad)} ordinary requests failed: {bad[:5]}")


def run_round(pool: Any, args: argparse.Namespace, url: str, model: str, tokenizer: Any, layers: list[int],
              burst: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    texts = prompts(tokenizer, 2 * args.pairs, args.prompt_tokens, rng)
    until = time.time() + args.settle + args.window + 1.0  # the streams stop a second after the window
    per_proc = args.streams // args.client_procs
    streaming = pool.map_async(_stream_proc, [(url, model, per_proc, args.max_tokens, until)] * args.client_procs)
    time.sleep(args.settle)
    start = time.time()
    result: dict[str, Any] = {"burst": burst}
    if burst == "extract":
        answer = asyncio.run(_extract(url, texts[: args.pairs], texts[args.pairs :], layers, f"bench-{seed}"))
        result["best_separation"] = max((row["separation"] or 0.0) for row in answer["layers"])
    elif burst == "ordinary":
        asyncio.run(_ordinary(url, model, texts))
    done = time.time()
    if done > start + args.window:
        raise RuntimeError(f"the {burst} burst took {done - start:.1f} s, longer than --window")
    time.sleep(start + args.window - done)
    streams = [s for chunk in streaming.get() for s in chunk]
    paces = [p for p in (pace_ms(s, start, start + args.window) for s in streams) if p is not None]
    result.update(wall_s=done - start, streams=len(streams), streams_paced=len(paces),
                  stream_ms_per_token=statistics.median(paces) if paces else None,
                  prompt_tokens=statistics.mean(len(tokenizer.encode(t)) for t in texts))
    print(f"extract-bench: {json.dumps(result)}", flush=True)
    return result


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    by = {b: [r for r in rounds if r["burst"] == b] for b in ("none", "extract", "ordinary")}
    med = {b: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "stream_ms_per_token")}
           for b, rs in by.items() if rs}
    pairs = [e["stream_ms_per_token"] / o["stream_ms_per_token"] for e, o in zip(by["extract"], by["ordinary"])]
    return {"median": med, "extract_over_ordinary_pace": pairs,
            "extract_over_ordinary_pace_median": statistics.median(pairs) if pairs else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-4b", help="a shape from hotwire_core.tiny_model.SHAPES")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8, help="this many middle layers")
    parser.add_argument("--rounds", type=int, default=3, help="each runs all three bursts")
    parser.add_argument("--max-tokens", type=int, default=3000)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds the streams run before a burst")
    parser.add_argument("--window", type=float, default=3.0, help="seconds from a burst's start the pace spans")
    parser.add_argument("--kv-cache-gib", type=float, default=40.0)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from hotwire_api.server_process import free_port, start_server, stop_server, vllm_serve_command, wait_until_ready
    from hotwire_core.cpu_env import with_cpu_env
    from hotwire_core.tiny_model import SHAPES, build_model

    workdir = Path(tempfile.mkdtemp(prefix="hotwire-extract-bench-"))
    model_dir = build_model(workdir / "model", args.shape, weights=False, dtype="bfloat16")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    n_layers = SHAPES[args.shape].num_layers
    layers = list(range(n_layers // 2 - args.layers // 2, n_layers // 2 - args.layers // 2 + args.layers))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HOTWIRE_CAPTURE": "1", "HOTWIRE_CAPTURE_ROWS": str(2 * args.pairs)}
    extra = ["--dtype", "bfloat16", "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
    if not torch.cuda.is_available():  # vLLM's CPU backend: only to try the script out
        env, extra = with_cpu_env(env), ["--enforce-eager", "--dtype", "float32"]
    command = [*vllm_serve_command(str(model_dir)), "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
               "--load-format", "dummy", "--max-model-len", str(args.max_tokens + 512), "--max-num-seqs", "256",
               *extra]
    proc = start_server(command, env, workdir / "server.log")
    rounds: list[dict[str, Any]] = []
    try:
        print(f"extract-bench: server ready after {wait_until_ready(proc, url, 900.0):.0f} s "
              f"(log {workdir / 'server.log'})", flush=True)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        bursts = ["none", "extract", "ordinary"]
        with multiprocessing.get_context("spawn").Pool(args.client_procs) as pool:
            run_round(pool, args, url, model, tokenizer, layers, "extract", seed=10_000)  # warm-up, not recorded
            for r in range(args.rounds):
                for k in range(3):
                    burst = bursts[(r + k) % 3]
                    rounds.append(run_round(pool, args, url, model, tokenizer, layers, burst, seed=100 * r + k))
    finally:
        print(f"extract-bench: server {stop_server(proc)}", flush=True)
    report = {"command": " ".join(sys.argv), "shape": args.shape, "layers": layers, "streams": args.streams,
              "pairs": args.pairs, "prompt_tokens": args.prompt_tokens, "rounds": rounds, **summarize(rounds)}
    print(json.dumps(report, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
